"""MPI transport: chunks travel between ring neighbours by nonblocking MPI point-to-point.

Each chunk is cut into slices of ``slice_bytes`` so that a large chunk is not one message and the
reduction of a slice follows its arrival while it is still in cache. A reduce step receives into a
scratch buffer (allocated once per communicator, grown when a larger chunk comes); a copy step
receives straight into its destination. Buffers may be host arrays or, when the MPI library is
CUDA-aware, device arrays: the host waits (with the deadline) for the stream before a chunk it
produced is sent and before the scratch is reused, so the scratch's last use is complete when a
step ends.

Latency: for a copy step between buffers that stay put (an :class:`ringcomm.engine.Plan`),
:meth:`MpiTransport.prepare` makes persistent requests once (MPI_Send_init/Recv_init); each run
restarts them, which saves the per-message set-up of MPI_Isend/Irecv.

Ordering: MPI's non-overtaking rule orders the slices and the steps between two neighbours (one
tag per call, receives posted in the order the sends are made), and a send is complete before the
step ends, so the read-after-write and write-after-read hazards of DESIGN.md are both met by MPI.

Identity: every message carries its call's tag (ringcomm.tags: collective, dtype, op, root, call
number; a plan's persistent requests the call number modulo 4, see engine.Plan), and every
receive checks the size it got against the schedule's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mpi4py import MPI

from .. import tags
from .base import as_bytes, cancel, slices, wait


class MpiTransport:
    """Point-to-point MPI between ring neighbours (host memory, or device memory if CUDA-aware)."""

    def __init__(self, comm: Any, slice_bytes: int, name: str = "mpi") -> None:
        self.comm, self.slice_bytes, self.name = comm, slice_bytes, name
        self._scratch = None  # raw uint8 scratch for reduce steps, reused across calls
        self._sends: list = []
        self._recvs: list = []

    def begin(self, ctx: Any, work: Any, src: Any, bounds: list[tuple[int, int]]) -> None:
        self.ctx, self.device = ctx, ctx.device
        self._on_host = self.device.name == "host"
        self._tag = ctx.identity() | tags.DATA
        ctx.expect = (self._tag,)
        if not self._on_host:  # MPI's writes into device memory are not ordered with the stream's work
            self.device.synchronize(ctx, None, self.comm.rank, "this rank's GPU work before the call's receives")

    def post(self, step: Any, send: Any, recv_count: int, recv_into: Any, recv_dtype: Any) -> None:
        if recv_count:
            if recv_into is None:
                need = recv_count * recv_dtype.itemsize
                if self._scratch is None or self._scratch.size < need:  # grows once, then reused
                    self._scratch = self.device.empty(need, "u1")
                dst = self._scratch[:need].view(recv_dtype)
            else:
                dst = recv_into
            self._in_place = recv_into is not None
            left, tag = self.comm.left, self._tag
            for lo, hi in slices(recv_count, max(1, self.slice_bytes // dst.itemsize)):
                self._recvs.append((lo, hi, dst[lo:hi], self.comm.mpi.Irecv(as_bytes(dst[lo:hi]), left, tag)))
        if send is not None and send.size:
            if not self._on_host:  # the chunk may still be in flight on the stream
                self.device.synchronize(self.ctx, step.index, self.comm.right, "this rank's kernels producing chunk %s",
                                        step.send)
            right, tag = self.comm.right, self._tag
            for lo, hi in slices(send.size, max(1, self.slice_bytes // send.itemsize)):
                self._sends.append(self.comm.mpi.Isend(as_bytes(send[lo:hi]), right, tag))

    def recv(self, step: Any) -> Iterator[tuple[int, int, Any]]:
        for lo, hi, view, req in self._recvs:
            wait([req], self.ctx, step.index, self.comm.left, "receiving chunk %d", step.recv, sizes=(view.nbytes,))
            yield lo, hi, None if self._in_place else view

    def step_done(self, step: Any) -> None:
        if not self._on_host and self._recvs:  # the scratch is reused by the next step's receive
            self.device.synchronize(self.ctx, step.index, self.comm.left, "this rank's kernels reducing chunk %s",
                                    step.recv)
        if self._sends:
            wait(self._sends, self.ctx, step.index, self.comm.right, "sending chunk %d", step.send)
        self._sends, self._recvs = [], []

    def end(self) -> None:
        pass

    def close(self) -> None:
        """Drop the scratch buffer (the communicator is being freed)."""
        self._scratch = None

    def prepare(self, ctx: Any, step: Any, send: Any, recv_into: Any, tag: int) -> PreparedStep | None:
        """Persistent requests with ``tag`` for one copy step between buffers that stay put (host
        memory only; None otherwise)."""
        if ctx.device.name != "host":
            return None
        per = max(1, self.slice_bytes // ctx.dtype.itemsize)
        mpi, comm = self.comm.mpi, self.comm
        pieces = [] if recv_into is None else slices(recv_into.size, per)
        recvs = [mpi.Recv_init(as_bytes(recv_into[lo:hi]), comm.left, tag) for lo, hi in pieces]
        sizes = [(hi - lo) * recv_into.itemsize for lo, hi in pieces]
        sends = [] if send is None else [
            mpi.Send_init(as_bytes(send[lo:hi]), comm.right, tag) for lo, hi in slices(send.size, per)
        ]
        return PreparedStep(comm, recvs, sends, sizes, tag)

    def abort(self) -> None:
        cancel([req for *_, req in self._recvs], self._sends)
        self._sends, self._recvs = [], []



class PreparedStep:
    """One step's persistent receives (from the left) and sends (to the right), restarted per run;
    each receive checks that it got ``sizes`` bytes."""

    def __init__(self, comm: Any, recvs: list, sends: list, sizes: list[int], tag: int) -> None:
        self.comm, self.recvs, self.sends, self.all = comm, recvs, sends, recvs + sends
        self.sizes, self.statuses, self.expect = sizes, [MPI.Status() for _ in recvs], (tag,)

    def run(self, ctx: Any, step: Any) -> None:
        if not self.all:
            return
        ctx.expect = self.expect
        MPI.Prequest.Startall(self.all)
        try:
            wait(self.recvs, ctx, step.index, self.comm.left, "receiving chunk %s", step.recv, sizes=self.sizes,
                 statuses=self.statuses)
            wait(self.sends, ctx, step.index, self.comm.right, "sending chunk %s", step.send)
        except BaseException:
            cancel(self.recvs, self.sends)
            raise

    def free(self) -> None:
        for req in self.all:  # inactive, or (after an error) cancelled or abandoned: MPI frees it once complete
            if req != MPI.REQUEST_NULL:
                req.Free()
        self.all, self.recvs, self.sends = [], [], []
