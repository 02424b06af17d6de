"""Shared memory on one node: host collectives through an MPI shared-memory window.

When every rank shares one node (MPI's COMM_TYPE_SHARED split covers them all), the Communicator
allocates one window (MPI_Win_allocate_shared) at creation. Each rank's region of it holds a
*line* of 64 bytes (its sequence word and two headers: nothing else shares the cache line), two
*slots* of up to ``small`` bytes and an *inbox* of up to ``direct`` bytes. Three kinds of call
use it, with no message and no request:

- a small all-reduce (:class:`SharedBlocks`) copies its buffer into a slot, publishes, waits until
  every rank has published, and folds the N blocks where they lie (the others' slots read in
  place: one copy of the data);
- a larger one (:class:`SharedDirect`, engine.SharedDirectPlan) copies its buffer (all chunks
  but its own) into its inbox and publishes; every rank folds its own chunk from the N inboxes,
  copies the result back over its chunk in every other inbox and publishes again; every rank
  then copies the other ranks' reduced chunks out of its own inbox;
- a broadcast, an all-gather or a reduce-scatter up to the inbox's size (:class:`SharedPlaces`,
  engine.SharedPlacesPlan): every rank (a broadcast: the root) copies
  its part into a slot (small) or its inbox, every rank publishes, and every rank reads what it
  needs of the others' (copies or folds; from the inboxes, all publish again once done).

Protocol (every rank makes the same calls, in the same order): a rank's *publications* are
numbered 1, 2, ... (its sequence word holds the last). To publish k, a rank writes its data, then
header k & 1 of its line (what it publishes: the call's tag, the kind of call and the count in
one word, the call number in the next), then MPI_Win_sync (a memory barrier in MPI's
shared-memory model), then its sequence word = k; then it waits until every other rank's word
has reached k, MPI_Win_sync again, and checks every rank's header k & 1 against its own before
it reads any data. Whatever a rank reads after publication k it has read before it publishes
k + 1. A rank rewrites a place (data or header) only before a publication k' of at least k + 2,
where k is the last publication after which another rank read that place (a header and a slot
alternate with the publication's parity, and a call that writes a slot publishes once; an inbox
serves again at the next call or all-reduce piece that uses an inbox, two publications later at
least, since each of those publishes twice); by then it has seen every rank
publish k' - 1 >= k + 1, so all have finished reading it. So header k & 1 of a rank whose word
is k or k + 1 is its header of publication k. One place is written by another rank: in a larger
all-reduce, chunk q's run of an inbox published as k is rewritten by the rank that folds chunk q
(the only other rank that reads it) before that rank publishes k + 1; the inbox's owner reads it
after publication k + 1 (having seen every rank's) and rewrites it itself, after that read and
before it publishes k + 2. No other handshake is needed, and a rank may be one publication ahead
of another. A header holds counts below COUNT_LIMIT (2**31): larger calls never use the window.

Identity and failures: a header that differs (another collective, dtype, op, count, call, or the
other kind of call) is a :class:`ringcomm.MismatchError` on every rank that sees it; a rank that
never publishes is a :class:`ringcomm.TimeoutError` naming it, and while a wait lasts it watches
for aborts and for ring messages of another call (``Communicator._watch``), as every wait does.
After an error the window stays mapped until the process ends (a late peer may read it).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import tags
from ..errors import MismatchError
from .base import wait_until

#: bytes of a rank's line: int64 [sequence word, header 0 (2 words), header 1 (2 words), unused]
LINE = 64
#: the kinds of call, as headers carry them (bit 31 of a header's first word) and errors name them
KINDS = ("in slots", "in inboxes")
#: the counts a header can carry (bits 32-62 of its first word, an int64)
COUNT_LIMIT = 1 << 31


def _lines(nbytes: int) -> int:
    return -(-nbytes // LINE) * LINE


def region_bytes(n: int, small: int, direct: int) -> int:
    """The bytes of one rank's region for ``n`` ranks, slots of ``small`` and an inbox of ``direct`` bytes."""
    return LINE + 2 * _lines(small) + _lines(direct)


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
        self._slot = _lines(small)
        self.win = MPI.Win.Allocate_shared(region_bytes(n, small, direct), 1, comm=mpi)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.regions = [np.frombuffer(self.win.Shared_query(rank)[0], np.uint8) for rank in range(n)]
        self.regions[mpi.rank][...] = 0  # every page touched now: too little shared memory fails here
        self.win.Sync()
        #: every rank's line (memoryviews of 8 int64: cheaper to read and write than numpy's)
        lines = [memoryview(region[:LINE].view(np.int64)) for region in self.regions]
        self.rank = mpi.rank
        self._lines, self._line = lines, lines[mpi.rank]
        self._others = [(rank, lines[rank]) for rank in range(n) if rank != mpi.rank]
        self._sync = self.win.Sync
        #: the number of this rank's last publication
        self.published = 0
        self._waiting = False  # in a publication's wait (watch(): another rank may be ahead then)
        #: how many times a wait reads a sequence word before it yields the processor (wait_until)
        self.spins = spins

    @property
    def side(self) -> int:
        """The parity of the next publication: the slot (and header) it uses."""
        return (self.published + 1) & 1

    def slot(self, rank: int, side: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``rank``'s slot ``side``."""
        at = LINE + side * self._slot
        return self.regions[rank][at : at + nbytes]

    def inbox(self, rank: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``rank``'s inbox."""
        at = LINE + 2 * self._slot
        return self.regions[rank][at : at + nbytes]

    def publish(self, ctx: Any, step: int, what: str, word: int) -> None:
        """Publish what this rank wrote (its next number, with the header ``word``, ctx.call), wait
        (within the deadline) until every rank has published as many times, and check their
        headers (MismatchError); ``what``: what the wait is for, in errors."""
        k = self.published + 1
        line, at, call = self._line, 1 + 2 * (k & 1), ctx.call
        line[at] = word
        line[at + 1] = call
        self._sync()  # what was written is visible before the sequence word says so
        self.published = line[0] = k
        for rank, other in self._others:
            if other[0] < k:
                spins = self.spins
                while spins and other[0] < k:
                    spins -= 1
            if other[0] < k:
                # no message belongs to a call in the window: a neighbour's message of this call or an
                # earlier one is a MismatchError (Communicator._watch); a rank may pass this publication
                # while this one still waits in it (watch() then looks for no rank ahead)
                ctx.expect = (ctx.identity() | tags.SHARED,)
                self._waiting = True
                wait_until(
                    lambda other=other: other[0] >= k, ctx, step, rank, "rank %d's %s in shared memory", rank, what
                )
                self._waiting = False
        self._sync()  # and read after it
        for _, other in self._others:
            if other[at] != word or other[at + 1] != call:
                raise self._mismatch(ctx, step, at, what)

    def _mismatch(self, ctx: Any, step: int, at: int, what: str) -> MismatchError:
        layout, me = ctx.comm._layout, self.rank
        said = [(line[at], line[at + 1]) for line in self._lines]  # (tag | kind << 31 | count << 32, call)
        rows = [f"rank {rank} in {_call_of(layout, *header)}" for rank, header in enumerate(said) if header != said[me]]
        return MismatchError(
            f"{ctx.collective} call {ctx.call}: rank {me} is in {_call_of(layout, *said[me])}, but {'; '.join(rows)} "
            f"(at step {step}, {what} in shared memory): the ranks did not make the same call"
        )

    def watch(self, ctx: Any, step: int | None, peer: int) -> None:
        """While this rank waits outside the window (Communicator._watch): a rank one publication
        ahead of it, whose header names this call or an earlier one, is in the window where this
        rank is not (its counts put the call on the other side of a window size, say): a
        MismatchError. (The header of a rank's last publication k stays until its publication
        k + 2, which needs this rank's k + 1. In a publication's own wait a rank may be ahead:
        once every rank has published, one may go on while this one has not looked yet.)"""
        if self._waiting:
            return
        k, layout = self.published, ctx.comm._layout
        for rank, line in self._others:
            seq = line[0]
            if seq > k:
                at = 1 + 2 * (seq & 1)
                word, call = line[at], line[at + 1]
                if call <= ctx.call:
                    at_step = "during set-up" if step is None else f"at step {step}"
                    raise MismatchError(
                        f"{ctx.collective} call {ctx.call}: rank {rank} is in {_call_of(layout, word, call)}, but "
                        f"rank {self.rank} is in {ctx.collective} call {ctx.call} outside shared memory "
                        f"({at_step}, waiting for rank {peer}): the ranks did not make the same call"
                    )

    def free(self) -> None:
        """Free the window (collective and synchronizing: call once every rank is known to be here)."""
        self.win.Unlock_all()
        self.win.Free()
        self.regions = self._lines = self._others = []


def _call_of(layout: Any, word: int, call: int) -> str:
    """A header (``word``: tag | kind << 31 | count << 32, and the call number) in words."""
    tag, kind, count = word & 0x7FFFFFFF, (word >> 31) & 1, word >> 32
    return f"{layout.describe(layout.at_call(tag & ~7 | tags.SHARED, call), call)}, count {count}, {KINDS[kind]}"


class _Headed:
    """A call of one ``kind`` (0: slots, 1: inboxes) of ``count`` elements: its header word, by op."""

    def __init__(self, window: SharedWindow, kind: int, count: int) -> None:
        self.window = window
        self._words: dict = {}  # by (op, accumulation)
        self._kind = kind << 31 | count << 32

    def word(self, ctx: Any) -> int:
        """The header's first word: the call's tag (of call 0; it fits 31 bits), kind and count."""
        word = self._words.get((ctx.op, ctx.wide))
        if word is None:
            tag = ctx.comm._layout.base(ctx.collective, ctx.dtype, ctx.op, ctx.root, 0, ctx.wide) | tags.SHARED
            word = self._words[ctx.op, ctx.wide] = tag | self._kind
        return word


class SharedBlocks(_Headed):
    """A small all-reduce's gather of ``count`` elements of ``dtype`` through a :class:`SharedWindow`.

    ``window.side``: the slot the next call fills (the parity of the next publication); ``mine[side]``:
    this rank's block there, where the caller copies its data before it publishes
    (:meth:`publication`); ``blocks[side][i]``: rank i's block, read in place after the publication.
    ``sent``: the bytes a ring gather would send, (N-1)·count·itemsize.
    """

    def __init__(self, comm: Any, window: SharedWindow, dtype: np.dtype, count: int) -> None:
        super().__init__(window, 0, count)
        n, nbytes = comm.size, count * dtype.itemsize
        self.blocks = [[window.slot(rank, side, nbytes).view(dtype) for rank in range(n)] for side in (0, 1)]
        self.mine = [side[comm.rank] for side in self.blocks]
        self.sent = (n - 1) * nbytes

    def publication(self, ctx: Any) -> Any:
        """``publish()``, bound to ``ctx`` once for every call it numbers (engine.SharedGatherFold):
        publish this rank's block (already in ``mine[side]``), wait until every rank has published
        its own (within the deadline), and check their headers."""
        return partial(self.window.publish, ctx, 0, "whole buffer", self.word(ctx))

    def free(self) -> None:
        """Nothing of its own: the window is the Communicator's."""


class SharedDirect(_Headed):
    """A larger all-reduce's publications of ``count`` elements of ``dtype`` through a
    :class:`SharedWindow`, two per *piece* (engine.SharedDirectPlan folds and copies between them).

    ``runs[k][q]``: where piece k holds its run of chunk q (of ``bounds``, the chunks by ring
    place): (start, stop) in the buffer (empty where the chunk has ended) and where it lies in an
    inbox. A buffer that fits an inbox is one piece, each chunk where it lies in the buffer; a
    larger one is cut into the fewest pieces whose N runs of at most ``stride`` elements fit an
    inbox side by side (chunk q's at ``q * stride``, on a cache line). ``mine``: this rank's inbox,
    where the caller copies its runs of the piece (all but its own chunk's, which nobody else
    reads) before :meth:`inputs`; ``inboxes[i]``: rank i's, after it. Between the two publications
    the rank that folds chunk q writes the reduced run over chunk q's run in every other inbox;
    after :meth:`outputs` each rank reads the reduced runs from its own inbox.
    """

    def __init__(self, comm: Any, window: SharedWindow, dtype: np.dtype, count: int, bounds: Any) -> None:
        super().__init__(window, 1, count)
        n, size = comm.size, dtype.itemsize
        most = window.direct // size  # (elements of an inbox)
        if count <= most:
            self.runs, used = [[(lo, hi, lo) for lo, hi in bounds]], count
        else:
            line = max(1, LINE // size)  # (elements of a cache line)
            longest = max(line, most // n // line * line)  # the longest run N of which fit an inbox
            largest = max(hi - lo for lo, hi in bounds)
            pieces = -(-largest // longest)
            stride = -(-largest // pieces)  # (the runs as even as lines allow)
            stride = -(-stride // line) * line
            self.runs = [
                [(lo + k * stride, min(lo + (k + 1) * stride, hi), q * stride) for q, (lo, hi) in enumerate(bounds)]
                for k in range(pieces)
            ]
            used = n * stride
        self.inboxes = [window.inbox(rank, used * size).view(dtype) for rank in range(n)]
        self.mine = self.inboxes[comm.rank]

    def inputs(self, ctx: Any, piece: int) -> None:
        """Publish this rank's runs of ``piece`` (in ``mine``), wait for every rank's, check the headers."""
        what = "whole buffer" if len(self.runs) == 1 else f"piece {piece} of its buffer"
        self.window.publish(ctx, 2 * piece, what, self.word(ctx))

    def outputs(self, ctx: Any, piece: int) -> None:
        """Publish this rank's reduced run of ``piece`` (in the others' inboxes), wait for every rank's,
        check the headers."""
        what = "reduced chunk" if len(self.runs) == 1 else f"reduced chunk of piece {piece}"
        self.window.publish(ctx, 2 * piece + 1, what, self.word(ctx))


class SharedPlaces(_Headed):
    """A call in which every rank has a *place* of ``each`` elements of ``dtype`` in the window
    (the header's count: ``count``, the call's): the owner writes its place before
    :meth:`inputs`, the others read it between :meth:`inputs` and :meth:`outputs`. Up to the
    slots' size a place is the owner's slot of the publication's parity (one publication: the
    slot is next written two publications later); above it, the owner's inbox, and a second
    publication after the reads (an owner writes its inbox again only after every rank has
    published that it is done). ``sides[window.side][rank]``: rank's place for the next call.
    Broadcasts read the root's place, all-gathers every rank's shard and reduce-scatters every
    rank's buffer (engine.SharedPlacesPlan)."""

    def __init__(self, window: SharedWindow, dtype: np.dtype, count: int, each: int) -> None:
        nbytes = each * dtype.itemsize
        slots = nbytes <= window.small
        super().__init__(window, 0 if slots else 1, count)
        n = len(window.regions)
        if slots:
            self.sides = [[window.slot(rank, side, nbytes).view(dtype) for rank in range(n)] for side in (0, 1)]
        else:
            self.sides = [[window.inbox(rank, nbytes).view(dtype) for rank in range(n)]] * 2
        #: whether the reads are published too (the inbox; not the slots)
        self.twice = not slots

    def inputs(self, ctx: Any, what: str) -> None:
        """Publish this rank's place (``what`` it holds, for errors), wait for every rank's, check the headers."""
        self.window.publish(ctx, 0, what, self.word(ctx))

    def outputs(self, ctx: Any, what: str) -> None:
        """After the reads of the others' inboxes: publish that (``what`` was read), wait for every rank
        (slots: nothing)."""
        if self.twice:
            self.window.publish(ctx, 1, what, self.word(ctx))
