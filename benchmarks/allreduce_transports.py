"""GPU all-reduce time per transport, measured in one run: ``mpiexec -n 2 python benchmarks/allreduce_transports.py``.

    mpiexec -n 2 python benchmarks/allreduce_transports.py [--mib 1024] [--transports ipc staged]
                                                             [--iters 5] [--json out.json]

Every rank uses GPU (node rank % GPUs), so 2 ranks on a one-GPU machine share it. For each
transport (RINGCOMM_TRANSPORT, one Communicator each): a float32 buffer of ``--mib`` MiB, filled with
rank + 1 before every call (not timed), all-reduced in place; the time is from a barrier to the
slowest rank's stream being done, median over ``--iters`` after one warm-up, and every result is
checked. Prints the times, algbw and busbw (nccl-tests' definitions) and each transport's time
over the first one's (issue 3's target: staged / ipc >= 5 at 1 GiB, 2 ranks on one GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="buffer size in MiB (default 1024)")
    p.add_argument("--transports", nargs="+", default=["ipc", "staged"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)

    import cupy as cp
    from mpi4py import MPI

    import ringcomm

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    cp.cuda.Device(node.rank % cp.cuda.runtime.getDeviceCount()).use()
    n, r = world.size, world.rank
    count = (args.mib << 20) // 4
    x = cp.empty(count, cp.float32)
    stream = cp.cuda.get_current_stream()
    expected = n * (n + 1) / 2
    rows = []
    for name in args.transports:
        os.environ["RINGCOMM_TRANSPORT"] = name  # read when the communicator first picks a GPU transport
        comm = ringcomm.Communicator(world)
        comm.transport_name(x)
        del os.environ["RINGCOMM_TRANSPORT"]
        times, wrong = [], 0
        for it in range(args.iters + 1):
            x.fill(r + 1)
            stream.synchronize()
            world.Barrier()
            t0 = time.perf_counter()
            comm.all_reduce(x)
            stream.synchronize()
            dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            wrong += int(world.allreduce(int((x != expected).sum()), op=MPI.SUM))
            if it:
                times.append(dt)
        used = comm.transport_name(x)
        t = statistics.median(times)
        algbw = count * 4 / t / 1e9
        rows.append(
            {
                "transport": name,
                "ran": used,
                "ranks": n,
                "bytes": count * 4,
                "median_s": t,
                "times_s": times,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (n - 1) / max(n, 1),
                "wrong": wrong,
            }
        )
    base = rows[0]["median_s"]
    for row in rows:
        row["time_over_first"] = row["median_s"] / base
    if r == 0:
        print(f"# all_reduce float32 {args.mib} MiB, {n} ranks, GPUs on this node: {cp.cuda.runtime.getDeviceCount()}")
        print(
            f"{'transport':>10} {'ran':>8} {'median ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} "
            f"{'x first':>8} {'wrong':>6}"
        )
        for row in rows:
            print(
                f"{row['transport']:>10} {row['ran']:>8} {row['median_s'] * 1e3:10.2f} {row['algbw_GBps']:11.2f} "
                f"{row['busbw_GBps']:11.2f} {row['time_over_first']:8.2f} {row['wrong']:6d}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "allreduce_transports", "rows": rows}, f, indent=1)
    return 0 if all(row["wrong"] == 0 and row["ran"] == row["transport"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
