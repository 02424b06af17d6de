"""The host device: reductions and copies with numpy ufuncs into preallocated views."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from ..ops import HALF_DTYPES, UFUNCS, ReduceOp

_F32 = np.dtype(np.float32)
#: the NaN the float32-accumulation methods write (float32 0x7fc00000; cast, float16 0x7e00, bfloat16 0x7fc0)
CANONICAL_NAN = np.uint32(0x7FC00000).view(np.float32)
_MIN_MAX = (ReduceOp.MIN, ReduceOp.MAX)
#: HostDevice.reduce(spare=True) goes through the scratch for pieces up to this size (measured on
#: this 2-core host: faster at 256 KiB and 1 MiB all-reduces, slower at 4 MiB)
SPARE_BYTES = 512 << 10


class HostDevice:
    """Reduce and copy numpy arrays in the calling thread (synchronous)."""

    name = "host"
    xp = np
    stream = None

    def __init__(self) -> None:
        self._f32 = np.empty(0, np.float32)  # accumulation scratch for half types, grown once
        self._mask = np.empty(0, np.bool_)  # two masks for the float32-accumulation methods, grown once

    def reduce(
        self, dst: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp, div: int = 1, spare: bool = False
    ) -> None:
        """``dst[:] = op(a, b)``, divided by ``div`` when div != 1; ``dst`` may be ``a``.

        Half types are combined in float32 and rounded once (so the AVG division is fused).
        ``spare``: ``dst`` is ``a`` (in place) and ``b`` is a receive scratch that may be
        overwritten. Up to SPARE_BYTES the result is then made in ``b`` and copied into ``dst``
        (the same bits): the chunk in place was just read by the neighbour through MPICH's
        single-copy path (CMA), so its cache lines sit shared in the other core's cache, and a
        ufunc that reads and writes them pays for every line (measured: 46 us for 128 KiB, against
        4 us for the ufunc into the scratch and a copy). Beyond that the lines have left the other
        cache and the extra copy costs more than it saves.
        """
        ufunc = UFUNCS[op]
        if spare and dst.nbytes <= SPARE_BYTES and not (div != 1 and dst.dtype in HALF_DTYPES):
            ufunc(a, b, out=b)
            if div != 1:
                np.divide(b, div, out=b)
            dst[...] = b
            return
        if div != 1 and dst.dtype in HALF_DTYPES:
            tmp = self._scratch(dst.size)
            ufunc(a, b, out=tmp, dtype=np.float32)
            np.divide(tmp, div, out=tmp)
            dst[...] = tmp
            return
        ufunc(a, b, out=dst)
        if div != 1:
            np.divide(dst, div, out=dst)

    def fold(self, work: np.ndarray, pieces: Any, op: ReduceOp, div: int = 1) -> None:
        """For each ``(lo, hi, views)`` of ``pieces``: ``work[lo:hi]`` = the views reduced in their
        order, as :meth:`reduce` would step by step (the next view first, the partial result second;
        the last step divided by ``div``), with one ufunc call per view (a small all-reduce's fold,
        engine.Fold)."""
        if div != 1 and work.dtype in HALF_DTYPES:  # the division fused in float32: reduce() steps
            for lo, hi, views in pieces:
                dst, part = work[lo:hi], views[0]
                for k in range(1, len(views)):
                    self.reduce(dst, views[k], part, op, div if k == len(views) - 1 else 1)
                    part = dst
            return
        ufunc = UFUNCS[op]
        for lo, hi, views in pieces:
            dst = work if lo is None else work[lo:hi]  # (None: the whole buffer, engine.Fold)
            ufunc(views[1], views[0], out=dst)
            if len(views) > 2:
                for view in views[2:]:
                    ufunc(view, dst, out=dst)
            if div != 1:
                np.divide(dst, div, dst)

    def folder(self, pieces: Any, op: ReduceOp, div: int = 1) -> Any:
        """``fold(out=work)``: :meth:`fold` of ``pieces`` with ``op`` and ``div``, bound once (a
        small all-reduce's fast lane, engine.SharedGatherFold.bound); one chunk of two views,
        undivided, is that one ufunc call itself (measured: 0.1 us less than the method)."""
        if div == 1 and len(pieces) == 1 and pieces[0][0] is None and len(pieces[0][2]) == 2:
            views = pieces[0][2]
            return partial(UFUNCS[op], views[1], views[0])

        def fold(out: np.ndarray) -> None:
            self.fold(out, pieces, op, div)

        return fold

    # ---- float32 accumulation (accumulate="float32"): half-type data, float32 partial sums
    # The same bits as the kernels of csrc/accumulate.cu: every NaN result is the positive quiet NaN
    # (float32 0x7fc00000, float16 0x7e00, bfloat16 0x7fc0), whatever NaNs made it; MIN / MAX give NaN
    # when either operand is NaN, and between +0 and -0 the first operand's (numpy's SIMD loops may
    # return either); float32 -> half rounds to nearest even (numpy's float16 cast, ml_dtypes' bfloat16).

    def reduce_acc(self, dst: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp) -> None:
        """``dst[:] = op(float32(a), b)`` in float32, not rounded to a's type; ``dst`` may be ``b``.

        ``a``: float16 or bfloat16 (the local data); ``b`` and ``dst``: float32 (partial sums). 1-D
        contiguous arrays of one length. AVG is SUM here (the division comes in :meth:`reduce_acc_final`).
        """
        n = check_acc_operands("reduce_acc", dst, a, b, _F32)
        if n == 0:
            return
        UFUNCS[op](a, b, out=dst, dtype=np.float32)
        self._signed_zeros(dst, a, op)
        self._canonical_nans(dst)

    def reduce_acc_final(self, dst: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp, div: int = 1) -> None:
        """``dst[:] = op(float32(a), b) / div`` rounded once to a's type; ``dst`` may be ``a``.

        ``a`` and ``dst``: float16 or bfloat16 (one dtype); ``b``: float32 (the partial sums). The op and
        the division (float32, correctly rounded; only when div != 1) are float32; one rounding to
        nearest even at the end. 1-D contiguous arrays of one length.
        """
        n = check_acc_operands("reduce_acc_final", dst, a, b, a.dtype)
        if n == 0:
            return
        tmp = self._scratch(n)
        UFUNCS[op](a, b, out=tmp, dtype=np.float32)
        self._signed_zeros(tmp, a, op)  # before the division, which may round a tiny result to zero
        if div != 1:
            np.divide(tmp, np.float32(div), out=tmp)
        self._canonical_nans(tmp)
        dst[...] = tmp

    def widen(self, dst: np.ndarray, a: np.ndarray) -> None:
        """``dst[:] = float32(a)`` (exact; NaN as the positive quiet NaN) for float16 / bfloat16 ``a``."""
        n = check_acc_operands("widen", dst, a, None, _F32)
        if n == 0:
            return
        np.copyto(dst, a, casting="same_kind")
        self._canonical_nans(dst)

    def _signed_zeros(self, r: np.ndarray, a: np.ndarray, op: ReduceOp) -> None:
        """After ``r = op(float32(a), b)`` for MIN or MAX: where r is a zero and so is a, a was a minimum
        (maximum) too, and the kernels return it; numpy may have returned b's zero of the other sign."""
        if op not in _MIN_MAX:
            return
        n = r.size
        zero, a_zero = self._masks(n)
        np.equal(r, 0, out=zero)
        if zero.any():
            np.equal(a, 0, out=a_zero)
            np.logical_and(zero, a_zero, out=zero)
            np.copyto(r, a, where=zero, casting="same_kind")

    def _canonical_nans(self, r: np.ndarray) -> None:
        """Every NaN of float32 ``r`` made the positive quiet NaN: one read of r when it has none."""
        if np.isnan(np.max(r)):  # max propagates NaN: r has no NaN when its max is not NaN
            nan = self._masks(r.size)[0]
            np.isnan(r, out=nan)
            np.copyto(r, CANONICAL_NAN, where=nan)

    def _masks(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        if self._mask.size < 2 * count:
            self._mask = np.empty(2 * count, np.bool_)
        return self._mask[:count], self._mask[count : 2 * count]

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst[:] = src``."""
        dst[...] = src

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A new scratch array (callers keep and reuse it: it is made on first use, or to grow)."""
        return np.empty(count, dtype)

    def synchronize(self, ctx: Any, step: int | None, peer: int, what: str, *args: Any) -> None:
        """Nothing to wait for: every host operation is complete when it returns."""

    # reused buffers (ringcomm.devices.Reused): host operations are complete when they return
    def after(self, last: None) -> None:
        """Nothing to order."""

    def record(self, last: None) -> None:
        """Nothing to record."""

    @staticmethod
    def retire(buf: np.ndarray, last: None) -> None:
        """Nothing to wait for before ``buf`` goes."""

    def _scratch(self, count: int) -> np.ndarray:
        if self._f32.size < count:
            self._f32 = np.empty(count, np.float32)
        return self._f32[:count]


def check_acc_operands(what: str, dst: Any, a: Any, b: Any, dst_dtype: Any) -> int:
    """The length of the float32-accumulation operands (numpy or GPU arrays; HostDevice and CudaDevice),
    after checking their lengths (ValueError) and dtypes (TypeError): ``a`` float16 or bfloat16, ``b``
    float32, ``dst`` ``dst_dtype``."""
    n = dst.size
    if a.size != n or (b is not None and b.size != n):
        sizes = f"dst {n}, a {a.size}" + (f", b {b.size}" if b is not None else "")
        raise ValueError(f"{what}: lengths differ ({sizes})")
    if a.dtype not in HALF_DTYPES:
        raise TypeError(f"{what}: a has dtype {a.dtype}; accepted: float16, bfloat16")
    if b is not None and b.dtype != _F32:
        raise TypeError(f"{what}: b has dtype {b.dtype}; it must be float32 (the partial sums)")
    if dst.dtype != dst_dtype:
        raise TypeError(f"{what}: dst has dtype {dst.dtype}; it must be {np.dtype(dst_dtype)}")
    return n
