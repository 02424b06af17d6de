"""The engine: the one loop that executes a schedule.

For each step: hand the outgoing chunk to the transport, obtain the incoming chunk piece by piece,
reduce or copy each piece with the device, and let the transport finish the step. The schedule says
which chunk moves; the transport says how bytes travel; the device says how they are combined.

Two buffers take part: ``src`` holds this rank's contribution and ``work`` receives the result
(they may be the same array). A chunk is read from ``work`` once this rank has written it in this
collective, from ``src`` before that, so an out-of-place collective needs no initial copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np

from .ops import AVG, SUM, ReduceOp
from .schedule import Bounds, Step, fold_order
from .tags import PLAN, PLAN_CALLS
from .transports.base import abandon


class Context:
    """What one collective call's transports need to know: names for errors, dtype, op, device,
    and the call's identity: its root and number (set by the Communicator when the call starts)
    and the base MPI tag of its messages (:meth:`identity`; None for set-up waits)."""

    __slots__ = ("collective", "comm", "device", "dtype", "op", "root", "call", "tag", "expect", "acc", "wide")

    def __init__(self, collective: str, comm: Any, device: Any, dtype: np.dtype, op: ReduceOp | None) -> None:
        self.collective = collective
        self.comm = comm  # the ringcomm Communicator: rank, size, left, right, mpi, timeout
        self.device = device  # reduces and copies (ringcomm.devices)
        self.dtype = dtype
        self.op = op
        self.root = -1
        self.call = 0
        self.tag: int | None = None
        #: the tags this call's messages may carry (set by the transport; empty: set-up waits, unchecked)
        self.expect: tuple[int, ...] = ()
        #: accumulate="float32" on a half type: a float32 array as long as the buffer, where the
        #: partial sums of the reduce-scatter phase live and travel (None otherwise)
        self.acc: Any = None
        self.wide = False  # accumulate="float32" on a half type (part of the call's identity)

    def identity(self) -> int:
        """The base MPI tag of this call's messages (ringcomm.tags), made on first use."""
        if self.tag is None:
            self.tag = self.comm._layout.base(self.collective, self.dtype, self.op, self.root, self.call, self.wide)
        return self.tag


#: which of a call's buffers a step reads (engine.bind)
SRC, WORK, ACC = 0, 1, 2


def bind(steps: Sequence[Step], nchunks: int, in_place: bool, wide: bool) -> tuple[tuple, tuple[bool, ...]]:
    """Where each step's data comes from, worked out once per schedule (no arrays involved).

    Returns ``(bound, written)``: per step ``(send_from, widen_from, local_from)`` -- the buffer the
    outgoing chunk is read from (SRC, WORK or ACC; None: nothing sent), the buffer this rank's own
    data is first widened from into ACC before it is sent (``wide``, accumulate="float32"; None
    otherwise), and the buffer a reduce step combines with the incoming chunk (SRC or WORK) -- and
    per chunk whether some step wrote it into ``work`` (the others come from ``src`` at the end).

    A chunk is read from work once this rank has written it in this call (from the start when
    ``in_place``: work is src), from src before that. With ``wide`` a chunk that is not final lives
    in ACC as a float32 partial sum once a reduce step wrote it there, and travels from ACC.
    Cached per step list (the schedule's are cached tuples: looked up by identity, not hashed).
    """
    key = (id(steps), nchunks, in_place, wide)
    hit = _bound.get(key)
    if hit is not None and hit[0] is steps:
        return hit[1]
    if len(_bound) >= BIND_LIMIT:
        _bound.clear()
    result = _bind(steps, nchunks, in_place, wide)
    _bound[key] = (steps, result)
    return result


#: bind()'s cache: (id(steps), nchunks, in_place, wide) -> (steps, result); the steps are kept so
#: that their id stays theirs
_bound: dict[tuple, tuple] = {}
BIND_LIMIT = 1024


