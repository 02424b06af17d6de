"""AdamW on one shard: the host (numpy) implementation, and the dispatch to the fused CUDA kernel.

The update, for every element, with ``t = step`` (1-based) — PyTorch's ``torch.optim.AdamW``
(decoupled weight decay: the parameter is multiplied by ``1 - lr * weight_decay`` before the Adam
step)::

    g    = grad * grad_scale                  # unscale (1 / (N * loss_scale)) and clip folded in
    m    = beta1 * m + (1 - beta1) * g
    v    = beta2 * v + ((1 - beta2) * g) * g
    mhat = m / (1 - beta1 ** t)
    vhat = v / (1 - beta2 ** t)
    p    = p * (1 - lr * weight_decay) - (lr * mhat) / (sqrt(vhat) + eps)
    out  = p cast to out's dtype (round to nearest even)

``p`` (the master copy), ``m`` (exp_avg) and ``v`` (exp_avg_sq) are float32 or float64 and are
updated in place; every operation is done in their dtype, one rounding each, in the order written
(the scalars ``1 - beta1``, ``1 - beta1 ** t``, ... are computed in float64, then rounded once to the master dtype);
``grad`` is converted first, so a float16/bfloat16 gradient is never multiplied in half precision.
The CUDA kernel (``ringcomm.devices.cuda.fused_adam``, csrc/optimizer.cu) evaluates the same
expressions in the same order, each operation rounded once (PTX that no compiler flag flushes to zero or
fuses into an FMA), so the two agree bitwise, subnormals included (tests/test_zero.py,
tests/test_csrc_host.py, which models CuPy's -ftz=true and NVRTC's -fmad=true).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..arrays import classify

MASTER_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

#: Elements per pass of the host loop: the scratch stays in L2 cache and no full-size temporary exists.
HOST_CHUNK = 1 << 14


def _check(master: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, out: Any, hyper: dict[str, float]) -> None:
    if master.dtype not in MASTER_DTYPES:
        raise TypeError(f"master: dtype {master.dtype}; the master copy must be float32 or float64")
    for name, a in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if a.dtype != master.dtype:
            raise TypeError(f"{name}: dtype {a.dtype} differs from master's {master.dtype}")
    for name, a in (("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("out", out)):
        if a is None:
            continue
        if a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected a 1-D contiguous array; got shape {a.shape}")
        if a.size != master.size:
            raise ValueError(f"{name}: has {a.size} elements, master has {master.size}")
        if a.dtype.kind not in "fV" and str(a.dtype) != "bfloat16":
            raise TypeError(f"{name}: dtype {a.dtype} is not a floating-point type")
    step = hyper["step"]
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (Adam's step count, 1-based); got {step!r}")
    b1, b2 = hyper["beta1"], hyper["beta2"]
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must be in [0, 1); got ({b1}, {b2})")
    if not hyper["eps"] > 0 or not hyper["lr"] >= 0 or not hyper["weight_decay"] >= 0:
        raise ValueError(f"need lr >= 0, eps > 0, weight_decay >= 0; got {hyper}")
    if not math.isfinite(hyper["grad_scale"]):
        raise ValueError(f"grad_scale must be finite; got {hyper['grad_scale']}")


def adam_update(
    master: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    out: np.ndarray | None = None,
) -> None:
    """One AdamW step on numpy arrays (the formula in the module docstring), in place.

    ``master``, ``exp_avg``, ``exp_avg_sq``: 1-D float32/float64 arrays of one dtype, updated in
    place. ``grad``: same size, any float dtype (float16, bfloat16, float32, float64), read only.
    ``out``: optional array of the same size that receives the updated master cast to its dtype
    (the working-precision parameters). ``step`` is t, 1-based. Processes ``HOST_CHUNK`` elements
    at a time with two small scratch arrays; no full-size temporary is allocated.
    """
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, grad_scale=grad_scale)
    _check(master, grad, exp_avg, exp_avg_sq, out, hyper)
    dt = master.dtype
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    decay = 1.0 - lr * weight_decay
    n = master.size
    g = np.empty(min(n, HOST_CHUNK), dt)
    u = np.empty_like(g)
    for a in range(0, n, HOST_CHUNK):
        # The kernel's order of operations (csrc/optimizer.cu), one rounding per operation, so that
        # this loop and the kernel agree bitwise.
        b = min(n, a + HOST_CHUNK)
        k = b - a
        p, m, v, gc, uc = master[a:b], exp_avg[a:b], exp_avg_sq[a:b], g[:k], u[:k]
        gc[...] = grad[a:b]  # convert first: never compute in half precision
        if grad_scale != 1.0:
            gc *= grad_scale  # g = grad * grad_scale
        m *= beta1
        np.multiply(gc, 1.0 - beta1, out=uc)
        m += uc  # m = beta1*m + (1-beta1)*g
        np.multiply(gc, 1.0 - beta2, out=uc)
        uc *= gc
        v *= beta2
        v += uc  # v = beta2*v + ((1-beta2)*g)*g
        np.divide(m, bc1, out=gc)  # mhat
        gc *= lr  # lr*mhat
        np.divide(v, bc2, out=uc)  # vhat
        np.sqrt(uc, out=uc)
        uc += eps
        gc /= uc  # lr*mhat / (sqrt(vhat) + eps)
        if weight_decay != 0.0:
            p *= decay  # p = p*(1 - lr*wd)
        p -= gc
        if out is not None:
            out[a:b] = p


def apply_adam(
    master: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    out: Any = None,
    stream: Any = None,
) -> None:
    """AdamW on a shard, numpy or CuPy: numpy runs :func:`adam_update`, CuPy arrays run the fused
    kernel ``ringcomm.devices.cuda.fused_adam`` (one pass over the shard, on ``stream``)."""
    kind, _ = classify(master, "master")
    if kind == "host":
        adam_update(
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            step=step,
            grad_scale=grad_scale,
            out=out,
        )
        return
    from ..devices.cuda import fused_adam

    fused_adam(
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        grad_scale=grad_scale,
        out=out,
        stream=stream,
    )
