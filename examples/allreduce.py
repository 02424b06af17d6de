"""All-reduce a gradient-like buffer and check it against MPI's own Allreduce.

    mpiexec -n 4 python examples/allreduce.py [--count 1000003] [--dtype float32]

Works on the host (numpy) and, when CuPy sees a GPU and --gpu is given, on GPU arrays.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

import ringcomm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1_000_003, help="elements (default 1000003)")
    ap.add_argument("--dtype", default="float32", help="float16, bfloat16, float32, float64, int32, ...")
    ap.add_argument("--gpu", action="store_true", help="use CuPy arrays (one GPU per rank, or ranks sharing one)")
    ap.add_argument("--debug", action="store_true", help="log which algorithm and transport ran")
    a = ap.parse_args()
    if a.debug:
        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")

    comm = ringcomm.init(timeout=60)
    dtype = ringcomm.bfloat16 if a.dtype == "bfloat16" else np.dtype(a.dtype)
    rng = np.random.default_rng(comm.rank)
    host = rng.integers(-8, 9, a.count).astype(dtype)  # small integers: every sum is exact, bfloat16 too
    if a.gpu:
        import cupy

        x, original = cupy.asarray(host), cupy.asarray(host)
    else:
        x, original = host.copy(), host
    comm.all_reduce(x)  # in place
    shard = comm.reduce_scatter(original)  # this rank's part of the same sum; original is unchanged
    result = x.get() if a.gpu else x

    want = np.empty(a.count, np.float64)
    comm.mpi.Allreduce(host.astype(np.float64), want)  # MPI's own, as the reference
    wrong = int(np.count_nonzero(result.astype(np.float64) != want))
    lo, hi = comm.shard_bounds(a.count)[comm.rank]
    shard_ok = (shard.get() if a.gpu else shard).tobytes() == result[lo:hi].tobytes()
    total_wrong = comm.mpi.allreduce(wrong + (not shard_ok))
    if comm.rank == 0:
        print(
            f"all_reduce of {a.count} {dtype} on {comm.size} ranks via {comm.transport_name(x)}: "
            f"{'OK' if total_wrong == 0 else f'{total_wrong} WRONG'}"
        )
    raise SystemExit(1 if total_wrong else 0)


if __name__ == "__main__":
    main()