def _bind(steps: Sequence[Step], nchunks: int, in_place: bool, wide: bool) -> tuple[tuple, tuple[bool, ...]]:
    written = [in_place] * nchunks
    partial = [False] * nchunks  # wide: the chunk's value is a float32 partial in ACC
    final = [False] * nchunks  # wide: the chunk holds the call's result in work
    bound = []
    for st in steps:
        send_from = widen_from = local_from = None
        if st.send is not None:
            c = st.send
            send_from = WORK if written[c] else SRC
            if wide and not final[c]:
                widen_from = None if partial[c] else send_from  # this rank's own data travels in float32
                send_from = ACC
        if st.recv is not None:
            c = st.recv
            local_from = WORK if written[c] else SRC
            if not wide or not st.reduce or st.final:
                written[c] = final[c] = True
            else:
                partial[c] = True
        bound.append((send_from, widen_from, local_from))
    return tuple(bound), tuple(written)


def execute(
    ctx: Context,
    steps: Sequence[Step],
    bounds: Bounds,
    work: Any,
    src: Any,
    link: Any,
    result_chunks: Iterable[int] = (),
) -> int:
    """Run ``steps`` for this rank; return the number of payload bytes this rank sent.

    ``link``: this rank's receiving half (``link.recv``, the edge from the left) and sending half
    (``link.send``, the edge to the right); ringcomm.transports. ``bounds``: the chunks by ring
    place. ``result_chunks``: chunks that must end in ``work``; any of them that no step wrote is
    copied from ``src`` (the rank's own chunk of an all-gather, or everything when N == 1).

    With ``ctx.acc`` (accumulate="float32" on a half type) a chunk that is not final travels in
    float32: this rank's own data is widened into ``acc`` when first sent, a reduce step that is
    not final adds the local half data to the float32 partial into ``acc`` (``reduce_acc``), and
    the final one rounds once into ``work`` (``reduce_acc_final``, the AVG division in float32).
    Final chunks (the all-gather phase) travel in the array's dtype.
    """
    op, device, acc = ctx.op or SUM, ctx.device, ctx.acc
    receiver, sender = link.recv, link.send
    n = ctx.comm.size
    bound, written = bind(steps, len(bounds), work is src, acc is not None)
    bufs = (src, work, acc)
    private = receiver.private  # its incoming pieces are its own scratch (the device may overwrite them)
    sent = 0
    try:
        sender.begin(ctx, work, src, bounds)
        receiver.begin(ctx, work, src, bounds)
        for st, (send_from, widen_from, local_from) in zip(steps, bound):
            send = None
            if send_from is not None:
                lo, hi = bounds[st.send]
                if widen_from is not None:
                    device.widen(acc[lo:hi], bufs[widen_from][lo:hi])
                send = bufs[send_from][lo:hi]
                sent += send.nbytes
            if st.recv is None:
                sender.post(st, send, False)
            else:
                lo, hi = bounds[st.recv]
                dst = work[lo:hi]
                wire = acc.dtype if acc is not None and st.reduce else ctx.dtype
                receiver.post(st, hi - lo, None if st.reduce else dst, wire)
                sender.post(st, send, True)
                if st.reduce:
                    local = bufs[local_from][lo:hi]
                    div = n if st.final and op is AVG else 1
                    if acc is None:
                        spare = private and local_from == WORK  # in place: the result may go through it
                        for a, b, incoming in receiver.recv(st, sender):
                            device.reduce(dst[a:b], local[a:b], incoming, op, div, spare)
                    elif st.final:
                        for a, b, incoming in receiver.recv(st, sender):
                            device.reduce_acc_final(dst[a:b], local[a:b], incoming, op, div)
                    else:
                        for a, b, incoming in receiver.recv(st, sender):
                            device.reduce_acc(acc[lo + a : lo + b], local[a:b], incoming, op)
                else:
                    for a, b, incoming in receiver.recv(st, sender):
                        if incoming is not None:
                            device.copy(dst[a:b], incoming)
                receiver.step_done(st)
            sender.step_done(st)
        sender.end()
        receiver.end()
    except BaseException:
        sender.abort()
        receiver.abort()
        raise
    for c in result_chunks:
        if not written[c]:
            lo, hi = bounds[c]
            device.copy(work[lo:hi], src[lo:hi])
    return sent


