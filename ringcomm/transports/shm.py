"""Shared memory on one node: the small host all-reduce's gather through an MPI shared-memory window.

When every rank shares one node (MPI's COMM_TYPE_SHARED split covers them all), the Communicator
allocates one window (MPI_Win_allocate_shared) at creation. Each rank's region of it holds a
sequence word on a cache line of its own, then two slots of HEADER + ``capacity`` bytes. A small
all-reduce copies its buffer into its own slot, publishes, waits until every rank has published,
and folds the N blocks where they lie, reading the other ranks' slots in place: one copy of the
data, no message, no request, and no other rank's progress needed but its publishing.

Protocol (every rank makes the same gathers, in the same order; :class:`SharedBlocks`): gather g
(counted per communicator: 1, 2, ...) uses slot g % 2 of every region. A rank writes its slot's
header (the call's tag, the call number, the count) and data, then MPI_Win_sync (a memory barrier
in MPI's shared-memory model), then its sequence word = g; it waits until every other rank's word
is at least g, MPI_Win_sync again, and checks every header against its own before it reads any
data. Slot g % 2 was last used by gather g - 2, which every other rank had folded before it
published g - 1, and this rank saw all of them publish g - 1 before it could start gather g; so a
slot is never overwritten while someone may still read it, with two slots and no further
handshake. A rank may already be at g + 1 when another is still folding g (their slots differ).

Identity and failures: a header that differs (another collective, dtype, op, count or call) is a
:class:`ringcomm.MismatchError` on every rank that sees it; a rank that never publishes is a
:class:`ringcomm.TimeoutError` naming it, and while a wait lasts it watches for aborts and for
ring messages of another call (``Communicator._watch``), as every wait does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .. import tags
from ..errors import MismatchError
from .base import wait_until

#: bytes of a rank's sequence word's line (the word alone on it: no false sharing with the slots)
LINE = 64


class SharedWindow:
    """The window: every rank's region (MPI_Win_allocate_shared over ``mpi``, whose ranks all share
    one node), in a passive-target epoch for its whole life (MPI_Win_lock_all), so that
    MPI_Win_sync orders its loads and stores. ``capacity``: the bytes of a slot's data (every
    rank passes the same)."""

    HEADER = 32

    def __init__(self, mpi: MPI.Intracomm, capacity: int) -> None:
        """Collective over ``mpi``; the caller then waits for every rank (a barrier) before the
        first gather, so that no rank reads a region its owner has not zeroed yet."""
        self.capacity = capacity
        self.stride = -(-(self.HEADER + capacity) // LINE) * LINE
        self.win = MPI.Win.Allocate_shared(LINE + 2 * self.stride, 1, comm=mpi)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.regions = [np.frombuffer(self.win.Shared_query(rank)[0], np.uint8) for rank in range(mpi.size)]
        self.regions[mpi.rank][...] = 0
        self.win.Sync()
        #: every rank's sequence word (a memoryview of one int64: cheaper to read than numpy's)
        self.seqs = [memoryview(region[:8].view(np.int64)) for region in self.regions]
        self.rank = mpi.rank
        #: gathers this rank has completed (the sequence word it last published)
        self.gathers = 0

    def slot(self, rank: int, side: int, nbytes: int) -> tuple[memoryview, np.ndarray]:
        """(the header, a memoryview of 4 int64, and the first ``nbytes`` of data) of ``rank``'s slot ``side``."""
        at = LINE + side * self.stride
        region = self.regions[rank]
        header = memoryview(region[at : at + self.HEADER].view(np.int64))
        return header, region[at + self.HEADER : at + self.HEADER + nbytes]

    def free(self) -> None:
        """Free the window (collective and synchronizing: call once every rank is known to be here)."""
        self.win.Unlock_all()
        self.win.Free()
        self.regions = self.seqs = []


class SharedBlocks:
    """A small all-reduce's gather of ``count`` elements of ``dtype`` through a :class:`SharedWindow`.

    ``side``: the slot the next run fills (it alternates); ``mine[side]``: this rank's block there,
    where the caller copies its data before :meth:`run`; ``blocks[side][i]``: rank i's block, read
    in place after the run. ``sent``: the bytes a ring gather would send, (N-1)·count·itemsize.
    """

    def __init__(self, comm: Any, window: SharedWindow, dtype: np.dtype, count: int) -> None:
        n, nbytes = comm.size, count * dtype.itemsize
        self.comm, self.window, self.count, self.dtype = comm, window, count, dtype
        self._rank, self._seq, self._sync = comm.rank, window.seqs[comm.rank], window.win.Sync
        self._others = [(rank, window.seqs[rank]) for rank in range(n) if rank != comm.rank]
        sides = [[window.slot(rank, side, nbytes) for rank in range(n)] for side in (0, 1)]
        self._headers = [[header for header, _ in side] for side in sides]
        self.blocks = [[data.view(dtype) for _, data in side] for side in sides]
        self.mine = [side[comm.rank] for side in self.blocks]
        self.sent = (n - 1) * nbytes
        self._tags: dict = {}  # the header's tag (the call's, as of call 0) by (op, accumulation)

    @property
    def side(self) -> int:
        return (self.window.gathers + 1) & 1

    def run(self, ctx: Any) -> int:
        """Publish this rank's block (already in ``mine[side]``), wait until every rank has published
        its own (within the deadline), and check their headers; return the bytes a ring would send."""
        window = self.window
        g = window.gathers + 1
        headers = self._headers[g & 1]
        header = headers[self._rank]
        tag = self._tags.get((ctx.op, ctx.wide))
        if tag is None:
            tag = self._tags[ctx.op, ctx.wide] = ctx.comm._layout.base(
                ctx.collective, ctx.dtype, ctx.op, ctx.root, 0, ctx.wide) | tags.PLAN
        header[0], header[1], header[2], header[3] = tag, ctx.call, self.count, g
        self._sync()  # the header and data are visible before the sequence word says so
        self._seq[0] = g
        for rank, seq in self._others:
            if seq[0] < g:
                # a neighbour's ring message of this call or an earlier one: MismatchError (Communicator._watch)
                ctx.expect = (ctx.identity() | tags.PLAN,)
                wait_until(lambda: seq[0] >= g, ctx, 0, rank, "rank %d's block in shared memory", rank)
        self._sync()  # and read after it
        window.gathers = g
        for other in headers:
            if other != header:
                raise self._mismatch(ctx, headers)
        return self.sent

    def _mismatch(self, ctx: Any, headers: list) -> MismatchError:
        layout = ctx.comm._layout
        said = [tuple(header) for header in headers]  # tag, call, count, gather number
        mine = said[self._rank]

        def call_of(tag: int, call: int) -> str:
            return layout.describe(layout.at_call(tag & ~7, call), call)

        rows = [f"rank {rank} in {call_of(tag, call)}, count {count}"
                for rank, (tag, call, count, _) in enumerate(said) if said[rank] != mine]
        return MismatchError(
            f"{ctx.collective} call {ctx.call}: rank {self._rank} is in {call_of(mine[0], mine[1])}, count {mine[2]}, "
            f"but {'; '.join(rows)} (at step 0, gathering every rank's whole buffer in shared memory): the ranks did "
            "not make the same call"
        )

    def free(self) -> None:
        """Nothing of its own: the window is the Communicator's."""
