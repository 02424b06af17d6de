"""The host device: reductions and copies with numpy ufuncs into preallocated views."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import HALF_DTYPES, UFUNCS, ReduceOp


class HostDevice:
    """Reduce and copy numpy arrays in the calling thread (synchronous)."""

    name = "host"
    xp = np
    stream = None

    def __init__(self) -> None:
        self._f32 = np.empty(0, np.float32)  # accumulation scratch for half types, grown once

    def reduce(self, dst: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp, div: int = 1) -> None:
        """``dst[:] = op(a, b)``, divided by ``div`` when div != 1; ``dst`` may be ``a``.

        Half types are combined in float32 and rounded once (so the AVG division is fused).
        """
        ufunc = UFUNCS[op]
        if div != 1 and dst.dtype in HALF_DTYPES:
            tmp = self._scratch(dst.size)
            ufunc(a, b, out=tmp, dtype=np.float32)
            np.divide(tmp, div, out=tmp)
            dst[...] = tmp
            return
        ufunc(a, b, out=dst)
        if div != 1:
            np.divide(dst, div, out=dst)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst[:] = src``."""
        np.copyto(dst, src)

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