class _Prepared:
    """What Plan and DirectPlan share: their transport's persistent requests, prepared per call
    number modulo PLAN_CALLS, op and accumulation (a request's tag is fixed), and what happens to
    them after an error."""

    #: bound to its buffers' addresses (a later call runs it only on arrays that lie there)
    by_address = True

    def __init__(self) -> None:
        self._prepared: tuple[dict, ...] = tuple({} for _ in range(PLAN_CALLS))
        self._dead = False

    def _get(self, ctx: Context) -> Any:
        return self._prepared[ctx.call % PLAN_CALLS].get((ctx.op, ctx.wide))

    def _put(self, ctx: Context, prepared: Any) -> Any:
        self._prepared[ctx.call % PLAN_CALLS][ctx.op, ctx.wide] = prepared
        return prepared

    @staticmethod
    def _tag(ctx: Context) -> int:
        return (
            ctx.comm._layout.base(ctx.collective, ctx.dtype, ctx.op, ctx.root, ctx.call % PLAN_CALLS, ctx.wide) | PLAN
        )

    def _failed(self, work: Any, src: Any) -> None:
        """After an error in a run: requests may still be active (a send a late peer may match,
        a receive that would not cancel), and they point at this plan's scratch and at the call's
        arrays by address. Plan and arrays are kept for the life of the process (base.abandon)
        and the requests never freed; the communicator is aborted anyway."""
        abandon(None, self, work, src)
        self._dead = True

    def free(self) -> None:
        """Release what the transport prepared (the plan is not run again)."""
        if self._dead:
            return
        for by_op in self._prepared:
            for prepared in by_op.values():
                for p in prepared:
                    p.free()
            by_op.clear()


class Plan(_Prepared):
    """A schedule bound once to the places of its buffers, run many times.

    Made for one call's steps, chunk bounds and roles of its buffers (``work`` and ``src``, the
    same array or not: :func:`bind`). When the link can prepare every step (``link.prepare``: MPI
    halves on host memory make persistent requests, MPI_Send_init/Recv_init), a run restarts them:
    no request, view, slice list or Status is made per call, and a reduce step's incoming chunk
    lands in the plan's own ``scratch``. Otherwise a run is the engine's loop, :func:`execute`.

    The requests are bound to memory by address (transports.mpi.by_address), not to the arrays
    of the call that made them: the Communicator looks plans up by the buffers' addresses (and the
    collective, root, dtype and bounds), so a later call on any array at those addresses runs the
    same plan, and a cached plan keeps no array alive. Each run slices the call's own arrays.

    A persistent request's tag is fixed, so the steps are prepared once per op, accumulation and
    call number modulo ``tags.PLAN_CALLS``: each run's messages still name the collective, dtype,
    op, root and, modulo 4, the call (ringcomm.tags), so a rank that skipped a call cannot match
    its neighbours' messages. ``nbytes``: the memory the plan owns (its scratch).
    """

    def __init__(
        self,
        ctx: Context,
        steps: Sequence[Step],
        bounds: Bounds,
        work: Any,
        src: Any,
        link: Any,
        result_chunks: Iterable[int] = (),
    ) -> None:
        self.steps, self.bounds, self.link, self.result_chunks = steps, bounds, link, tuple(result_chunks)
        bound, written = bind(steps, len(bounds), work is src, False)
        self._bound = bound
        itemsize = ctx.dtype.itemsize
        self.sent = sent_bytes(steps, bounds, itemsize)
        #: per step: the slice of its incoming chunk, the buffer it reduces with (None: a copy step)
        self._actions = tuple(
            (
                None if st.recv is None else slice(*bounds[st.recv]),
                local_from if st.reduce and st.recv is not None else None,
            )
            for st, (_, _, local_from) in zip(steps, bound)
        )
        self._copies = tuple(slice(*bounds[c]) for c in self.result_chunks if not written[c])
        chunk = max(
            (bounds[st.recv][1] - bounds[st.recv][0] for st in steps if st.reduce and st.recv is not None), default=0
        )
        self._scratch = ctx.device.empty(chunk, ctx.dtype)
        self.nbytes = chunk * itemsize
        self._preparable = True  # until the link cannot prepare a step
        super().__init__()

    def run(self, ctx: Context, work: Any, src: Any) -> int:
        """Run the steps on this call's ``work`` and ``src`` (at the addresses the plan was made
        for); return the payload bytes this rank sent."""
        prepared = self._get(ctx) if self._preparable else None
        if prepared is None:
            prepared = self._make(ctx, work, src) if self._preparable else None
            if prepared is None:  # this link cannot prepare these buffers: the engine's loop
                return execute(ctx, self.steps, self.bounds, work, src, self.link, self.result_chunks)
        op, device, n, scratch = ctx.op or SUM, ctx.device, ctx.comm.size, self._scratch
        bufs = (src, work)
        try:
            for st, step, (into, local_from) in zip(self.steps, prepared, self._actions):
                step.run(ctx, st)  # a copy step has received in place
                if local_from is not None:
                    dst = work[into]
                    div = n if st.final and op is AVG else 1
                    # in place (local_from == WORK): the result may go through the scratch
                    device.reduce(dst, bufs[local_from][into], scratch[: dst.size], op, div, local_from == WORK)
        except BaseException:
            self._failed(work, src)
            raise
        for c in self._copies:
            device.copy(work[c], src[c])
        return self.sent

    def _make(self, ctx: Context, work: Any, src: Any) -> list | None:
        bufs, tag, prepared = (src, work), self._tag(ctx), []
        for st, (send_from, _, _) in zip(self.steps, self._bound):
            send = None if send_from is None else bufs[send_from][slice(*self.bounds[st.send])]
            into = None
            if st.recv is not None:
                lo, hi = self.bounds[st.recv]
                into = self._scratch[: hi - lo] if st.reduce else work[lo:hi]  # reduce: into the scratch
            step = self.link.prepare(ctx, send, into, tag)
            if step is None:
                for p in prepared:
                    p.free()
                self._preparable = False
                return None
            prepared.append(step)
        return self._put(ctx, prepared)

    def free(self) -> None:
        super().free()
        self._preparable = False


