"""``python -m ringcomm.zero estimate --params 7.5B --world-size 64``: the ZeRO memory table.

Prints the bytes per rank of model states for ZeRO stages 0-3 with their formulas (see
:mod:`ringcomm.zero.memory`). Options set the precision: ``--param-bytes``, ``--grad-bytes`` and
``--k`` (optimizer bytes per parameter), or ``--precision`` for common presets.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .memory import STAGES, format_estimate, parse_count

#: --precision presets: (parameter bytes, gradient bytes, K)
PRESETS = {
    "mixed": (2, 2, 12),  # fp16/bf16 params and grads, fp32 master + Adam moments (the paper)
    "fp32": (4, 4, 12),  # fp32 params and grads; master, momentum, variance in fp32 (as ZeroShardManager keeps)
    "fp64": (8, 8, 24),  # fp64 params and grads; fp64 master and moments
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringcomm.zero", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="print model-state memory per rank for ZeRO stages 0-3")
    est.add_argument(
        "--params", "-p", required=True, help="parameter count Φ: 7.5B, 125M, 1.5e9 (suffixes are 1000-based)"
    )
    est.add_argument("--world-size", "-n", type=int, required=True, help="data-parallel ranks N")
    est.add_argument("--stage", type=int, choices=STAGES, action="append", help="only this stage (repeatable)")
    est.add_argument(
        "--precision",
        choices=sorted(PRESETS),
        default="mixed",
        help="preset for the byte counts: mixed = 2/2/12 (default), fp32 = 4/4/12, fp64 = 8/8/24",
    )
    est.add_argument(
        "--param-bytes", type=float, default=None, help="bytes per parameter element (overrides the preset)"
    )
    est.add_argument("--grad-bytes", type=float, default=None, help="bytes per gradient element (overrides the preset)")
    est.add_argument(
        "--k", type=float, default=None, help="optimizer-state bytes per parameter, K (overrides the preset)"
    )
    a = ap.parse_args(argv)
    try:
        phi = parse_count(a.params)
    except ValueError as e:
        ap.error(str(e))
    if a.world_size < 1:
        ap.error(f"--world-size must be >= 1; got {a.world_size}")
    p, g, k = PRESETS[a.precision]
    p = p if a.param_bytes is None else a.param_bytes
    g = g if a.grad_bytes is None else a.grad_bytes
    k = k if a.k is None else a.k
    for name, v in (("--param-bytes", p), ("--grad-bytes", g), ("--k", k)):
        if not v >= 0:
            ap.error(f"{name} must be >= 0; got {v}")
    stages = tuple(sorted(set(a.stage))) if a.stage else STAGES
    print(format_estimate(phi, a.world_size, param_bytes=p, grad_bytes=g, k=k, stages=stages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
