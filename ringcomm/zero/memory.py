"""The ZeRO paper's memory formulas (Rajbhandari et al., 2020, Figure 1) and the estimator table.

With Φ parameters, N data-parallel ranks, ``param_bytes`` (P) and ``grad_bytes`` (G) bytes per
parameter and gradient element, and K bytes of optimizer state per parameter (Adam in mixed
precision: fp32 master copy, momentum and variance, K = 4 + 4 + 4 = 12), one rank holds:

=====  =====================  ==============================
stage  partitioned            bytes per rank (P = G = 2, K = 12)
=====  =====================  ==============================
0      nothing (plain DP)     (P + G + K)·Φ        = 16Φ
1      optimizer states       (P + G)·Φ + K·Φ/N    = 4Φ + 12Φ/N
2      + gradients            P·Φ + (G + K)·Φ/N    = 2Φ + 14Φ/N
3      + parameters           (P + G + K)·Φ/N      = 16Φ/N
=====  =====================  ==============================

Units: bytes; GB = 1e9 bytes (as the paper). :class:`ringcomm.zero.ZeroShardManager` holds exactly
these amounts with Φ its padded parameter count (see ``memory_report``).
"""

from __future__ import annotations

import re

STAGES = (0, 1, 2, 3)

_COUNT_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*")
_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def _check(num_params: float, world_size: int, stage: int, param_bytes: float, grad_bytes: float, k: float) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3; got {stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1; got {world_size!r}")
    if not num_params >= 0:
        raise ValueError(f"num_params must be >= 0; got {num_params!r}")
    for name, v in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes), ("k", k)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0 bytes per parameter; got {v!r}")


def memory_breakdown(
    num_params: float, world_size: int, stage: int, *, param_bytes: float = 2, grad_bytes: float = 2, k: float = 12
) -> dict[str, float]:
    """Bytes per rank of model states, by kind: ``params``, ``grads``, ``optimizer`` (the K bytes).

    ``num_params`` is Φ (elements), ``world_size`` N, ``stage`` 0-3; ``param_bytes``/``grad_bytes``
    are bytes per element of the working-precision parameters and gradients, ``k`` the optimizer's
    bytes per parameter. See the module docstring for the formulas.
    """
    _check(num_params, world_size, stage, param_bytes, grad_bytes, k)
    phi, n = num_params, world_size
    return {
        "params": param_bytes * phi / (n if stage >= 3 else 1),
        "grads": grad_bytes * phi / (n if stage >= 2 else 1),
        "optimizer": k * phi / (n if stage >= 1 else 1),
    }


def estimate_memory(
    num_params: float, world_size: int, stage: int, *, param_bytes: float = 2, grad_bytes: float = 2, k: float = 12
) -> float:
    """Bytes per rank of model states (parameters, gradients, optimizer states) under ZeRO ``stage``.

    Defaults are the paper's mixed-precision Adam: 2-byte parameters and gradients, K = 12.
    ``estimate_memory(7.5e9, 64, 0)`` is 1.2e11 (120 GB); stages 1-3 give 31.4, 16.6 and 1.9 GB.
    """
    return sum(
        memory_breakdown(num_params, world_size, stage, param_bytes=param_bytes, grad_bytes=grad_bytes, k=k).values()
    )


def _num(x: float) -> str:
    return f"{x:g}"


def formula(stage: int, *, param_bytes: float = 2, grad_bytes: float = 2, k: float = 12) -> str:
    """The stage's formula in Φ and N with the byte counts folded in, e.g. ``"2Φ + 14Φ/N"``."""
    _check(0, 1, stage, param_bytes, grad_bytes, k)
    full = {0: param_bytes + grad_bytes + k, 1: param_bytes + grad_bytes, 2: param_bytes, 3: 0}[stage]
    part = {0: 0, 1: k, 2: grad_bytes + k, 3: param_bytes + grad_bytes + k}[stage]
    terms = ([f"{_num(full)}Φ"] if full else []) + ([f"{_num(part)}Φ/N"] if part else [])
    return " + ".join(terms) or "0"


def parse_count(text: str | int | float) -> int:
    """A parameter count: ``"7.5B"`` -> 7500000000. Suffixes K, M, B (or G), T are powers of 1000
    (parameter counts, as in "GPT-2 1.5B"); plain numbers and ``1.5e9`` work too."""
    if isinstance(text, bool):
        raise ValueError(f"invalid parameter count {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _COUNT_RE.fullmatch(str(text))
        if not m:
            raise ValueError(
                f"invalid parameter count {text!r}: expected a number with an optional suffix K, M, B or T "
                "(powers of 1000), e.g. 125M, 7.5B, 1.5e9"
            )
        value = float(m.group(1)) * _COUNT_SUFFIX[m.group(2).upper()]
    if not value >= 0 or value != int(value):
        raise ValueError(f"a parameter count must be a whole number >= 0; got {text!r} = {value!r}")
    return int(value)


def format_estimate(
    num_params: int,
    world_size: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    k: float = 12,
    stages: tuple[int, ...] = STAGES,
) -> str:
    """The estimator's table: one line per stage with the formula, its value and bytes per rank."""
    lines = [
        f"Model-state memory per rank: Φ = {num_params:,} parameters, N = {world_size} ranks, "
        f"{_num(param_bytes)} B/parameter, {_num(grad_bytes)} B/gradient, K = {_num(k)} B/parameter "
        "of optimizer state (GB = 1e9 bytes)",
    ]
    rows = [("stage", "partitions", "formula", "GB/rank", "bytes/rank")]
    what = {0: "none (data parallel)", 1: "optimizer states", 2: "+ gradients", 3: "+ parameters"}
    for s in stages:
        total = estimate_memory(num_params, world_size, s, param_bytes=param_bytes, grad_bytes=grad_bytes, k=k)
        f = formula(s, param_bytes=param_bytes, grad_bytes=grad_bytes, k=k)
        rows.append((str(s), what[s], f, f"{total / 1e9:.1f} GB", f"{total:,.0f}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        lines.append(
            "  ".join(c.rjust(w) if j >= 3 else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip()
        )
    return "\n".join(lines)