class DirectPlan(_Prepared):
    """An all-reduce in two rounds of direct messages, on the host, bound once to its buffers (a
    reduce-scatter: round 1 alone, ``ctx.collective``).

    Round 1 (the reduce-scatter): every rank sends its copy of chunk q to the rank at ring place
    q and receives its own chunk p from every other rank; it folds them in
    :func:`ringcomm.schedule.fold_order` (the order in which the ring's reduce-scatter combines
    chunk p, this rank's own data last), so the result is bitwise the ring's. Round 2 (the
    all-gather): it sends its reduced chunk to every rank and receives theirs into ``work``.
    The bytes each rank sends are the ring's, 2(N-1)/N of the buffer, but in 2 rounds of N-1
    concurrent messages (MPI moves them with no Python in between) instead of 2(N-1) dependent
    steps: when ranks share cores, a ring step waits for a neighbour that may not be running.

    Messages go between any two ranks, so this is for links whose every edge is MPI between host
    buffers (``link.exchange``: persistent requests by address, as a :class:`Plan`'s, with the
    plan tag of the call number modulo PLAN_CALLS), on one node (across nodes the ring's edges
    are what leaves a node). The Communicator looks it up like a Plan (by addresses).
    """

    def __init__(self, ctx: Context, bounds: Bounds, work: Any, src: Any, link: Any) -> None:
        comm = link.comm
        n, p = comm.size, comm.position
        self.comm, self.link, self.bounds, self.n, self.p = comm, link, bounds, n, p
        self.in_place, self.gathers = work is src, ctx.collective == "all_reduce"
        lo, hi = bounds[p]
        self._mine = slice(lo, hi)
        self._incoming = ctx.device.empty((n - 1) * (hi - lo), ctx.dtype).reshape(n - 1, hi - lo)
        #: the places to fold, in order (the first incoming piece accumulates), then this rank's own data
        order = fold_order(n, p)
        slot = {q: k for k, q in enumerate(qq for qq in range(n) if qq != p)}
        self._order = [slot[q] for q in order[:-1]]
        self.nbytes = self._incoming.nbytes
        self.sent = _direct_sent(bounds, p, n, ctx.dtype.itemsize, self.gathers)
        super().__init__()

    def run(self, ctx: Context, work: Any, src: Any) -> int:
        rounds = self._get(ctx) or self._make(ctx, work, src)  # (scatter, and for an all-reduce gather)
        op, device = ctx.op or SUM, ctx.device
        inc, order, mine = self._incoming, self._order, self._mine
        try:
            rounds[0].run(ctx, 0, "this rank's chunk")
            part = inc[order[0]]
            for k in order[1:]:
                device.reduce(part, inc[k], part, op)
            device.reduce(work[mine], src[mine], part, op, self.n if op is AVG else 1, self.in_place)
            if self.gathers:
                rounds[1].run(ctx, 1, "a reduced chunk")
        except BaseException:
            self._failed(work, src)
            raise
        return self.sent

    def _make(self, ctx: Context, work: Any, src: Any) -> tuple:
        comm, p, bounds, tag = self.comm, self.p, self.bounds, self._tag(ctx)
        others = [(q, comm.ring[q]) for q in range(self.n) if q != p]
        inc = self._incoming
        rounds = [
            self.link.exchange(
                ctx,
                [(rank, inc[k]) for k, (_, rank) in enumerate(others)],
                [(rank, src[slice(*bounds[q])]) for q, rank in others],
                tag,
            )
        ]
        if self.gathers:
            rounds.append(
                self.link.exchange(
                    ctx,
                    [(rank, work[slice(*bounds[q])]) for q, rank in others],
                    [(rank, work[self._mine]) for _, rank in others],
                    tag,
                )
            )
        return self._put(ctx, rounds)


