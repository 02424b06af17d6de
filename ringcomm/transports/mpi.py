"""MPI transport: chunks travel between ring neighbours by nonblocking MPI point-to-point.

The reference transport, in its two halves: :class:`MpiSend` (this rank's end of the edge to its
right neighbour) and :class:`MpiRecv` (this rank's end of the edge from its left one).

Each chunk is cut into slices of ``slice_bytes`` so that a large chunk is not one message and the
reduction of a slice follows its arrival while it is still in cache. A reduce step receives into a
scratch buffer (allocated once per receiving half, grown when a larger chunk comes); a copy step
receives straight into its destination. Buffers may be host arrays or, when the MPI library is
CUDA-aware, device arrays: the host waits (with the deadline) for the stream before a chunk it
produced is sent and before the scratch is reused, so the scratch's last use is complete when a
step ends.

Latency: a cached plan (engine.Plan, on host memory) has both halves ``prepare`` each step's
persistent requests once (MPI_Send_init/Recv_init, bound to memory by address: :func:`by_address`);
each run restarts them (:class:`PreparedStep`), which saves the per-message set-up of
MPI_Isend/Irecv and the slicing. Two host algorithms whose messages leave the ring also live here:
:class:`GatheredBlocks` (the small all-reduce's persistent MPI_Allgather) and :class:`Exchange`
(a round of persistent messages to and from any ranks, for engine.DirectPlan).

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

import numpy as np
from mpi4py import MPI

from .. import tags
from ..arrays import span
from ..errors import MismatchError
from .base import BYTE, abandon, as_bytes, cancel, slices, wait


class _MpiHalf:
    """What both MPI halves share: a name, the slice size, and binding a call (its device, its tag)."""

    def __init__(self, comm: Any, slice_bytes: int, name: str = "mpi") -> None:
        self.comm, self.slice_bytes, self.name = comm, slice_bytes, name

    def begin(self, ctx: Any, work: Any, src: Any, bounds: Any) -> None:
        self.ctx, self.device = ctx, ctx.device
        self._on_host = self.device.name == "host"
        self._tag = ctx.identity() | tags.DATA
        ctx.expect += (self._tag,)


class MpiSend(_MpiHalf):
    """The sending half: MPI_Isend of each slice to the right neighbour."""

    def __init__(self, comm: Any, slice_bytes: int, name: str = "mpi") -> None:
        super().__init__(comm, slice_bytes, name)
        self._sends: list = []

    def post(self, step: Any, send: Any, writes: bool) -> None:
        if send is None or not send.size:
            return
        if not self._on_host:  # the chunk may still be in flight on the stream
            self.device.synchronize(
                self.ctx, step.index, self.comm.right, "this rank's kernels producing chunk %s", step.send
            )
        mpi, right, tag = self.comm.mpi, self.comm.right, self._tag
        for lo, hi in slices(send.size, max(1, self.slice_bytes // send.itemsize)):
            self._sends.append(mpi.Isend(as_bytes(send[lo:hi]), right, tag))

    def pump(self, step: Any, piece: int) -> None:
        """Every slice is posted at once: nothing to push before the receiver waits."""

    def step_done(self, step: Any) -> None:
        if self._sends:
            wait(self._sends, self.ctx, step.index, self.comm.right, "sending chunk %d", step.send)
            self._sends = []

    def end(self) -> None:
        pass

    def abort(self) -> None:
        cancel((), self._sends)
        self._sends = []

    def close(self) -> None:
        pass

    def prepare(self, ctx: Any, send: Any, tag: int) -> list | None:
        """Persistent sends with ``tag`` of the view ``send`` (host memory only; None otherwise)."""
        if ctx.device.name != "host":
            return None
        if send is None:
            return []
        per = max(1, self.slice_bytes // send.itemsize)
        return [
            self.comm.mpi.Send_init(by_address(send[lo:hi]), self.comm.right, tag) for lo, hi in slices(send.size, per)
        ]


class MpiRecv(_MpiHalf):
    """The receiving half: MPI_Irecv of each slice from the left neighbour."""

    #: a reduce step's incoming pieces are this half's own scratch: the device may overwrite them
    private = True

    def __init__(self, comm: Any, slice_bytes: int, name: str = "mpi") -> None:
        super().__init__(comm, slice_bytes, name)
        self._scratch = None  # raw uint8 scratch for reduce steps, reused across calls
        self._recvs: list = []

    def begin(self, ctx: Any, work: Any, src: Any, bounds: Any) -> None:
        super().begin(ctx, work, src, bounds)
        if not self._on_host:  # MPI's writes into device memory are not ordered with the stream's work
            self.device.synchronize(ctx, None, self.comm.rank, "this rank's GPU work before the call's receives")

    def post(self, step: Any, recv_count: int, recv_into: Any, recv_dtype: Any) -> None:
        if not recv_count:
            return
        if recv_into is None:
            need = recv_count * recv_dtype.itemsize
            if self._scratch is None or self._scratch.size < need:  # grows once, then reused
                self._scratch = self.device.empty(need, "u1")
            dst = self._scratch[:need].view(recv_dtype)
        else:
            dst = recv_into
        self._in_place = recv_into is not None
        mpi, left, tag = self.comm.mpi, self.comm.left, self._tag
        for lo, hi in slices(recv_count, max(1, self.slice_bytes // dst.itemsize)):
            self._recvs.append((lo, hi, dst[lo:hi], mpi.Irecv(as_bytes(dst[lo:hi]), left, tag)))

    def recv(self, step: Any, sender: Any) -> Iterator[tuple[int, int, Any]]:
        for i, (lo, hi, view, req) in enumerate(self._recvs):
            sender.pump(step, i)
            wait([req], self.ctx, step.index, self.comm.left, "receiving chunk %d", step.recv, sizes=(view.nbytes,))
            yield lo, hi, None if self._in_place else view

    def step_done(self, step: Any) -> None:
        if self._recvs:
            if not self._on_host:  # the scratch is reused by the next step's receive
                self.device.synchronize(
                    self.ctx, step.index, self.comm.left, "this rank's kernels reducing chunk %s", step.recv
                )
            self._recvs = []

    def end(self) -> None:
        pass

    def abort(self) -> None:
        cancel([req for *_, req in self._recvs])
        self._recvs = []

    def close(self) -> None:
        """Drop the scratch buffer (the communicator is being freed)."""
        self._scratch = None

    def prepare(self, ctx: Any, recv_into: Any, tag: int) -> list | None:
        """Persistent receives with ``tag`` into the view ``recv_into``, one per slice, as
        ``(lo, hi, view, request)`` (host memory only; None otherwise)."""
        if ctx.device.name != "host":
            return None
        if recv_into is None:
            return []
        mpi, left = self.comm.mpi, self.comm.left
        return [
            (lo, hi, recv_into[lo:hi], mpi.Recv_init(by_address(recv_into[lo:hi]), left, tag))
            for lo, hi in slices(recv_into.size, max(1, self.slice_bytes // recv_into.itemsize))
        ]


class PreparedStep:
    """One step's persistent receives (from the left, ``(lo, hi, view, request)`` per slice) and
    sends (to the right) with one tag, restarted per run; each receive checks that it got the
    size its view has."""

    def __init__(self, comm: Any, recvs: list, sends: list, tag: int) -> None:
        self.comm, self.expect = comm, (tag,)
        self.recvs, self.sends = [req for *_, req in recvs], sends
        self.all = self.recvs + sends
        self.sizes = [view.nbytes for _, _, view, _ in recvs]
        self.statuses = [MPI.Status() for _ in recvs]

    def run(self, ctx: Any, step: Any) -> None:
        """Start the step's requests and wait (within the deadline) until all are complete."""
        if not self.all:
            return
        ctx.expect = self.expect
        MPI.Prequest.Startall(self.all)
        try:
            if self.recvs:
                wait(
                    self.recvs,
                    ctx,
                    step.index,
                    self.comm.left,
                    "receiving chunk %s",
                    step.recv,
                    sizes=self.sizes,
                    statuses=self.statuses,
                )
            if self.sends:
                wait(self.sends, ctx, step.index, self.comm.right, "sending chunk %s", step.send)
        except BaseException:  # cancel the receives, abandon the sends (base.cancel)
            cancel(self.recvs, self.sends)
            raise

    def free(self) -> None:
        for req in self.all:  # inactive, or (after an error) cancelled or abandoned: MPI frees it once complete
            if req != MPI.REQUEST_NULL:
                req.Free()
        self.all, self.recvs, self.sends = [], [], []


