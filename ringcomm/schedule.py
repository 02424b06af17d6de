"""The ring schedule: pure data, no MPI and no arrays.

A buffer of ``count`` elements is cut into chunks (:func:`partition`). Each collective is a list of
:class:`Step` per rank: which chunk the rank sends to its right neighbour, which chunk it receives
from its left neighbour, and whether the incoming chunk is reduced into the local one or copied.
The engine executes these lists; a transport never decides which chunk moves.

Steps are by ring place: the rank at place r sends to place (r + 1) % N and receives from place
(r - 1) % N. Places follow the topology (:func:`ring_order`: each node's ranks adjacent), and the
collectives give chunk p the shard of the rank at place p (:func:`in_ring_order`), so results keep
MPI rank order. With one node, place and MPI rank are the same.

- reduce-scatter (N-1 steps): at step s rank r sends chunk (r - s - 1) % N and reduces the chunk
  (r - s - 2) % N that arrives from the left. After the last step rank r holds chunk r fully reduced.
- all-gather (N-1 steps): at step s rank r sends chunk (r - s) % N and copies in chunk (r - s - 1) % N.
- all-reduce = reduce-scatter then all-gather: 2(N-1) steps, each rank sends 2(N-1)/N of the buffer.
- broadcast: a pipelined chain root -> root+1 -> ... -> root-1 over ``nchunks`` pieces; the rank at
  distance d >= 1 from the root copies in piece t-d+1 at step t and forwards piece t-d.
- reduce: the same chain in reverse role, ending at the root: root+1 sends its own pieces, every
  later rank reduces what arrives with its own data and forwards the partial result.

Run ``python -m ringcomm.schedule --ranks 5 --collective all_reduce`` to print a schedule, and
``python -m ringcomm.schedule --nodes a,b,a,b`` to print the ring of a node layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence

import numpy as np

from .ops import UFUNCS, ReduceOp

#: Chunk boundaries fall on multiples of this many elements (16 elements is 16-byte aligned for every
#: dtype, so GPU kernels can use vector loads on every chunk of an aligned buffer).
ALIGN = 16

Bounds = tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=256)
def partition(count: int, parts: int, align: int = ALIGN) -> Bounds:
    """Cut ``count`` elements into ``parts`` contiguous (start, stop) ranges.

    The buffer is seen as ceil(count / align) units of ``align`` elements; units are dealt out as
    evenly as possible, the first ranges getting one more unit, and the last nonempty range ends at
    ``count``. Every boundary except ``count`` is a multiple of ``align``. Ranges may be empty
    (when count < parts * align); sizes differ by less than 2 * ``align`` elements.
    """
    if count < 0 or parts < 1 or align < 1:
        raise ValueError(f"partition needs count >= 0, parts >= 1, align >= 1; got {count}, {parts}, {align}")
    units = -(-count // align)
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = min(count, start + (base + (i < extra)) * align)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of one rank.

    ``send``: chunk sent to the right neighbour (None: nothing). ``recv``: chunk arriving from the
    left neighbour (None: nothing). ``reduce``: combine the incoming chunk with the local one (True)
    or copy it in (False). ``final``: this is the last reduction of that chunk (AVG divides here).
    """

    index: int
    phase: str
    send: int | None
    recv: int | None
    reduce: bool = False
    final: bool = False


@functools.lru_cache(maxsize=256)
def reduce_scatter(n: int, rank: int) -> tuple[Step, ...]:
    """Steps of rank ``rank`` in an N-rank ring reduce-scatter; chunk r ends fully reduced on rank r."""
    _check(n, rank)
    return tuple(
        Step(s, "reduce-scatter", (rank - s - 1) % n, (rank - s - 2) % n, reduce=True, final=s == n - 2)
        for s in range(n - 1)
    )