def sent_bytes(steps: Sequence[Step], bounds: Bounds, itemsize: int) -> int:
    """The payload bytes ``steps`` send (a rank's steps of a schedule, chunks ``bounds``)."""
    return sum(bounds[st.send][1] - bounds[st.send][0] for st in steps if st.send is not None) * itemsize


def _direct_sent(bounds: Bounds, p: int, n: int, itemsize: int, gathers: bool) -> int:
    """The payload bytes a direct all-reduce (or the ring) sends from place ``p``: every other
    chunk once (reduce-scatter), and with ``gathers`` its own reduced chunk N-1 times (all-gather)."""
    lo, hi = bounds[p]
    return (sum(b - a for q, (a, b) in enumerate(bounds) if q != p) + gathers * (n - 1) * (hi - lo)) * itemsize


class SharedDirectPlan:
    """An all-reduce in two publications per piece through shared memory (host, every rank on one
    node; transports.shm.SharedDirect, which cuts the chunks into pieces that fit an inbox: one
    when the buffer does), bitwise the ring's result.

    For each piece, each rank copies its runs of every chunk but its own into its inbox and
    publishes; it folds its own chunk p's run, the other inboxes' copies of it and its own data
    last, in :func:`ringcomm.schedule.fold_order` (the ring's order), into ``work``, copies the
    result over that run in every other inbox and publishes again; then it copies the other
    chunks' runs into ``work`` from its own inbox. Each rank reduces 1/N of the buffer, as in the
    ring, with two waits per piece instead of 2(N-1) dependent steps, no message, and nothing of
    the call's arrays visible to the other ranks (in place costs as much as out of place). Bound
    to the window, not to any array, so it is looked up by collective, dtype and bounds alone; it
    owns no memory (``nbytes`` 0).

    Why the results go back into the inboxes (README, "Where this host's swings come from"): a rank
    then rewrites, at its next piece or call, only lines that another core wrote with a copy and
    that it read itself since; rewriting lines that another core has only read (an outbox the
    others copied out, an inbox the others folded from) costs up to 15x more on a host whose two
    cores sit far apart (the bench, N = 2, 1 MiB on 2 cores far apart: 82-90 us per call against
    387-500 with an outbox each rank folded into and the others copied out of).
    """

    nbytes, by_address = 0, False
    algorithm = "direct (shared memory)"

    def __init__(self, ctx: Context, bounds: Bounds, shared: Any) -> None:
        comm = ctx.comm
        n, p, ring = comm.size, comm.position, comm.ring
        self.shared, self.n, self.steps = shared, n, 2 * len(shared.runs)
        order = fold_order(n, p)[:-1]
        #: by piece: (its run of this rank's chunk p in the buffer, the other ranks' copies of it in
        #: fold order (this rank's own, last, is read from src; the first also holds the partial fold of
        #: the others' when there are more than one), and what this rank publishes: its runs of every
        #: chunk but its own, by where they lie in the buffer and in its inbox, and at the end reads back)
        self._pieces = []
        for runs in shared.runs:
            a, b, at = runs[p]
            others = [shared.inboxes[ring[q]][at : at + b - a] for q in order] if b > a else []
            ins = [
                (slice(lo, hi), shared.mine[where : where + hi - lo])
                for q, (lo, hi, where) in enumerate(runs)
                if q != p and hi > lo
            ]
            self._pieces.append((slice(a, b), others, ins))  # (its own run: used only when it is not empty)
        self.sent = _direct_sent(bounds, p, n, ctx.dtype.itemsize, True)

    def run(self, ctx: Context, work: Any, src: Any) -> int:
        device, op, shared = ctx.device, ctx.op, self.shared
        div = self.n if op is AVG else 1
        for k, (mine, others, ins) in enumerate(self._pieces):
            for at, box in ins:
                device.copy(box, src[at])
            shared.inputs(ctx, k)
            if others:
                first, size = others[0], others[0].size
                if len(others) > 1:  # the others' copies folded into the first (work may be src: read last)
                    device.fold(first, [(0, size, others)], op)
                device.fold(work[mine], [(0, size, [first, src[mine]])], op, div)
                for box in others:
                    device.copy(box, work[mine])
            shared.outputs(ctx, k)
            for at, box in ins:
                device.copy(work[at], box)
        return self.sent

    def free(self) -> None:
        """Nothing of its own: the window is the Communicator's."""


