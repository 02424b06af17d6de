"""Why an in-place all-reduce at 256 KiB is slower on the host: an mpi4py-only replica at N = 2.

Run under MPI with 2 ranks::

    mpiexec -n 2 python benchmarks/inplace_replica.py            # 256 KiB of float32
    mpiexec -n 2 python benchmarks/inplace_replica.py --reuse    # as a benchmark loop does
    mpiexec -n 2 python benchmarks/inplace_replica.py 1048576

MPICH's own algorithm for this size (recursive halving, a reduction in place, recursive
doubling: two MPI_Sendrecv of half the buffer) is replayed from Python with four ways to reduce:
``direct`` (numpy, ``np.add(tmp, x, out=x)``), ``mpiop`` (MPI's own scalar loop,
``MPI.SUM.Reduce_local``), ``tmp`` (numpy into the receive scratch, then a copy: what ringcomm
does) and ``sendtmp`` (numpy into the scratch, sent from there, copied after). It prints each
variant's µs per call, split into the first exchange, the reduction and the second exchange
(the mean of 300 calls after 20), and ``MPI_Allreduce(MPI_IN_PLACE)`` for comparison. By default
the buffer is rewritten before every call (outside the timing), as a training step's backward
pass does, and every result is checked (the sum of the ranks' inputs); ``--reuse`` reduces the
previous call's result again, as a benchmark loop does (unchecked: the values grow): then every
call writes cache lines the other core read in the previous one (MPICH's single-copy transfers,
CMA, are done by the receiver's core), which is what makes in place slower than out of place.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> int:
    w = MPI.COMM_WORLD
    if w.size != 2:
        print("inplace_replica.py: run with 2 ranks (mpiexec -n 2)", file=sys.stderr)
        return 2
    r, peer = w.rank, 1 - w.rank
    args = [a for a in sys.argv[1:] if a != "--reuse"]
    refill = "--reuse" not in sys.argv[1:]
    nbytes = int(args[0]) if args else 262144
    n = nbytes // 4
    h = n // 2
    keep, other = (slice(0, h), slice(h, n)) if r == 0 else (slice(h, n), slice(0, h))
    x, tmp = np.empty(n, np.float32), np.empty(n, np.float32)
    pc = time.perf_counter

    def run(variant: str) -> np.ndarray:
        t = np.zeros(3)
        for it in range(320):
            if refill or it == 0:  # the data each call reduces (sum: 3)
                x[:] = r + 1
            w.Barrier()
            t0 = pc()
            w.Sendrecv(x[other], peer, 1, tmp[keep], peer, 1)
            t1 = pc()
            if variant == "direct":  # MPICH's order: the incoming half first
                np.add(tmp[keep], x[keep], out=x[keep])
            elif variant == "mpiop":
                MPI.SUM.Reduce_local(tmp[keep], x[keep])
            else:
                np.add(tmp[keep], x[keep], out=tmp[keep])
                if variant == "tmp":
                    x[keep] = tmp[keep]
            t2 = pc()
            if variant == "sendtmp":
                w.Sendrecv(tmp[keep], peer, 2, x[other], peer, 2)
                x[keep] = tmp[keep]
            else:
                w.Sendrecv(x[keep], peer, 2, x[other], peer, 2)
            t3 = pc()
            if it >= 20:
                t += (t1 - t0, t2 - t1, t3 - t2)
        if refill and not (x == 3).all():
            raise SystemExit(f"{variant}: wrong result on rank {r}")
        return t / 300 * 1e6

    rows = [(v, run(v)) for v in ("direct", "mpiop", "tmp", "sendtmp")]
    mpi_us = 0.0
    for it in range(320):
        x[:] = r + 1 if refill else x
        w.Barrier()
        t0 = pc()
        w.Allreduce(MPI.IN_PLACE, x)
        if it >= 20:
            mpi_us += (pc() - t0) / 300 * 1e6
    worst = [w.allreduce(float(t.sum()), op=MPI.MAX) for _, t in rows]
    if r == 0:
        how = "rewritten before every call" if refill else "reused: each call reduces the previous result"
        print(
            f"# {nbytes} B of float32 in place, N = 2, the buffer {how}: us per call (rank 0's phases; "
            "total: the slowest rank)"
        )
        print(f"{'variant':>8} {'exchange 1':>11} {'reduce':>8} {'exchange 2':>11} {'total':>8}")
        for (name, t), total in zip(rows, worst):
            print(f"{name:>8} {t[0]:11.1f} {t[1]:8.1f} {t[2]:11.1f} {total:8.1f}")
        print(f"{'MPI':>8} {'':11} {'':8} {'':11} {mpi_us:8.1f}  (MPI_Allreduce, MPI_IN_PLACE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
