"""Devices reduce and copy bytes: ``host`` (numpy) and ``cuda`` (ringcomm's kernels from csrc/).

Both implement the same small protocol, used by the engine and the transports:
``reduce(dst, a, b, op, div=1)``, ``copy(dst, src)``, ``empty(count, dtype)``,
``synchronize(ctx, step, peer, what)`` (a wait with the communicator's deadline); for float32
accumulation of half types ``widen(dst, a)``, ``reduce_acc(dst, a, b, op)`` (float32 partial sums)
and ``reduce_acc_final(dst, a, b, op, div=1)`` (rounded once); and for :class:`Reused` buffers
``after(last)``, ``record(last)``, ``retire(buf, last)``. CudaDevice also has ``pinned(nbytes)``
(pinned host memory, for a ``Reused(pinned=True)`` buffer), ``to_host`` and ``from_host`` (copies
through it, for small GPU collectives that go through the host: collectives._through_host).
"""

from __future__ import annotations

from typing import Any

from .host import HostDevice


class Reused:
    """A buffer that a Communicator or a transport keeps and reuses across calls (scratch space).

    GPU calls may come on different streams (``stream=``), and a call returns while its kernels
    may still run: the next call must not write the buffer before they are done. :meth:`take`
    makes the calling device's stream wait for the event of the buffer's last use (recorded by
    :meth:`done` at the end of each call), so the ordering stays on the GPU; a buffer that is
    outgrown (or :meth:`free`'d) is dropped only once its last use has completed, since CuPy's
    stream-aware pool hands freed memory to the next allocation on the stream it was made on.
    On the host all of this costs nothing: host operations are complete when they return.
    """

    __slots__ = ("buf", "_last", "_device", "_pinned", "_view")

    def __init__(self, pinned: bool = False) -> None:
        self.buf = None
        self._last = None
        self._device = None
        self._pinned = pinned  # pinned host memory (a numpy array) that the stream copies into and out of
        self._view: tuple = (None, None)  # the last view taken: ((bytes, dtype), the array)

    def take(self, device: Any, nbytes: int, dtype: Any = "u1") -> Any:
        """An array of ``dtype`` over the buffer's first ``nbytes`` (grown if needed), safe to use on
        ``device``'s stream (the last such view again when its bytes and dtype are the same: a
        GPU array's view costs microseconds of the host's time)."""
        if self.buf is None or self.buf.size < nbytes:
            self.free()
            size = max(nbytes, 1)  # new memory, on this call's stream (or pinned host memory)
            self.buf = device.pinned(size) if self._pinned else device.empty(size, "u1")
        else:
            device.after(self._last)
        self._device = device
        shape, view = self._view
        if shape != (nbytes, dtype):
            view = self.buf[:nbytes].view(dtype)
            self._view = (nbytes, dtype), view
        return view

    def after(self, device: Any) -> None:
        """Order ``device``'s stream after the buffer's last use (:meth:`take` without resizing)."""
        device.after(self._last)

    def done(self, device: Any) -> None:
        """Record the end of this call's use (after the last operation queued on it)."""
        self._last = device.record(self._last)

    def free(self) -> None:
        """Drop the buffer (kept alive until its last use has completed)."""
        if self.buf is not None:
            self._device.retire(self.buf, self._last)
        self.buf = self._last = None
        self._view = (None, None)


def get(kind: str, stream: Any = None):
    """A device for arrays of ``kind`` ("host" or "cuda"; ``stream`` applies to cuda only).

    The Communicator keeps one HostDevice for host arrays; a CudaDevice is made per call for its stream.
    """
    if kind == "host":
        return HostDevice()
    if kind == "cuda":
        from .cuda import CudaDevice

        return CudaDevice(stream)
    raise ValueError(f"unknown device kind {kind!r}; accepted: host, cuda")


__all__ = ["HostDevice", "Reused", "get"]
