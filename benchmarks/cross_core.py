"""What moving cache lines between two ranks' cores costs on this host, now (mpi4py and numpy only).

Run under MPI with 2 ranks, before and after a benchmark whose ratios you want to read::

    mpiexec -n 2 python benchmarks/cross_core.py            # 512 KiB
    mpiexec -n 2 python benchmarks/cross_core.py 1048576

Each rank owns half of an MPI shared-memory window. In every round both ranks write their half
(``write``: lines the other rank read in the previous round, so each store first takes the line
back from the other core's cache, as a rank rewriting an inbox the others only read would),
meet at a barrier, then copy the other rank's half out (``read``: lines the other core has just
written) and meet again. A second loop hands the lines back first: each rank, after its read,
copies the other's half back over itself, and the owner reads its half before it rewrites it
(``handed``: the write of lines another core last wrote with a copy and this one read since, as
the shared-memory all-reduce's inbox is rewritten). It prints the mean µs of each write and read
per rank (300 rounds after 20), then the same two copies on a private array (``alone``: no other
core involved). Each round's reads are checked at their ends, the last round's in every byte.

Why: on a virtual machine these costs change with where the host places the two virtual CPUs:
on 2026-12-05 the same VM measured 32-40 µs for ``write`` and 15-16 for ``read`` at 512 KiB in
some runs and 215-265 and 49-60 in others (``alone`` 12 µs in both), and the bench's in-place
ratios at 1-4 MiB moved with them, while the shared-memory all-reduce rewrote lines the other
rank had only read, twice per call. Since 2026-12-06 it hands them back instead (README, "Where
this host's swings come from").
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

#: rounds per loop, of which the first WARMUP are not timed
ROUNDS, WARMUP = 320, 20


def main() -> int:
    w = MPI.COMM_WORLD
    if w.size != 2:
        print("cross_core.py: run with 2 ranks (mpiexec -n 2)", file=sys.stderr)
        return 2
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 512 << 10
    if nbytes < 1:
        print(f"cross_core.py: need a size of at least 1 byte; got {nbytes}", file=sys.stderr)
        return 2
    node = w.Split_type(MPI.COMM_TYPE_SHARED)
    if node.size != 2:
        print("cross_core.py: the 2 ranks must share a node", file=sys.stderr)
        return 2
    r = node.rank
    win = MPI.Win.Allocate_shared(nbytes, 1, comm=node)
    halves = [np.frombuffer(win.Shared_query(q)[0], np.uint8, nbytes) for q in (0, 1)]
    mine, theirs = halves[r], halves[1 - r]
    #: what rank q writes in rounds of parity k: 2q + k + 1 in every byte
    sources = [np.full(nbytes, 2 * r + k + 1, np.uint8) for k in (0, 1)]
    out, private = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    pc = time.perf_counter
    shared, handed, alone = np.zeros(2), np.zeros(2), np.zeros(2)

    def check(
        it: int, got: np.ndarray, want: int
    ) -> None:  # (a full check every round would evict the lines it measures)
        if got[0] != want or got[-1] != want or (it == ROUNDS - 1 and not (got == want).all()):
            raise SystemExit(f"rank {r}: round {it} read {got[got != want][0]} where {want} was written")

    for back, sums in ((False, shared), (True, handed)):
        for it in range(ROUNDS):
            src = sources[it & 1]
            t0 = pc()
            np.copyto(mine, src)
            t1 = pc()
            node.Barrier()
            t2 = pc()
            np.copyto(out, theirs)
            t3 = pc()
            want = 2 * (1 - r) + (it & 1) + 1
            check(it, out, want)
            if back:  # the other's half back over itself; the owner reads its own before rewriting it
                np.copyto(theirs, out)
                node.Barrier()
                np.copyto(out, mine)
                check(it, out, 2 * r + (it & 1) + 1)
            node.Barrier()
            if it >= WARMUP:
                sums += (t1 - t0, t3 - t2)
    for it in range(ROUNDS):  # the same copies with no other core involved
        src = sources[it & 1]
        t0 = pc()
        np.copyto(private, src)
        t1 = pc()
        np.copyto(out, private)
        t2 = pc()
        if it >= WARMUP:
            alone += (t1 - t0, t2 - t1)
    us = np.concatenate([shared, handed, alone]) / (ROUNDS - WARMUP) * 1e6
    every = node.gather(us, root=0)
    if r == 0:
        print(f"# {nbytes} B, 2 ranks on one node: mean us per copy ({ROUNDS - WARMUP} rounds), results checked")
        print(f"{'rank':>4} {'write':>8} {'read':>8} {'handed':>15} {'alone':>13}")
        for q, (wr, rd, hw, hr, aw, ar) in enumerate(every):
            print(f"{q:>4} {wr:8.1f} {rd:8.1f} {hw:7.1f} {hr:7.1f} {aw:6.1f} {ar:6.1f}")
    win.Free()
    node.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