@functools.lru_cache(maxsize=256)
def all_gather(n: int, rank: int, first: int = 0) -> tuple[Step, ...]:
    """Steps of an N-rank ring all-gather where rank r starts with chunk r (indices from ``first``)."""
    _check(n, rank)
    return tuple(Step(first + s, "all-gather", (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1))


@functools.lru_cache(maxsize=256)
def all_reduce(n: int, rank: int) -> tuple[Step, ...]:
    """Reduce-scatter then all-gather: 2(N-1) steps."""
    return reduce_scatter(n, rank) + all_gather(n, rank, first=n - 1)


@functools.lru_cache(maxsize=256)
def broadcast(n: int, rank: int, root: int, nchunks: int) -> tuple[Step, ...]:
    """Pipelined chain from ``root`` over ``nchunks`` pieces: N + nchunks - 2 steps (0 when N == 1)."""
    _check(n, rank, root)
    d = (rank - root) % n  # distance from the root along the ring
    steps = []
    for t in range(n + nchunks - 2 if n > 1 else 0):
        recv = t - d + 1 if d >= 1 and 0 <= t - d + 1 < nchunks else None
        send = t - d if d <= n - 2 and 0 <= t - d < nchunks else None
        steps.append(Step(t, "broadcast", send, recv))
    return tuple(steps)


@functools.lru_cache(maxsize=256)
def reduce(n: int, rank: int, root: int, nchunks: int) -> tuple[Step, ...]:
    """Pipelined chain ending at ``root``: root+1 sends, each later rank reduces and forwards."""
    _check(n, rank, root)
    p = (rank - root - 1) % n  # position in the chain: 0 is root+1, N-1 is the root
    steps = []
    for t in range(n + nchunks - 2 if n > 1 else 0):
        recv = t - p + 1 if p >= 1 and 0 <= t - p + 1 < nchunks else None
        send = t - p if p <= n - 2 and 0 <= t - p < nchunks else None
        steps.append(Step(t, "reduce", send, recv, reduce=True, final=p == n - 1))
    return tuple(steps)


@functools.lru_cache(maxsize=256)
def fold_order(n: int, chunk: int) -> tuple[int, ...]:
    """The ranks whose data reduce-scatter combines into ``chunk``, in order: chunk+1 first, chunk last.

    Folding gathered copies in this order gives bitwise the ring's result (see engine.fold).
    """
    return tuple((chunk + k) % n for k in range(1, n + 1))


def ring_order(nodes: Sequence[str]) -> tuple[int, ...]:
    """The ranks in ring order for ``nodes`` (one node label per rank, in MPI rank order).

    Each node's ranks stand together, in MPI rank order, and nodes follow the order of their
    lowest rank, so the ring crosses each node boundary once, whatever the launcher's placement
    (block or round-robin). One node: MPI rank order.
    """
    first: dict[str, int] = {}
    for r, label in enumerate(nodes):
        first.setdefault(label, r)
    return tuple(sorted(range(len(nodes)), key=lambda r: (first[nodes[r]], r)))


def in_ring_order(bounds: Sequence[tuple[int, int]], ring: Sequence[int]) -> Bounds:
    """Per-rank ``bounds`` (MPI rank order) as chunks by ring place: chunk p is rank ring[p]'s."""
    return tuple(bounds[r] for r in ring)


def format_ring(nodes: Sequence[str]) -> str:
    """The ring of a node layout, for people: the order, and which edges leave a node."""
    ring = ring_order(nodes)
    n = len(ring)
    lines = [f"ring for nodes {','.join(nodes)}: " + " -> ".join(str(r) for r in ring) + f" -> ({ring[0]})"]
    for p in range(n):
        a, b = ring[p - 1], ring[p]
        where = f"inside node {nodes[b]}" if nodes[a] == nodes[b] else f"node {nodes[a]} -> node {nodes[b]}"
        lines.append(f"  edge {a} -> {b}: {where}")
    crossings = sum(nodes[ring[p - 1]] != nodes[ring[p]] for p in range(n))
    lines.append(f"{crossings} of {n} edges leave a node")
    return "\n".join(lines)


def chain_chunks(n: int, count: int, itemsize: int, piece_bytes: int) -> int:
    """Number of pipeline pieces for broadcast/reduce: about ``piece_bytes`` each, at least N (at 2 ranks,
    or 1, at least one: a chain of one hop has nothing to overlap, so a buffer up to ``piece_bytes`` is one
    message; measured: a 1 MiB broadcast 69 -> 64 us, MPICH's 52), at most 8N. (Pieces bound the
    scratch of a chain's receiver, and the staged transport's pinned buffers, to one piece.)"""
    want = -(-count * itemsize // max(1, piece_bytes))
    return max(n if n > 2 else 1, min(8 * n, want))


def _check(n: int, rank: int, root: int = 0) -> None:
    if n < 1 or not 0 <= rank < n or not 0 <= root < n:
        raise ValueError(f"need 0 <= rank, root < n with n >= 1; got n={n}, rank={rank}, root={root}")


# --------------------------------------------------------------------------------------------------
# Simulator: runs a schedule for N virtual ranks in one process, on numpy arrays, step by step, with
# every rank's sends of a step taken before any rank writes (what the transports guarantee).


def simulate(
    schedules: Sequence[Sequence[Step]],
    bufs: Sequence[np.ndarray],
    bounds: Bounds,
    op: str = "sum",
) -> list[np.ndarray]:
    """Run per-rank ``schedules`` on copies of ``bufs`` (one 1-D array per rank); return the results.

    The steps are executed in lock step. A rank whose ``recv`` is set must be matched by its left
    neighbour's ``send`` of the same chunk at the same step; a mismatch raises AssertionError.
    """
    n = len(bufs)
    work = [b.copy() for b in bufs]
    nsteps = {len(s) for s in schedules}
    assert len(nsteps) <= 1, "ranks disagree on the number of steps"
    for k in range(nsteps.pop() if nsteps else 0):
        sent = {}
        for r in range(n):
            st = schedules[r][k]
            if st.send is not None:
                lo, hi = bounds[st.send]
                sent[(r + 1) % n] = (st.send, work[r][lo:hi].copy())
        for r in range(n):
            st = schedules[r][k]
            if st.recv is None:
                assert r not in sent, f"step {k}: rank {r} is sent chunk {sent[r][0]} but receives nothing"
                continue
            chunk, data = sent.pop(r, (None, None))
            assert chunk == st.recv, f"step {k}: rank {r} expects chunk {st.recv}, its left sends {chunk}"
            lo, hi = bounds[chunk]
            if st.reduce:
                work[r][lo:hi] = UFUNCS[ReduceOp(op)](work[r][lo:hi], data)
                if st.final and op == "avg":
                    work[r][lo:hi] = work[r][lo:hi] / n
            else:
                work[r][lo:hi] = data
    return work


# --------------------------------------------------------------------------------------------------
# The table a person reads.

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


def steps_for(collective: str, n: int, rank: int, root: int = 0, nchunks: int | None = None) -> tuple[Step, ...]:
    """The steps of ``collective`` for one rank (``nchunks`` for broadcast/reduce, default N)."""
    if collective == "all_reduce":
        return all_reduce(n, rank)
    if collective == "reduce_scatter":
        return reduce_scatter(n, rank)
    if collective == "all_gather":
        return all_gather(n, rank)
    if collective == "broadcast":
        return broadcast(n, rank, root, nchunks or n)
    if collective == "reduce":
        return reduce(n, rank, root, nchunks or n)
    raise ValueError(f"unknown collective {collective!r}; accepted: {', '.join(COLLECTIVES)}")


def format_table(collective: str, n: int, root: int = 0, nchunks: int | None = None) -> str:
    """One row per step, one column per rank: ``s3 r2+`` = sends chunk 3, receives chunk 2 and reduces."""
    per_rank = [steps_for(collective, n, r, root, nchunks) for r in range(n)]
    head = ["step", "phase"] + [f"rank {r}" for r in range(n)]
    rows = []
    for k in range(len(per_rank[0])):
        cells = []
        for r in range(n):
            st = per_rank[r][k]
            send = f"s{st.send}" if st.send is not None else "  "
            recv = f"r{st.recv}{'+' if st.reduce else '='}" if st.recv is not None else ""
            cells.append(f"{send} {recv}".rstrip())
        rows.append([str(k), per_rank[0][k].phase] + cells)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [f"{collective} on a ring of {n} ranks (place r sends to r+1, receives from r-1)"]
    lines.append("sK = sends chunk K right; rK+ = receives chunk K from the left and reduces it in; rK= = copies it in")
    for row in [head] + rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if collective in ("all_reduce", "reduce_scatter"):
        lines.append("after reduce-scatter, rank r holds chunk r fully reduced")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringcomm.schedule", description="Print a ring schedule.")
    ap.add_argument("--ranks", "-n", type=int, default=5, help="number of ranks N (default 5)")
    ap.add_argument("--collective", "-c", default="all_reduce", choices=COLLECTIVES)
    ap.add_argument("--root", type=int, default=0, help="root rank for broadcast/reduce")
    ap.add_argument("--chunks", type=int, default=None, help="pipeline pieces for broadcast/reduce (default N)")
    ap.add_argument("--count", type=int, default=None, help="also print the partition of COUNT elements")
    ap.add_argument(
        "--nodes",
        default=None,
        help="print the ring of a node layout instead: one label per rank, "
        "comma-separated, as RINGCOMM_NODES (e.g. a,b,a,b)",
    )
    a = ap.parse_args(argv)
    if a.nodes is not None:
        labels = [x.strip() for x in a.nodes.split(",")]
        if not all(labels):
            ap.error("--nodes: a node label is empty")
        print(format_ring(labels))
        return 0
    if a.ranks < 1 or not 0 <= a.root < a.ranks:
        ap.error(f"need --ranks >= 1 and 0 <= --root < --ranks; got {a.ranks}, {a.root}")
    print(format_table(a.collective, a.ranks, a.root, a.chunks))
    if a.count is not None:
        print(f"partition of {a.count} elements (boundaries aligned to {ALIGN}):")
        for r, (lo, hi) in enumerate(partition(a.count, a.ranks)):
            print(f"  chunk {r}: [{lo}, {hi})  {hi - lo} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
