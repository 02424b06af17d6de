"""The fault matrix: ranks that do not make the same call, a stuck peer, a peer that exits.

Each case runs on every rank of one MPI job, on a fresh Communicator with the default
``check=False``, and records what each rank raised and after how long::

    mpiexec -n 3 python tests/fault_matrix.py                     # host arrays, the markdown table
    mpiexec -n 3 python tests/fault_matrix.py --device gpu        # CuPy arrays (or the emulated GPU)
    mpiexec -n 3 python tests/fault_matrix.py --case exit         # a peer exits: the job ends (alone)
    mpiexec -n 2 python tests/fault_matrix.py --json out.json     # what tests/test_fault_matrix.py reads

Every rank's first call of a case is a good all_reduce, so the faults happen on a warm
communicator. The "stuck" case stops the last rank with SIGSTOP before its call; once the others
have raised, rank 0 resumes it (SIGCONT) and it makes its call then. The "exit" case ends the last
rank with os._exit(3) before its call: MPICH's mpiexec then ends the whole job, so it runs alone
and its record is what the ranks managed to write before that (one line each, flushed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import ringcomm

WORLD = MPI.COMM_WORLD


def _cases(xp, r: int, n: int) -> dict:
    """name -> (what the case is, the call this rank makes)."""
    f32, big = xp.float32, 16 * n * 1024  # big: the ring (not the small all-reduce path), shards equal

    def ones(count, dtype=f32):
        return xp.ones(count, dtype)

    return {
        "count (small)": (
            "rank 0 has 1007 elements, the others 1000 (4 KB: the gather-fold plan)",
            lambda c: c.all_reduce(ones(1007 if r == 0 else 1000)),
        ),
        "count (ring)": (
            "rank 0 has 16 elements more than the others",
            lambda c: c.all_reduce(ones(big + 16 * (r == 0))),
        ),
        "dtype (other size)": (
            "float64 on rank 0, float32 elsewhere",
            lambda c: c.all_reduce(ones(big, xp.float64 if r == 0 else f32)),
        ),
        "dtype (same size)": (
            "int32 on rank 0, float32 elsewhere",
            lambda c: c.all_reduce(ones(big, xp.int32 if r == 0 else f32)),
        ),
        "op": ("max on rank 0, sum elsewhere", lambda c: c.all_reduce(ones(big), "max" if r == 0 else "sum")),
        "accumulate": (
            'float16 with accumulate="float32" on rank 0, without elsewhere',
            lambda c: c.all_reduce(ones(big, xp.float16), accumulate="float32" if r == 0 else None),
        ),
        "op (small)": (
            "max on rank 0, sum elsewhere, 40 B",
            lambda c: c.all_reduce(ones(10), "max" if r == 0 else "sum"),
        ),
        "collective": (
            "all_gather on rank 0, all_reduce elsewhere (same sizes)",
            lambda c: c.all_gather(ones(big // n), out=ones(big)) if r == 0 else c.all_reduce(ones(big)),
        ),
        "skipped call": (
            "rank 0 skips an all_reduce, then calls reduce_scatter like the others",
            lambda c: (r != 0 and c.all_reduce(ones(big)), c.reduce_scatter(ones(big))),
        ),
        "root": (
            "broadcast, root 0 on rank 0 and root 1 elsewhere",
            lambda c: c.broadcast(ones(big), root=0 if r == 0 else 1),
        ),
    }


def settle(comm, xp) -> None:
    """What a GPU user does after calls that return before their work is done (RINGCOMM_TRANSPORT=
    kernel): wait for the stream, then ask for the errors the GPU recorded."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
        comm.check_errors()


def run_case(name: str, call, timeout: float, xp) -> dict:
    comm = ringcomm.Communicator(WORLD, timeout=timeout)
    comm.all_reduce(xp.ones(64, xp.float32))  # a good call first, done before the fault
    settle(comm, xp)
    t0 = time.monotonic()
    try:
        call(comm)
        settle(comm, xp)
        rec = {"outcome": "returned", "message": ""}
    except ringcomm.RingcommError as e:
        rec = {"outcome": type(e).__name__, "message": str(e), "origin": getattr(e, "origin", None)}
    except Exception as e:  # noqa: BLE001 - not a RingcommError: the matrix shows it as such
        rec = {"outcome": f"{type(e).__module__}.{type(e).__name__} (not a RingcommError)", "message": str(e)}
    rec.update(case=name, rank=WORLD.rank, seconds=round(time.monotonic() - t0, 3))
    WORLD.Barrier()
    return rec


