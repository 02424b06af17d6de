"""Train a small MLP data-parallel with ZeRO (ringcomm.zero): the same losses for every stage.

    mpiexec -n 4 python examples/train_zero.py --stage 3
    mpiexec -n 2 python examples/train_zero.py --stage 2 --dtype float16      # loss scaling on

Every rank draws the same global batch each step and trains on its slice of it; the manager
averages the gradients, so the losses do not depend on the stage nor (up to rounding) on the
number of ranks. Forward and backward are written with numpy (CuPy on a GPU). With stage 3 the
parameters are gathered one layer at a time, for forward and again for backward, as ZeRO-3 does.
Rank 0 prints the loss per step, then the memory report and the last step's communication.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

import ringcomm
from ringcomm.zero import ZeroShardManager, estimate_memory


def init_params(sizes: Sequence[int], dtype: Any, rng: np.random.Generator) -> list[np.ndarray]:
    """[W1, b1, W2, b2, ...] for layer widths ``sizes`` (Xavier-uniform weights, zero biases)."""
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        params.append(rng.uniform(-bound, bound, (fan_in, fan_out)).astype(dtype))
        params.append(np.zeros(fan_out, dtype))
    return params


def compute_dtype(dtype: Any) -> Any:
    """Half-precision parameters are computed with in float32 (mixed precision)."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def forward(xp: Any, layer: Any, nlayers: int, x: Any) -> list[Any]:
    """Activations [x, a1, ..., out] (``xp``: numpy or cupy); ``layer(k)`` is a context manager
    yielding (W, b) of layer k. Hidden layers use tanh; the last one is linear. Computed in x's
    dtype (float32 for half-precision parameters)."""
    acts = [x]
    for k in range(nlayers):
        with layer(k) as (w, b):
            z = acts[-1] @ w.astype(x.dtype) + b.astype(x.dtype)
        acts.append(xp.tanh(z) if k < nlayers - 1 else z)
    return acts


def backward(layer: Any, nlayers: int, acts: list[Any], dout: Any) -> list[Any]:
    """Gradients [dW1, db1, ...] of the loss whose gradient with respect to the output is ``dout``."""
    grads: list[Any] = [None] * (2 * nlayers)
    d = dout
    for k in reversed(range(nlayers)):
        grads[2 * k] = acts[k].T @ d
        grads[2 * k + 1] = d.sum(axis=0)
        if k > 0:
            with layer(k) as (w, _):
                d = (d @ w.astype(d.dtype).T) * (1.0 - acts[k] * acts[k])
    return grads


def batch(step: int, seed: int, n: int, din: int, teacher: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step`` (the same on every rank): inputs and a teacher network's outputs."""
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((n, din))
    h = x
    for k in range(0, len(teacher), 2):
        h = h @ teacher[k] + teacher[k + 1]
        if k < len(teacher) - 2:
            h = np.tanh(h)
    return x, h


def main(argv: Sequence[str] | None = None, comm: ringcomm.Communicator | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=("float16", "bfloat16", "float32", "float64"))
    ap.add_argument("--batch", type=int, default=64, help="global batch (rows per step, split over the ranks)")
    ap.add_argument("--widths", default="32,64,64,8", help="layer widths, input to output")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="<= 0 turns clipping off")
    ap.add_argument("--loss-scale", default=None, help="'dynamic', a number, or 'none' (default: dynamic for float16)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"), help="auto: a GPU when CuPy finds one")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    comm = comm or ringcomm.init()
    n, rank = comm.size, comm.rank

    xp = np
    if a.device != "cpu":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                cupy.cuda.Device(comm.node_comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
                xp = cupy
        except Exception:
            if a.device == "gpu":
                raise
    dtype = ringcomm.bfloat16 if a.dtype == "bfloat16" else np.dtype(a.dtype)
    cdt = compute_dtype(dtype)
    if a.loss_scale is None:
        loss_scale: Any = "dynamic" if a.dtype == "float16" else None
    elif a.loss_scale.lower() == "none":
        loss_scale = None
    elif a.loss_scale == "dynamic":
        loss_scale = "dynamic"
    else:
        loss_scale = float(a.loss_scale)
    widths = [int(w) for w in a.widths.split(",")]
    nlayers = len(widths) - 1

    params = init_params(widths, np.float64, np.random.default_rng(a.seed))
    teacher = init_params(widths, np.float64, np.random.default_rng(a.seed + 1000))
    for k in range(1, len(teacher), 2):
        teacher[k][:] = 0.1
    mgr = ZeroShardManager(
        comm,
        [xp.asarray(p.astype(dtype)) for p in params],
        stage=a.stage,
        lr=a.lr,
        weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm if a.max_grad_norm > 0 else None,
        loss_scale=loss_scale,
    )
    del params

    def layer(k: int) -> Any:
        return mgr.gathered([2 * k, 2 * k + 1])  # stage 3: gathers this layer only; else no-op

    rows = [(r * a.batch // n, (r + 1) * a.batch // n) for r in range(n)]
    lo, hi = rows[rank]
    if rank == 0:
        print(
            f"ZeRO stage {a.stage}, {n} ranks, {a.dtype} parameters ({mgr.layout.count} elements, padded "
            f"{mgr.layout.padded}), {'GPU' if xp is not np else 'CPU'}, loss scale {loss_scale}"
        )
    losses = []
    for t in range(a.steps):
        xg, yg = batch(t, a.seed, a.batch, widths[0], teacher)
        x, y = xp.asarray(xg[lo:hi].astype(cdt)), xp.asarray(yg[lo:hi].astype(cdt))
        acts = forward(xp, layer, nlayers, x)
        diff = acts[-1] - y
        local = np.array([float((diff * diff).sum()) / 2.0])
        # d(global mean loss)/d(out) for this rank's rows, times N because the manager averages over ranks
        dout = diff * (mgr.loss_scale * n / a.batch)
        grads = [g.astype(dtype) for g in backward(layer, nlayers, acts, dout)]
        comm.all_reduce(local)  # the loss of the global batch (8 bytes; counted in comm_bytes)
        loss = float(local[0]) / a.batch
        applied = mgr.step(grads)
        losses.append(loss)
        if rank == 0:
            note = "" if applied else f"  (overflow: step skipped, loss scale now {mgr.loss_scale:g})"
            print(f"step {t + 1:3d}  loss {loss:.6f}{note}")

    report = mgr.memory_report()
    if rank == 0:
        total = sum(report.values())
        phi = mgr.layout.padded
        print(f"memory report (bytes on each rank; Φ = {phi} padded elements, N = {n}):")
        for k, v in report.items():
            print(f"  {k:<11} {v:>10,}")
        pb, kb = mgr.dtype.itemsize, 3 * mgr.master_dtype.itemsize  # bytes per parameter/gradient, K
        formula = estimate_memory(phi, n, a.stage, param_bytes=pb, grad_bytes=pb, k=kb)
        print(
            f"  {'total':<11} {total:>10,}   (ZeRO formula for stage {a.stage}, P = G = {pb}, K = {kb}: {formula:,.0f})"
        )
        k = 3 if a.stage == 3 else 2  # stage 3: all-gather for forward and backward + reduce-scatter
        ring = k * (n - 1) * phi * mgr.dtype.itemsize // n
        print(
            f"communication in the last step: {mgr.comm_bytes:,} bytes sent by rank 0; the ring volume of "
            f"{k}(N-1)/N·Φ elements is {ring:,} bytes (plus the loss and norm scalars; stage 3 here "
            "gathers layer by layer, by broadcast from the owners)"
        )
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