class SharedPlacesPlan:
    """A broadcast, all-gather, reduce-scatter or reduce through shared memory (host, every rank on
    one node; transports.shm.SharedPlaces). Every rank copies its part of ``src`` into its place
    in the window (a broadcast: the root its buffer; an all-gather: its shard; a reduce-scatter:
    every chunk but its own; a reduce: every rank but the root its buffer) and publishes; then it
    copies what ``work`` needs out of the others' places (the root's buffer; the other shards) or
    folds its own chunk from them (a reduce-scatter: in :func:`ringcomm.schedule.fold_order`, the
    ring's order, its own data last: bitwise the ring's result; its ``work`` is this rank's shard,
    the call's result, not a buffer of the whole count; a reduce: the root folds the whole buffers
    in the chain's order, its own last, bitwise the chain's result, and the others' ``work`` is
    unused), and, when the places are inboxes, publishes that it is done. One
    or two waits instead of the ring's N - 1 dependent steps (the chain's N + pieces - 2), no
    message, and nothing of the call's arrays visible to the other ranks (in place costs as much
    as out of place). Bound to the window, not to any array (looked up by collective, root, dtype
    and bounds); owns no memory (``nbytes`` 0). ``sent``: the bytes the ring (or chain) would
    send from this rank, :func:`sent_bytes`."""

    nbytes, by_address = 0, False
    #: (what a rank publishes first, what second), for errors, by collective
    _WHAT = {
        "broadcast": ("part of the broadcast", "copy of the broadcast"),
        "all_gather": ("shard", "copy of the shards"),
        "reduce_scatter": ("whole buffer", "fold of its chunk"),
        "reduce": ("whole buffer", "fold of the buffers"),
    }

    def __init__(self, ctx: Context, bounds: Bounds, shared: Any, root: int, sent: int) -> None:
        comm = ctx.comm
        n, p, ring, me = comm.size, comm.position, comm.ring, comm.rank
        self.shared, self.sent, self.n = shared, sent, n
        self.steps = 2 if shared.twice else 1  # (the waits, for the DEBUG log)
        self._what = self._WHAT[ctx.collective]
        chunks = [(q, slice(lo, hi)) for q, (lo, hi) in enumerate(bounds) if hi > lo]
        whole = slice(0, bounds[-1][1])  # (a broadcast's or reduce's bounds: the chain's pieces of the buffer)
        # what this rank folds: its chunk (a reduce's root: the whole buffer)
        mine = whole if ctx.collective in ("broadcast", "reduce") else slice(*bounds[p])
        folding = ctx.collective == "reduce_scatter" or ctx.collective == "reduce" and me == root
        if ctx.collective == "broadcast":
            writes, reads = ([(whole, me)], []) if me == root else ([], [(whole, root)])
        elif ctx.collective == "reduce":
            writes, reads = [] if me == root else [(whole, me)], []
        elif ctx.collective == "all_gather":  # (a place holds one shard, from its start)
            writes = [(at, me) for q, at in chunks if q == p]
            reads = [(at, ring[q]) for q, at in chunks if q != p]
        else:
            writes, reads = [(at, me) for q, at in chunks if q != p], []
        # the ranks whose copies of what this rank folds fold before its own, in the ring's (chain's) order
        folds = [ring[q] for q in fold_order(n, p)[:-1]] if folding and mine.stop > mine.start else None
        self.algorithm = (
            "fold (shared memory)" if ctx.collective in ("reduce_scatter", "reduce") else "copy (shared memory)"
        )
        shard = ctx.collective == "all_gather"

        def where(places: Any, at: slice, r: int) -> Any:  # where chunk ``at`` of rank r's part lies in its place
            return places[r][: at.stop - at.start] if shard else places[r][at]

        #: by side of the window: (copies in, copies out, None or the others' copies of this rank's chunk)
        self._sides = [
            (
                [(at, where(places, at, r)) for at, r in writes],
                [(at, where(places, at, r)) for at, r in reads],
                None if folds is None else [places[r][mine] for r in folds],
            )
            for places in shared.sides
        ]
        self._mine = mine

    def run(self, ctx: Context, work: Any, src: Any) -> int:
        shared, device = self.shared, ctx.device
        writes, reads, fold = self._sides[shared.window.side]  # (this call's: taken before the publication)
        for at, place in writes:
            device.copy(place, src[at])
        shared.inputs(ctx, self._what[0])
        for at, place in reads:
            device.copy(work[at], place)
        if fold is not None:  # (a reduce-scatter's work: this rank's shard; a reduce's: the root's result)
            op = ctx.op
            device.fold(work, [(None, None, fold + [src[self._mine]])], op, self.n if op is AVG else 1)
        shared.outputs(ctx, self._what[1])
        return self.sent

    def free(self) -> None:
        """Nothing of its own: the window is the Communicator's."""