def run_stuck(timeout: float, xp) -> dict:
    """The last rank stops (SIGSTOP) before its call; rank 0 resumes it once the others have raised."""
    r, n = WORLD.rank, WORLD.size
    victim, pids = n - 1, WORLD.allgather(os.getpid())
    survivors = WORLD.Split(0 if r != victim else MPI.UNDEFINED)
    comm = ringcomm.Communicator(WORLD, timeout=timeout)
    comm.all_reduce(xp.ones(64, xp.float32))
    settle(comm, xp)  # (done before the stop: the emulated GPU's kernels stop with their process)
    x = xp.ones(16 * n * 1024, xp.float32)
    WORLD.Barrier()
    if r == victim:
        os.kill(os.getpid(), signal.SIGSTOP)  # ... until rank 0 sends SIGCONT
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        settle(comm, xp)
        rec = {"outcome": "returned", "message": ""}
    except ringcomm.RingcommError as e:
        rec = {"outcome": type(e).__name__, "message": str(e), "origin": getattr(e, "origin", None)}
    rec.update(case="stuck peer", rank=r, seconds=round(time.monotonic() - t0, 3), resumed=r == victim)
    if r != victim:
        survivors.Barrier()
        if r == 0:
            os.kill(pids[victim], signal.SIGCONT)
        survivors.Free()
    WORLD.Barrier()
    return rec


def run_exit(timeout: float, xp) -> None:
    """The last rank exits (os._exit(3)) before its call; each other rank prints one JSON line."""
    r, n = WORLD.rank, WORLD.size
    comm = ringcomm.Communicator(WORLD, timeout=timeout)
    comm.all_reduce(xp.ones(64, xp.float32))
    settle(comm, xp)
    x = xp.ones(16 * n * 1024, xp.float32)
    WORLD.Barrier()
    if r == n - 1:
        os._exit(int(os.environ.get("FAULT_EXIT_CODE", "3")))
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        rec = {"outcome": "returned", "message": ""}
    except ringcomm.RingcommError as e:
        rec = {"outcome": type(e).__name__, "message": str(e)}
    rec.update(case="peer exits", rank=r, seconds=round(time.monotonic() - t0, 3))
    print("RESULT " + json.dumps(rec), flush=True)


def markdown(records: list[dict], n: int, timeout: float, device: str) -> str:
    cases = list(dict.fromkeys(rec["case"] for rec in records))
    lines = [
        f"N = {n}, {device} arrays, timeout {timeout:g} s; each cell: what the rank raised, after how long",
        "",
        "| case | " + " | ".join(f"rank {r}" for r in range(n)) + " |",
        "|---" * (n + 1) + "|",
    ]
    for case in cases:
        cells = []
        for r in range(n):
            rec = next((x for x in records if x["case"] == case and x["rank"] == r), None)
            if rec is None:
                cells.append("-")
                continue
            what = rec["outcome"] + (f" (from rank {rec['origin']})" if rec.get("origin") is not None else "")
            cells.append(f"{what}, {rec['seconds']:.2f} s" + (" after SIGCONT" if rec.get("resumed") else ""))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("host", "gpu"), default="host")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--case", default="all", help="all (every case but exit), or one case name, or exit")
    p.add_argument("--json", default=None, help="write the records to this file (rank 0)")
    args = p.parse_args()
    if args.device == "gpu":
        import cupy as xp

        node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        xp.cuda.Device(node.rank % xp.cuda.runtime.getDeviceCount()).use()
        node.Free()
    else:
        xp = np
    if args.case == "exit":
        run_exit(args.timeout, xp)
        return 0
    cases = _cases(xp, WORLD.rank, WORLD.size)
    records = [
        run_case(name, call, args.timeout, xp) for name, (_, call) in cases.items() if args.case in ("all", name)
    ]
    if args.case in ("all", "stuck peer"):
        records.append(run_stuck(args.timeout, xp))
    everyone = [rec for recs in WORLD.allgather(records) for rec in recs]
    if WORLD.rank == 0:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "ranks": WORLD.size,
                        "timeout": args.timeout,
                        "device": args.device,
                        "cases": {k: v[0] for k, v in cases.items()},
                        "records": everyone,
                    },
                    f,
                    indent=1,
                )
        print(markdown(everyone, WORLD.size, args.timeout, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
