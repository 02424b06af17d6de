"""Shared memory on one node: host all-reduces through an MPI shared-memory window.

When every rank shares one node (MPI's COMM_TYPE_SHARED split covers them all), the Communicator
allocates one window (MPI_Win_allocate_shared) at creation. Each rank's region of it holds a
sequence word on a cache line of its own, two *slots* (a header of 32 bytes, then up to
``small`` bytes), an *inbox* (a header, then up to ``direct`` bytes) and an *outbox* (a chunk:
``direct``/N bytes and a little). Two kinds of call use it, with no message and no request:

- a small all-reduce (:class:`SharedBlocks`) copies its buffer into a slot, publishes, waits until
  every rank has published, and folds the N blocks where they lie (the others' slots read in
  place: one copy of the data);
- a larger one (:class:`SharedDirect`, engine.SharedDirectPlan) copies its buffer (all chunks
  but its own) into its inbox and publishes; every rank folds its own chunk from the N inboxes
  into its outbox and publishes again; every rank then copies the other ranks' reduced chunks
  from their outboxes.

Protocol (every rank makes the same calls, in the same order): a rank's *publications* are
numbered 1, 2, ... (its sequence word holds the last). To publish, a rank writes what it publishes
(a header: the call's tag, the call number, the count, the publication's number), then
MPI_Win_sync (a memory barrier in MPI's shared-memory model), then its sequence word; then it
waits until every other rank's word has reached the same number, MPI_Win_sync again, and, for a
call's first publication, checks every header against its own before it reads any data. Whatever
a rank reads after publication k it has read before it publishes k + 1. A rank rewrites a place
only before a publication k' of at least k + 2, where k is the last publication after which that
place was read (a small all-reduce's slot alternates with the publication's parity; an inbox or
outbox serves again at the next larger all-reduce, two publications later at least); by then it
has seen every rank publish k' - 1 >= k + 1, so all have finished reading it. No other handshake
is needed, and a rank may be one publication ahead of another.

Identity and failures: a header that differs (another collective, dtype, op, count, call, or a
rank in the other kind of call) is a :class:`ringcomm.MismatchError` on every rank that sees it; a
rank that never publishes is a :class:`ringcomm.TimeoutError` naming it, and while a wait lasts it
watches for aborts and for ring messages of another call (``Communicator._watch``), as every wait
does. After an error the window stays mapped until the process ends (a late peer may read it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .. import tags
from ..errors import MismatchError
from .base import wait_until

#: bytes of a rank's sequence word's line (the word alone on it: no false sharing with the data)
LINE = 64
#: bytes of a header: int64 [the call's tag (of call 0), the call number, the count, the publication]
HEADER = 32


def _lines(nbytes: int) -> int:
    return -(-nbytes // LINE) * LINE


def region_bytes(n: int, small: int, direct: int) -> int:
    """The bytes of one rank's region for ``n`` ranks, slots of ``small`` and an inbox of ``direct`` bytes."""
    return LINE + 2 * _lines(HEADER + small) + _lines(HEADER + direct) + _outbox(n, direct)


