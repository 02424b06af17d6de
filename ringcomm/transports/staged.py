"""Staged transport for GPU arrays: device -> pinned host -> MPI -> pinned host -> device.

For GPU ranks that cannot read each other's memory (other nodes without a CUDA-aware MPI, or a
failed CUDA IPC set-up). Each chunk is cut into slices; for every slice the device-to-host copy
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

from ..config import env, flag
from ..devices import Reused
from .base import cancel, slices, wait, wait_until
from .. import tags

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


class StagedTransport:
    """GPU chunks through pinned host buffers and MPI point-to-point between ring neighbours."""

    name = "staged"

    def __init__(self, comm: Any, slice_bytes: int | None = None) -> None:
        self.comm = comm
        self.slice_bytes = max(int(slice_bytes or comm.slice_bytes), MIN_SLICE_BYTES)
        self._host_send = self._host_recv = None  # pinned numpy uint8 arrays, grown when needed
        self._pinned: list = []  # the pinned allocations behind them (kept alive)
        self._dev = Reused()  # device scratch for reduce steps, reused across calls (and streams)
        self._dev_recv = None  # this call's view of it
        self._copy_stream = None  # device-to-host copies
        self._send_it = 1  # bytes per element of the chunk being sent (float32 partial sums, or the dtype's)
        self._events = EventPool()
        self._reset()

    # ------------------------------------------------------------------ helpers
    def _reset(self) -> None:
        self._recvs: list = []  # (lo, hi, host view, request)
        self._pending: list = []  # (lo, hi, event): device-to-host copies not yet sent
        self._sends: list = []
        self._h2d = None  # event after the step's last host-to-device copy
        self._events.reset()

    def _pinned_array(self, nbytes: int) -> np.ndarray:
        mem = self._cupy.cuda.alloc_pinned_memory(nbytes)
        self._pinned.append(mem)
        return np.frombuffer(mem, np.uint8, nbytes)

    # ------------------------------------------------------------------ protocol
    def begin(self, ctx: Any, work: Any, src: Any, bounds: list[tuple[int, int]]) -> None:
        import cupy

        self._cupy = cupy
        self.ctx, self.device = ctx, ctx.device
        self.stream = self.device.stream
        self._rt = cupy.cuda.runtime
        self._tag = ctx.identity() | tags.DATA
        ctx.expect = (self._tag,)
        self._reset()
        if self.comm.size == 1:  # no steps: nothing to stage
            return
        widest = max(work.itemsize, ctx.acc.itemsize if ctx.acc is not None else 0)  # float32 partials
        need = max((hi - lo for lo, hi in bounds), default=0) * widest
        if self._host_send is None or self._host_send.size < need:
            self._pinned.clear()
            self._host_send = self._pinned_array(max(need, 1))
            self._host_recv = self._pinned_array(max(need, 1))
        self._dev_recv = self._dev.take(self.device, need)
        if self._copy_stream is None:
            self._copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._reset()

    def post(self, step: Any, send: Any, recv_count: int, recv_into: Any, recv_dtype: Any) -> None:
        mpi, comm = self.comm.mpi, self.comm
        self._reset()
        self._recv_into, self._recv_dtype, it = recv_into, recv_dtype, recv_dtype.itemsize
        if recv_count:
            for lo, hi in slices(recv_count, max(1, self.slice_bytes // it)):
                view = self._host_recv[lo * it: hi * it]
                self._recvs.append((lo, hi, view, mpi.Irecv(view, comm.left, self._tag)))
        if send is not None and send.size:
            from ..devices.cuda import pointer

            ready = self._events.take()
            ready.record(self.stream)  # the chunk's producers, queued before this step
            self._copy_stream.wait_event(ready)
            base, host = pointer(send), self._host_send.ctypes.data
            d2h = getattr(self._rt, "memcpyDeviceToHost", 2)
            self._send_it = it = send.itemsize
            for lo, hi in slices(send.size, max(1, self.slice_bytes // it)):
                self._rt.memcpyAsync(host + lo * it, base + lo * it, (hi - lo) * it, d2h, self._copy_stream.ptr)
                ev = self._events.take()
                ev.record(self._copy_stream)
                self._pending.append((lo, hi, ev))

    def _send_ready(self, step: Any, upto: int, block: bool) -> None:
        """Post the Isend of every slice whose device-to-host copy is done; with ``block``, of the
        first ``upto`` slices at least (waiting for their copies)."""
        mpi, it = self.comm.mpi, self._send_it
        while self._pending:
            lo, hi, ev = self._pending[0]
            if not ev.done:
                if not (block and len(self._sends) < upto):
                    return
                wait_event(ev, self.ctx, step.index, self.comm.right, "copying chunk %s to the host", step.send)
            self._pending.pop(0)
            self._sends.append(mpi.Isend(self._host_send[lo * it: hi * it], self.comm.right, self._tag))

    def recv(self, step: Any) -> Iterator[tuple[int, int, Any]]:
        it = self._recv_dtype.itemsize
        h2d = getattr(self._rt, "memcpyHostToDevice", 1)
        from ..devices.cuda import pointer

        target = self._recv_into
        dst = pointer(target) if target is not None else self._dev_recv.data.ptr
        for i, (lo, hi, view, req) in enumerate(self._recvs):
            # Slices 0..i of this rank's send are posted before it waits for incoming slice i, and
            # every rank does the same, so no rank waits on a neighbour that waits on it.
            self._send_ready(step, i + 1, block=True)
            wait([req], self.ctx, step.index, self.comm.left, "receiving chunk %s", step.recv, sizes=(view.nbytes,))
            self._rt.memcpyAsync(dst + lo * it, view.ctypes.data, (hi - lo) * it, h2d, self.stream.ptr)
            if target is None:
                yield lo, hi, self._dev_recv[lo * it: hi * it].view(self._recv_dtype)
            else:
                yield lo, hi, None
        if self._recvs:
            self._h2d = self._events.take()
            self._h2d.record(self.stream)

    def step_done(self, step: Any) -> None:
        self._send_ready(step, len(self._pending) + len(self._sends), block=True)
        wait(self._sends, self.ctx, step.index, self.comm.right, "sending chunk %s", step.send)
        if self._h2d is not None:  # the pinned receive buffer is reused by the next step
            wait_event(self._h2d, self.ctx, step.index, self.comm.left, "copying chunk %s to the device", step.recv)
        self._reset()

    def end(self) -> None:
        if self.comm.size > 1:
            self._dev.done(self.device)
        self._reset()

    def close(self) -> None:
        """Drop the pinned and device buffers (the communicator is being freed)."""
        self._reset()
        self._host_send = self._host_recv = self._dev_recv = None
        self._pinned.clear()
        self._dev.free()

    def abort(self) -> None:
        cancel([req for *_, req in self._recvs], self._sends)
        if self._copy_stream is not None:  # local work only: the pinned buffers are free after it
            done = self._events.take()
            done.record(self._copy_stream)
            try:
                wait_event(done, self.ctx, None, self.comm.rank, "this rank's copies to the host, after an error")
            except Exception:  # noqa: BLE001 - best effort while the first error propagates
                pass
        self._reset()
