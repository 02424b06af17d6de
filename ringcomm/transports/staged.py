"""Staged transport for GPU arrays: device -> pinned host -> MPI -> pinned host -> device.

For GPU ranks that cannot read each other's memory (other nodes without a CUDA-aware MPI, or a
failed CUDA IPC set-up). :class:`StagedSend` is the sending half of an edge, :class:`StagedRecv` the
receiving one. Each chunk is cut into slices; for every slice the device-to-host copy
runs on a side stream, the MPI transfer on the host, and the host-to-device copy plus the
reduction on the collective's stream, so the three overlap across slices.

Ordering (DESIGN.md, the step handshake): MPI's non-overtaking rule orders the slices and the
steps between two neighbours, as in the MPI transport. A slice is sent only after its device-to-host
copy completed (an event), and that copy starts only after the work that produced the chunk (an
event recorded on the collective's stream). Before a step ends its sends are complete (the pinned
send buffer is reused) and its host-to-device copies are complete (the pinned receive buffer is
reused). Every wait has the communicator's timeout.

Also here: :func:`cuda_aware_mpi`, the probe that says whether MPI accepts device buffers.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import tags
from ..config import env, flag
from ..devices import Reused
from .base import cancel, slices, wait, wait_until

#: Slices of a staged chunk are at least this large (fewer, larger host copies and messages).
MIN_SLICE_BYTES = 4 << 20


def wait_event(event: Any, ctx: Any, step: int | None, peer: int, what: str, *args: Any) -> None:
    """Block until the CUDA ``event`` has completed (polling cudaEventQuery), within the timeout."""
    wait_until(lambda: event.done, ctx, step, peer, what, *args)


class EventPool:
    """Reusable CUDA events (timing disabled), handed out in order; ``reset()`` recycles them all
    once every event taken since the last reset has completed."""

    def __init__(self) -> None:
        self._events: list = []
        self._used = 0

    def take(self) -> Any:
        if self._used == len(self._events):
            import cupy

            self._events.append(cupy.cuda.Event(block=False, disable_timing=True))
        self._used += 1
        return self._events[self._used - 1]

    def reset(self) -> None:
        self._used = 0


@functools.lru_cache(maxsize=1)
def _query_library() -> bool:
    try:
        from mpi4py import MPI

        query = getattr(MPI, "Query_cuda_support", None)  # mpi4py >= 4.2 may wrap it
        if query is not None:
            return bool(query())
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support  # resolved in libmpi, mpi4py's dependency
        fn.restype, fn.argtypes = ctypes.c_int, []
        return bool(fn())
    except Exception:  # noqa: BLE001 - no such extension: not CUDA-aware
        return False


def cuda_aware_mpi() -> bool:
    """Whether the MPI library accepts device buffers (``MPIX_Query_cuda_support``).

    ``RINGCOMM_CUDA_AWARE_MPI=1`` (or ``0``) overrides the probe. The probe asks the MPI library
    mpi4py is linked to (Open MPI and MPICH 4+ provide the query; MPICH answers true only when its
    GPU support is enabled at run time); a library without the query counts as not CUDA-aware.
    """
    override = env("RINGCOMM_CUDA_AWARE_MPI", flag, None)
    return _query_library() if override is None else override


class _Staged:
    """What both halves share: pinned host buffers (grown when needed) and reusable events."""

    name = "staged"

    def __init__(self, comm: Any, slice_bytes: int | None = None) -> None:
        self.comm = comm
        self.slice_bytes = max(int(slice_bytes or comm.slice_bytes), MIN_SLICE_BYTES)
        self._host = None  # pinned numpy uint8 array, grown when needed
        self._pinned = None  # the pinned allocation behind it (kept alive)
        self._events = EventPool()

    def _start(self, ctx: Any, work: Any, bounds: Any) -> bool:
        """Bind the call; make the pinned buffer as large as the widest chunk. False when N == 1."""
        import cupy

        self._cupy, self._rt = cupy, cupy.cuda.runtime
        self.ctx, self.device = ctx, ctx.device
        self.stream = self.device.stream
        self._tag = ctx.identity() | tags.DATA
        ctx.expect += (self._tag,)
        self._events.reset()
        if self.comm.size == 1:  # no steps: nothing to stage
            return False
        widest = max(work.itemsize, ctx.acc.itemsize if ctx.acc is not None else 0)  # float32 partials
        self._need = need = max((hi - lo for lo, hi in bounds), default=0) * widest
        if self._host is None or self._host.size < need:
            self._pinned = cupy.cuda.alloc_pinned_memory(max(need, 1))
            self._host = np.frombuffer(self._pinned, np.uint8, max(need, 1))
        return True

    def close(self) -> None:
        """Drop the pinned buffer (the communicator is being freed)."""
        self._host = self._pinned = None


class StagedSend(_Staged):
    """The sending half: device-to-host copies on a side stream, then MPI_Isend to the right."""

    def __init__(self, comm: Any, slice_bytes: int | None = None) -> None:
        super().__init__(comm, slice_bytes)
        self._copy_stream = None  # device-to-host copies
        self._it = 1  # bytes per element of the chunk being sent (float32 partial sums, or the dtype's)
        self._pending: list = []  # (lo, hi, event): device-to-host copies not yet sent
        self._sends: list = []

    def begin(self, ctx: Any, work: Any, src: Any, bounds: Any) -> None:
        self._pending, self._sends = [], []
        if self._start(ctx, work, bounds) and self._copy_stream is None:
            self._copy_stream = self._cupy.cuda.Stream(non_blocking=True)

    def post(self, step: Any, send: Any, writes: bool) -> None:
        if send is None or not send.size:
            return
        from ..devices.cuda import pointer

        ready = self._events.take()
        ready.record(self.stream)  # the chunk's producers, queued before this step
        self._copy_stream.wait_event(ready)
        base, host = pointer(send), self._host.ctypes.data
        d2h = getattr(self._rt, "memcpyDeviceToHost", 2)
        self._it = it = send.itemsize
        for lo, hi in slices(send.size, max(1, self.slice_bytes // it)):
            self._rt.memcpyAsync(host + lo * it, base + lo * it, (hi - lo) * it, d2h, self._copy_stream.ptr)
            ev = self._events.take()
            ev.record(self._copy_stream)
            self._pending.append((lo, hi, ev))

    def pump(self, step: Any, piece: int, block: bool = True) -> None:
        """Post the Isend of every slice whose device-to-host copy is done, and (``block``) of the
        first ``piece + 1`` slices at least, waiting for their copies. A receiving half calls this
        before it waits for incoming slice ``piece``: every rank posts slices 0..i before it waits
        for slice i, so no rank waits on a neighbour that waits on it."""
        mpi, it = self.comm.mpi, self._it
        while self._pending:
            lo, hi, ev = self._pending[0]
            if not ev.done:
                if not (block and len(self._sends) <= piece):
                    return
                wait_event(ev, self.ctx, step.index, self.comm.right, "copying chunk %s to the host", step.send)
            self._pending.pop(0)
            self._sends.append(mpi.Isend(self._host[lo * it : hi * it], self.comm.right, self._tag))

    def step_done(self, step: Any) -> None:
        if self._pending:
            self.pump(step, len(self._pending) + len(self._sends))
        if self._sends:  # the pinned buffer is reused by the next step
            wait(self._sends, self.ctx, step.index, self.comm.right, "sending chunk %s", step.send)
        self._pending, self._sends = [], []
        self._events.reset()

    def end(self) -> None:
        self._events.reset()

    def abort(self) -> None:
        cancel((), self._sends)
        self._pending, self._sends = [], []
        if self._copy_stream is not None:  # local work only: the pinned buffer is free after it
            done = self._events.take()
            done.record(self._copy_stream)
            try:
                wait_event(done, self.ctx, None, self.comm.rank, "this rank's copies to the host, after an error")
            except Exception:  # noqa: BLE001 - best effort while the first error propagates
                pass
        self._events.reset()


class StagedRecv(_Staged):
    """The receiving half: MPI_Irecv from the left into pinned memory, then host-to-device copies
    on the collective's stream (into the destination, or a device scratch for reduce steps)."""

    private = False  # (see MpiRecv.private)

    def __init__(self, comm: Any, slice_bytes: int | None = None) -> None:
        super().__init__(comm, slice_bytes)
        self._dev = Reused()  # device scratch for reduce steps, reused across calls (and streams)
        self._dev_recv = None  # this call's view of it
        self._recvs: list = []  # (lo, hi, host view, request)
        self._h2d = None  # event after the step's last host-to-device copy

    def begin(self, ctx: Any, work: Any, src: Any, bounds: Any) -> None:
        self._recvs, self._h2d = [], None
        self._active = self._start(ctx, work, bounds)
        if self._active:
            self._dev_recv = self._dev.take(self.device, self._need)

    def post(self, step: Any, recv_count: int, recv_into: Any, recv_dtype: Any) -> None:
        self._recv_into, self._recv_dtype, it = recv_into, recv_dtype, recv_dtype.itemsize
        mpi, left = self.comm.mpi, self.comm.left
        for lo, hi in slices(recv_count, max(1, self.slice_bytes // it)):
            view = self._host[lo * it : hi * it]
            self._recvs.append((lo, hi, view, mpi.Irecv(view, left, self._tag)))

    def recv(self, step: Any, sender: Any) -> Iterator[tuple[int, int, Any]]:
        from ..devices.cuda import pointer

        it = self._recv_dtype.itemsize
        h2d = getattr(self._rt, "memcpyHostToDevice", 1)
        target = self._recv_into
        dst = pointer(target) if target is not None else self._dev_recv.data.ptr
        for i, (lo, hi, view, req) in enumerate(self._recvs):
            sender.pump(step, i)
            wait([req], self.ctx, step.index, self.comm.left, "receiving chunk %s", step.recv, sizes=(view.nbytes,))
            self._rt.memcpyAsync(dst + lo * it, view.ctypes.data, (hi - lo) * it, h2d, self.stream.ptr)
            if target is None:
                yield lo, hi, self._dev_recv[lo * it : hi * it].view(self._recv_dtype)
            else:
                yield lo, hi, None
        if self._recvs:
            self._h2d = self._events.take()
            self._h2d.record(self.stream)

    def step_done(self, step: Any) -> None:
        if self._h2d is not None:  # the pinned buffer is reused by the next step
            wait_event(self._h2d, self.ctx, step.index, self.comm.left, "copying chunk %s to the device", step.recv)
        self._recvs, self._h2d = [], None
        self._events.reset()

    def end(self) -> None:
        if self._active:
            self._dev.done(self.device)
        self._recvs, self._h2d = [], None

    def abort(self) -> None:
        cancel([req for *_, req in self._recvs])
        self._recvs, self._h2d = [], None
        self._events.reset()

    def close(self) -> None:
        """Drop the pinned and device buffers (the communicator is being freed)."""
        super().close()
        self._dev_recv = None
        self._dev.free()
