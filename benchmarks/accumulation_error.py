"""The error of float16/bfloat16 sums: ringcomm's default (each hop rounded to the half type, as
NCCL's ring does), ringcomm with accumulate="float32", and MPI's Allreduce, in ulps of the
correctly rounded float64 sum.

    python benchmarks/accumulation_error.py                  # simulation in one process, N = 2 .. 64
    mpiexec -n 4 python benchmarks/accumulation_error.py --mpi   # the real collectives and MPI_Allreduce
    mpiexec -n 2 python benchmarks/accumulation_error.py --bandwidth 67108864   # the time it costs

The simulation folds each element in the ring's own order (ringcomm.schedule.fold_order) with the
host device's arithmetic (ringcomm.devices.HostDevice: the same operations, bit for bit, as the GPU
kernels), so it is what an N-rank ring computes. Two data sets: "normal" (standard normal values)
and "hard" (on one rank a large value, on the others many small terms of a third of its ulp, which
rounding at every hop drops one by one). Each cell: the largest error, in ulps of the half type at
the correctly rounded sum, over the elements whose sum does not cancel (|Σxᵢ| >= Σ|xᵢ|/8: where it
cancels, every method's error is many ulps of the tiny result), and whether the float32 bound
holds for every element (half an ulp plus N·2⁻²⁴·Σ|xᵢ|).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ringcomm.devices import HostDevice
from ringcomm.ops import ReduceOp, bfloat16
from ringcomm.schedule import fold_order

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": bfloat16}
#: mantissa bits and the smallest normal exponent of each half type
SHAPE = {np.dtype(np.float16): (10, -14), bfloat16: (7, -126)}


def data(kind: str, dtype: np.dtype, n: int, count: int, seed: int) -> np.ndarray:
    """(n, count) inputs, one row per rank."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal((n, count)).astype(dtype)
    mant, _ = SHAPE[dtype]
    big = 2.0**6 * (1 + rng.random(count)) * rng.choice([-1.0, 1.0], count)
    rows = big * 2.0**-mant / 3 * (1 + 0.1 * rng.random((n, count)))  # terms of a third of big's ulp
    rows[rng.integers(0, n, count), np.arange(count)] = big  # ... and the large one, on a random rank
    return rows.astype(dtype)


def ring(x: np.ndarray, accumulate: bool) -> np.ndarray:
    """What an N-rank ring computes for the sum of x's rows (every element folded in the order of
    chunk 0: the order of a chunk only relabels the ranks)."""
    dev, order = HostDevice(), fold_order(x.shape[0], 0)
    out = np.empty(x.shape[1], x.dtype)
    if accumulate:
        part = np.empty(x.shape[1], np.float32)
        dev.widen(part, x[order[0]])
        for j in order[1:-1]:
            dev.reduce_acc(part, x[j], part, ReduceOp.SUM)
        dev.reduce_acc_final(out, x[order[-1]], part, ReduceOp.SUM)
    else:
        out[:] = x[order[0]]
        for j in order[1:]:
            dev.reduce(out, x[j], out, ReduceOp.SUM)
    return out


def ulps(got: np.ndarray, x: np.ndarray) -> tuple[float, bool]:
    """(largest error in ulps of the correctly rounded sum over the elements whose sum does not
    cancel, |Σxᵢ| >= Σ|xᵢ|/8; whether the float32 bound holds for every element)."""
    wide = x.astype(np.float64)
    exact, mass = wide.sum(0), np.abs(wide).sum(0)
    mant, emin = SHAPE[x.dtype]
    rounded = np.abs(exact.astype(x.dtype).astype(np.float64))
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(rounded, 2.0**emin))) - mant)
    err = np.abs(got.astype(np.float64) - exact)
    bound = 0.5 * ulp + x.shape[0] * 2.0**-24 * mass
    keep = np.abs(exact) >= mass / 8
    return float((err / ulp)[keep].max()), bool((err <= bound * (1 + 1e-12)).all())


def simulate(ns: list[int], count: int) -> None:
    print('| dtype | data | N | default (ulps) | accumulate="float32" (ulps) | float32 bound holds |')
    print("|---|---|---|---|---|---|")
    for name, dtype in DTYPES.items():
        for kind in ("normal", "hard"):
            for n in ns:
                x = data(kind, dtype, n, count, seed=n)
                plain, _ = ulps(ring(x, False), x)
                wide, ok = ulps(ring(x, True), x)
                print(f"| {name} | {kind} | {n} | {plain:.2f} | {wide:.2f} | {'yes' if ok else 'NO'} |")