class GatherFold:
    """A small all-reduce of ``count`` elements: every rank's whole buffer gathered, then folded
    locally in the ring's order (:class:`Fold`), bitwise the ring's result, in N-1 steps' worth of
    data movement and one wait instead of 2(N-1) dependent steps.

    ``gather``: what moves the blocks, ``gather.run(ctx)`` -> the bytes a ring would send:
    transports.mpi.GatheredBlocks (a persistent MPI_Allgather of host arrays); :class:`SharedGatherFold`
    for the host's shared-memory window (transports.shm.SharedBlocks, which the caller publishes:
    ``publication(ctx)()``). ``sides``: per slot of the gather (one here), ``(mine, blocks by ring
    place)``: where this rank copies its buffer, and where the N blocks then lie. ``algorithm``
    and ``link`` (the host's transports.Link): what the DEBUG log names.
    """

    def __init__(
        self,
        gather: Any,
        sides: Sequence[tuple[Any, Sequence[Any]]],
        bounds: Bounds,
        n: int,
        algorithm: str,
        link: Any,
    ) -> None:
        self.gather, self.algorithm, self.link = gather, algorithm, link
        self._sides = [(mine, Fold(by_place, bounds, n)) for mine, by_place in sides]
        self._n = n
        #: all_reduce's fast lane on the host (collectives._small_host): by op, ``(ctx, run)``
        #: (:meth:`lane`)
        self.lanes: dict = {}

    def lane(self, comm: Any, op: ReduceOp) -> tuple[Context, Any]:
        """The fast lane of host all-reduces with ``op`` (collectives._small_host), made once:
        ``(ctx, run)``, a Context that every call reuses (a call sets its number and clears its
        tag) and :meth:`bound` to it."""
        ctx = Context("all_reduce", comm, comm._host, self._sides[0][0].dtype, op)
        lane = self.lanes[op] = ctx, self.bound(ctx)
        return lane

    def bound(self, ctx: Context) -> Any:
        """``run(work, src)``: :meth:`run` with ``ctx`` (and no float32 accumulation)."""
        return partial(self.run, ctx)

    def run(self, ctx: Context, work: Any, src: Any, acc: Any = None) -> int:
        """All-reduce ``src`` into ``work`` (``acc``: as for :meth:`Fold.accumulate`); the bytes a ring would send."""
        mine, fold = self._sides[0]
        ctx.device.copy(mine, src)
        sent = self.gather.run(ctx)
        self._fold(ctx, fold, work, acc)
        return sent

    def _fold(self, ctx: Context, fold: Fold, work: Any, acc: Any) -> None:
        if acc is None:  # local data first, the partial result second, as a ring step
            ctx.device.fold(work, fold.pieces, ctx.op, self._n if ctx.op is AVG else 1)
        else:
            fold.accumulate(ctx, work, acc)

    def free(self) -> None:
        self.gather.free()