def by_address(a: Any) -> list:
    """The host array ``a``'s memory as an MPI byte buffer that holds no reference to it.

    A plan's persistent requests (engine.Plan) are bound to memory, not to the array objects of
    the call that made them: a later call runs them on whichever array then lies at that address
    (the plan is looked up by address), and a plan kept in the cache does not keep a freed array
    alive. They are started only while an array of the call lies there."""
    return [MPI.buffer.fromaddress(span(a)[0], a.nbytes), BYTE]


class GatheredBlocks:
    """A small all-reduce's data movement on the host: every rank's whole buffer gathered by one
    persistent MPI_Allgather (MPI 4: MPI_Allgather_init), restarted per call.

    MPI's own algorithm (in C: recursive doubling, Bruck or a ring, as the library picks) then
    moves the blocks with no Python between its rounds, which matters most when ranks share
    cores. ``mpi``: a communicator used for nothing else (collectives match in call order, not
    by tag), so these requests can only meet each other.

    Identity: a collective carries no tag, so each block starts with a header of HEADER bytes,
    int64 [the call's tag (ringcomm.tags: collective, dtype, op, call number), the call number,
    the count]; after the gather every rank checks every header against its own, and a rank
    that made another call (or has another count: a shorter block still brings its header; a
    longer one is MPI_ERR_TRUNCATE) is a MismatchError, on every rank, before anything is folded.

    ``blocks[i]``: rank i's block (count elements of the dtype); ``mine``: this rank's, where the
    caller copies its data; ``sent``: the bytes a ring gather would send, (N-1)·count·itemsize.
    """

    HEADER = 32

    def __init__(self, comm: Any, mpi: MPI.Intracomm, dtype: np.dtype, count: int) -> None:
        n, size = comm.size, count * dtype.itemsize
        self.comm, self.count = comm, count
        stride = -(-(self.HEADER + size) // 16) * 16
        self._buf = np.zeros(n * stride, np.uint8)
        rows = self._buf.reshape(n, stride)
        self._headers = rows[:, : self.HEADER]
        self._header = rows[comm.rank, : self.HEADER].view(np.int64)  # this rank's
        self.blocks = [rows[i, self.HEADER : self.HEADER + size].view(dtype) for i in range(n)]
        self.mine = self.blocks[comm.rank]
        self.sent = (n - 1) * size
        self._mpi, self._request, self._broken = mpi, None, False

    def run(self, ctx: Any) -> int:
        """Gather every rank's block (within the deadline); return the bytes a ring would send.

        The persistent request is made at the first run, inside the call (after its agreement
        check, with ``check=True``), so that every rank makes its inits in the same order."""
        if self._broken:
            raise RuntimeError("this gather was abandoned after an error")
        if self._request is None:
            self._request = self._mpi.Allgather_init(MPI.IN_PLACE, [self._buf, BYTE])  # this rank's block is in place
        tag = ctx.identity() | tags.PLAN
        header = self._header
        header[0], header[1], header[2] = tag, ctx.call, self.count
        ctx.expect = (tag,)  # a neighbour's ring message of this call or an earlier one: MismatchError
        self._request.Start()
        try:
            wait([self._request], ctx, 0, self.comm.left, "gathering every rank's whole buffer")
        except BaseException as e:  # a collective cannot be cancelled: its buffer must outlive it
            abandon(self._request, self._buf)
            self._request, self._broken = None, True
            if isinstance(e, MPI.Exception) and MPI.Get_error_class(e.Get_error_code()) == MPI.ERR_TRUNCATE:
                raise MismatchError(
                    f"{ctx.collective} call {ctx.call}: rank {self.comm.rank} got a longer block than its own "
                    f"({self.count} elements of {self.blocks[0].dtype}) at step 0 (gathering every rank's whole "
                    "buffer): the ranks disagree on the count or the dtype"
                ) from None
            raise
        headers = self._headers
        if headers.tobytes() != headers[self.comm.rank].tobytes() * len(self.blocks):
            raise self._mismatch(ctx)
        return self.sent

    def _mismatch(self, ctx: Any) -> MismatchError:
        table = self._headers.view(np.int64)
        mine = tuple(int(v) for v in table[self.comm.rank, :3])
        layout, rows = ctx.comm._layout, []
        for rank, (tag, call, count) in enumerate(table[:, :3].tolist()):
            if (tag, call, count) != mine:
                rows.append(f"rank {rank} in {layout.describe(tag & ~7, call)}, count {count}")
        return MismatchError(
            f"{ctx.collective} call {ctx.call}: rank {self.comm.rank} is in {layout.describe(mine[0] & ~7, mine[1])}, "
            f"count {mine[2]}, but {'; '.join(rows)} (at step 0, gathering every rank's whole buffer): the ranks did "
            "not make the same call"
        )

    def free(self) -> None:
        if self._request is not None:
            self._request.Free()
            self._request = None


class Exchange:
    """Persistent receives from and sends to any ranks (not only ring neighbours), with one tag,
    started together and awaited within the deadline: one round of a host algorithm whose
    messages do not follow the ring (engine.DirectPlan).

    ``recvs``: ``(rank, view)`` to receive into, each checked for the size of its view; ``sends``:
    ``(rank, view)`` to send. Requests are bound by address (by_address), as a Plan's are.
    """

    def __init__(self, mpi: MPI.Intracomm, recvs: list, sends: list, tag: int) -> None:
        self.expect = (tag,)
        self._recvs = [
            (rank, view.nbytes, mpi.Recv_init(by_address(view), rank, tag)) for rank, view in recvs if view.size
        ]
        self._sends = [(rank, mpi.Send_init(by_address(view), rank, tag)) for rank, view in sends if view.size]
        self._all = [req for *_, req in self._recvs] + [req for _, req in self._sends]
        self._statuses = [[MPI.Status()] for _ in self._recvs]

    def run(self, ctx: Any, step: int, what: str) -> None:
        """Start the round and wait until every message of it is complete (``what``: for errors)."""
        if not self._all:
            return
        ctx.expect = self.expect
        MPI.Prequest.Startall(self._all)
        try:
            for (rank, size, req), status in zip(self._recvs, self._statuses):
                wait([req], ctx, step, rank, "receiving %s from rank %d", what, rank, sizes=(size,), statuses=status)
            for rank, req in self._sends:
                wait([req], ctx, step, rank, "sending %s to rank %d", what, rank)
        except BaseException:
            cancel([req for *_, req in self._recvs], [req for _, req in self._sends])
            raise

    def free(self) -> None:
        for req in self._all:
            if req != MPI.REQUEST_NULL:
                req.Free()
        self._all, self._recvs, self._sends = [], [], []