def measure(count: int) -> int:
    """The real collectives under MPI: ringcomm default, accumulate="float32", MPI_Allreduce."""
    from mpi4py import MPI

    import ringcomm

    world = MPI.COMM_WORLD
    comm = ringcomm.init()
    n, r = world.size, world.rank
    rows = []
    for name, dtype in DTYPES.items():
        word = np.uint16

        def add(inbuf, inoutbuf, datatype, dtype=dtype):  # numpy's own addition, rounded each time
            a, b = np.frombuffer(inbuf, dtype), np.frombuffer(inoutbuf, dtype)
            np.add(a, b, out=b)

        half_op = MPI.Op.Create(add, commute=True)
        for kind in ("normal", "hard"):
            x = data(kind, dtype, n, count, seed=n)
            mine = np.ascontiguousarray(x[r])
            plain = comm.all_reduce(mine, out=np.empty_like(mine))
            wide = comm.all_reduce(mine, out=np.empty_like(mine), accumulate="float32")
            mpi = np.empty_like(mine)
            if dtype == np.float16 and MPI.FLOAT16_T != MPI.DATATYPE_NULL:
                world.Allreduce([mine, MPI.FLOAT16_T], [mpi, MPI.FLOAT16_T], MPI.SUM)
                how = "MPI_Allreduce (FLOAT16_T, MPI_SUM)"
            else:
                world.Allreduce([mine.view(word), MPI.UINT16_T], [mpi.view(word), MPI.UINT16_T], half_op)
                how = "MPI_Allreduce (numpy add as a user op)"
            rows.append((name, kind, *ulps(plain, x), *ulps(wide, x), *ulps(mpi, x), how))
        half_op.Free()
    if r == 0:
        print(f"N = {n}, {count} elements, MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
        print('| dtype | data | default (ulps) | accumulate="float32" (ulps) | bound | MPI (ulps) | MPI\'s op |')
        print("|---|---|---|---|---|---|---|")
        for name, kind, p, _, w, ok, m, _, how in rows:
            print(f"| {name} | {kind} | {p:.2f} | {w:.2f} | {'yes' if ok else 'NO'} | {m:.2f} | {how} |")
    comm.close()
    return 0


def bandwidth(size: int, iters: int) -> int:
    """float16 all_reduce of ``size`` bytes, default and accumulate="float32", alternating in one run."""
    import time

    from mpi4py import MPI

    import ringcomm

    world = MPI.COMM_WORLD
    comm = ringcomm.init()
    x = np.ones(size // 2, np.float16)
    out = np.empty_like(x)
    times: dict[str, list[float]] = {"default": [], "float32": []}
    for i in range(2 * iters + 4):
        mode = "float32" if i % 2 else "default"
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x, out=out, accumulate=None if mode == "default" else mode)
        t = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= 4:
            times[mode].append(t)
    if world.rank == 0:
        n = world.size
        med = {m: float(np.median(v)) for m, v in times.items()}
        for m, t in med.items():
            busbw = size / t * 2 * (n - 1) / n / 1e9
            print(
                f"N={n} {size >> 20} MiB float16 all_reduce, accumulate={m}: {t * 1e3:.1f} ms, busbw {busbw:.2f} GB/s"
            )
        print(f"time ratio float32 / default = {med['float32'] / med['default']:.2f}")
    comm.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mpi", action="store_true", help="run the real collectives (under mpiexec)")
    p.add_argument(
        "--bandwidth",
        type=int,
        default=0,
        metavar="BYTES",
        help="instead: time a float16 all_reduce of BYTES, default against float32 accumulation (mpiexec)",
    )
    p.add_argument("--count", type=int, default=1 << 16, help="elements per run (default 65536)")
    p.add_argument("--ranks", default="2,3,4,5,8,16,32,64", help="simulated N (default 2,3,4,5,8,16,32,64)")
    args = p.parse_args()
    if args.bandwidth:
        return bandwidth(args.bandwidth, 10)
    if args.mpi:
        return measure(args.count)
    simulate([int(v) for v in args.ranks.split(",")], args.count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