class SharedGatherFold(GatherFold):
    """A :class:`GatherFold` of host arrays in the shared-memory window (transports.shm.SharedBlocks):
    two sides, the slots that alternate with the publications (``gather.window.side``: the next one);
    nothing to order between calls. The same steps as GatherFold.run, with nothing in between;
    the fast lane's are bound once to its Context (:meth:`bound`), since a small all-reduce's cost
    is its few Python calls (measured at N = 2, 8 B: 0.25 us of 2.8 less than :meth:`run`)."""

    def run(self, ctx: Context, work: Any, src: Any, acc: Any = None) -> int:
        gather = self.gather
        mine, fold = self._sides[gather.window.side]
        mine[...] = src
        gather.publication(ctx)()
        self._fold(ctx, fold, work, acc)
        return gather.sent

    def bound(self, ctx: Context) -> Any:
        """:meth:`run`'s steps with everything they look up found once (the fast lane's; no
        float32 accumulation there)."""
        gather, device, op = self.gather, ctx.device, ctx.op
        window, sent, publish = gather.window, gather.sent, gather.publication(ctx)
        div = self._n if op is AVG else 1
        sides = [(mine, device.folder(fold.pieces, op, div)) for mine, fold in self._sides]

        def run(work: Any, src: Any) -> int:
            mine, fold = sides[window.side]
            mine[...] = src
            publish()
            fold(out=work)
            return sent

        return run


class Fold:
    """Reduce N gathered blocks (``blocks[p]``: the whole buffer of the rank at ring place p) into
    a result, chunk by chunk: ``pieces``, (lo, hi, the chunk's views of the blocks in their order).

    Each chunk c of ``bounds`` is combined in :func:`ringcomm.schedule.fold_order` (the order in
    which reduce-scatter combines it), so the result is bitwise the ring schedule's, on every rank.
    The views into the blocks are made once; a call only reduces.
    """

    def __init__(self, blocks: Sequence[Any], bounds: Bounds, n: int) -> None:
        self.n = n
        self.pieces = [
            (lo, hi, [blocks[j][lo:hi] for j in fold_order(n, c)]) for c, (lo, hi) in enumerate(bounds) if hi > lo
        ]
        if len(self.pieces) == 1 and self.pieces[0][:2] == (0, sum(hi - lo for lo, hi in bounds)):
            # one chunk holds every element (counts below 16 elements per rank): (None, None), so
            # that work[lo:hi] is work whole, and the host fold writes into work without a view
            self.pieces = [(None, None, self.pieces[0][2])]

    def accumulate(self, ctx: Context, work: Any, acc: Any) -> None:
        """Write the reduction into ``work`` (count elements), on ``ctx.device`` with ``ctx.op``,
        adding in float32 (accumulate="float32" on a half type): ``acc``, a float32 array of count
        elements, keeps the partial sums, rounded once at the end, exactly as the ring does with
        ``ctx.acc``. (Without it the device folds the pieces itself: ``device.fold``.)
        """
        op, device = ctx.op, ctx.device
        last, last_div = self.n - 1, self.n if op is AVG else 1
        for lo, hi, views in self.pieces:
            dst = work[lo:hi]
            part = acc[lo:hi]
            device.widen(part, views[0])
            for k in range(1, last):
                device.reduce_acc(part, views[k], part, op)
            device.reduce_acc_final(dst, views[last], part, op, last_div)