def _outbox(n: int, direct: int) -> int:
    # a rank's chunk of at most direct bytes: at most 1/n of it and ALIGN (16) elements of 8 bytes more
    return _lines(direct // n + 128) if direct else 0


class SharedWindow:
    """The window: every rank's region (MPI_Win_allocate_shared over ``mpi``, whose ranks all share
    one node), in a passive-target epoch for its whole life (MPI_Win_lock_all), so that
    MPI_Win_sync orders its loads and stores. ``small``, ``direct``: the data bytes of a slot and
    of an inbox (every rank passes the same); ``spins``: reads of a sequence word before a wait
    yields (0 when ranks outnumber cores: the rank waited for may need this core). Collective
    over ``mpi``; the caller then waits for every rank (a barrier) before the first call, so that
    no rank reads a region its owner has not zeroed yet."""

    def __init__(self, mpi: MPI.Intracomm, small: int, direct: int, spins: int) -> None:
        n = mpi.size
        self.small, self.direct = small, direct
        self._slot, self._inbox = _lines(HEADER + small), _lines(HEADER + direct)
        self.win = MPI.Win.Allocate_shared(region_bytes(n, small, direct), 1, comm=mpi)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.regions = [np.frombuffer(self.win.Shared_query(rank)[0], np.uint8) for rank in range(n)]
        self.regions[mpi.rank][...] = 0  # every page touched now: too little shared memory fails here
        self.win.Sync()
        #: every rank's sequence word (a memoryview of one int64: cheaper to read than numpy's)
        seqs = [memoryview(region[:8].view(np.int64)) for region in self.regions]
        self.rank = mpi.rank
        self._seq, self._others = seqs[mpi.rank], [(rank, seqs[rank]) for rank in range(n) if rank != mpi.rank]
        self._sync = self.win.Sync
        #: the number of this rank's last publication
        self.published = 0
        #: how many times a wait reads a sequence word before it yields the processor (wait_until)
        self.spins = spins

    def slot(self, rank: int, side: int, nbytes: int) -> tuple[memoryview, np.ndarray]:
        """(the header, a memoryview of 4 int64, and the first ``nbytes`` of data) of ``rank``'s slot ``side``."""
        return self._place(rank, LINE + side * self._slot, nbytes)

    def inbox(self, rank: int, nbytes: int) -> tuple[memoryview, np.ndarray]:
        """(the header, the first ``nbytes`` of data) of ``rank``'s inbox."""
        return self._place(rank, LINE + 2 * self._slot, nbytes)

    def outbox(self, rank: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``rank``'s outbox."""
        at = LINE + 2 * self._slot + self._inbox
        return self.regions[rank][at : at + nbytes]

    def _place(self, rank: int, at: int, nbytes: int) -> tuple[memoryview, np.ndarray]:
        region = self.regions[rank]
        return memoryview(region[at : at + HEADER].view(np.int64)), region[at + HEADER : at + HEADER + nbytes]

    def publish(self, ctx: Any, step: int, what: str) -> None:
        """Publish what this rank wrote (its next number), then wait (within the deadline) until
        every rank has published as many times; ``what``: what the wait is for, in errors."""
        self._sync()  # what was written is visible before the sequence word says so
        k = self.published = self.published + 1
        self._seq[0] = k
        for rank, seq in self._others:
            if seq[0] < k:
                spins = self.spins
                while spins and seq[0] < k:
                    spins -= 1
            if seq[0] < k:
                # a neighbour's ring message of this call or an earlier one: MismatchError (Communicator._watch)
                ctx.expect = (ctx.identity() | tags.PLAN,)
                wait_until(lambda: seq[0] >= k, ctx, step, rank, "rank %d's %s in shared memory", rank, what)
        self._sync()  # and read after it

    def free(self) -> None:
        """Free the window (collective and synchronizing: call once every rank is known to be here)."""
        self.win.Unlock_all()
        self.win.Free()
        self.regions = self._others = []


class _Headed:
    """A call's first publication carries a header in every rank's ``place``; checked after it
    (a header of an earlier publication there: that rank published elsewhere, in a call of the
    other kind)."""

    place = ""

    def _stamp(self, ctx: Any, header: memoryview) -> None:
        tag = self._tags.get((ctx.op, ctx.wide))
        if tag is None:
            tag = self._tags[ctx.op, ctx.wide] = ctx.comm._layout.base(
                ctx.collective, ctx.dtype, ctx.op, ctx.root, 0, ctx.wide) | tags.PLAN
        header[0], header[1], header[2], header[3] = tag, ctx.call, self.count, self.window.published + 1

    def _check(self, ctx: Any, headers: list, header: memoryview, what: str) -> None:
        for other in headers:
            if other != header:
                raise self._mismatch(ctx, headers, what)

    def _mismatch(self, ctx: Any, headers: list, what: str) -> MismatchError:
        layout, me = ctx.comm._layout, self.window.rank
        said = [tuple(header) for header in headers]  # tag, call, count, publication
        mine = said[me]

        def call_of(tag: int, call: int) -> str:
            return layout.describe(layout.at_call(tag & ~7, call), call)

        rows = [f"rank {rank} in {call_of(tag, call)}, count {count}" if publication == mine[3] else
                f"rank {rank} in a call that does not publish in its {self.place} (a buffer of at most "
                f"small_bytes goes to a slot, a larger one to the inbox)"
                for rank, (tag, call, count, publication) in enumerate(said) if said[rank] != mine]
        return MismatchError(
            f"{ctx.collective} call {ctx.call}: rank {me} is in {call_of(mine[0], mine[1])}, count {mine[2]}, "
            f"but {'; '.join(rows)} (at step 0, {what} in shared memory): the ranks did not make the same call"
        )


class SharedBlocks(_Headed):
    """A small all-reduce's gather of ``count`` elements of ``dtype`` through a :class:`SharedWindow`.

    ``side``: the slot the next run fills (the parity of the next publication); ``mine[side]``:
    this rank's block there, where the caller copies its data before :meth:`run`;
    ``blocks[side][i]``: rank i's block, read in place after the run. ``sent``: the bytes a ring
    gather would send, (N-1)·count·itemsize.
    """

    place = "slot"

    def __init__(self, comm: Any, window: SharedWindow, dtype: np.dtype, count: int) -> None:
        n, nbytes = comm.size, count * dtype.itemsize
        self.window, self.count = window, count
        sides = [[window.slot(rank, side, nbytes) for rank in range(n)] for side in (0, 1)]
        self._headers = [[header for header, _ in side] for side in sides]
        self.blocks = [[data.view(dtype) for _, data in side] for side in sides]
        self.mine = [side[comm.rank] for side in self.blocks]
        self.sent = (n - 1) * nbytes
        self._tags: dict = {}  # the header's tag by (op, accumulation)

    @property
    def side(self) -> int:
        return (self.window.published + 1) & 1

    def run(self, ctx: Any) -> int:
        """Publish this rank's block (already in ``mine[side]``), wait until every rank has published
        its own (within the deadline), and check their headers; return the bytes a ring would send."""
        window = self.window
        headers = self._headers[(window.published + 1) & 1]
        header = headers[window.rank]
        self._stamp(ctx, header)
        window.publish(ctx, 0, "whole buffer")
        self._check(ctx, headers, header, "gathering every rank's whole buffer")
        return self.sent

    def free(self) -> None:
        """Nothing of its own: the window is the Communicator's."""


class SharedDirect(_Headed):
    """A larger all-reduce's two publications of ``count`` elements of ``dtype`` through a
    :class:`SharedWindow` (engine.SharedDirectPlan folds and copies between them).

    ``mine``: this rank's inbox, where the caller copies its buffer (all but its own chunk, which
    nobody else reads) before :meth:`inputs`; ``inboxes[i]``: rank i's buffer, after it;
    ``outboxes[i]``: rank i's reduced chunk (its chunk of ``bounds``, the chunks by ring place),
    which the caller writes into its own before :meth:`outputs` and reads from the others' after it.
    """

    place = "inbox"

    def __init__(self, comm: Any, window: SharedWindow, dtype: np.dtype, count: int, bounds: Any) -> None:
        n, nbytes = comm.size, count * dtype.itemsize
        self.window, self.count = window, count
        boxes = [window.inbox(rank, nbytes) for rank in range(n)]
        self._headers = [header for header, _ in boxes]
        self.inboxes = [data.view(dtype) for _, data in boxes]
        self.mine = self.inboxes[comm.rank]
        self.outboxes = [np.empty(0, dtype)] * n
        for place, (lo, hi) in enumerate(bounds):
            rank = comm.ring[place]
            self.outboxes[rank] = window.outbox(rank, (hi - lo) * dtype.itemsize).view(dtype)
        self._tags: dict = {}

    def inputs(self, ctx: Any) -> None:
        """Publish this rank's buffer (in ``mine``), wait for every rank's, check the headers."""
        header = self._headers[self.window.rank]
        self._stamp(ctx, header)
        self.window.publish(ctx, 0, "whole buffer")
        self._check(ctx, self._headers, header, "publishing every rank's whole buffer")

    def outputs(self, ctx: Any) -> None:
        """Publish this rank's reduced chunk (in its outbox), wait for every rank's."""
        self.window.publish(ctx, 1, "reduced chunk")
