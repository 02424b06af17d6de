"""Where a GPU collective's host time goes, per transport and size: ``mpiexec -n 2 python benchmarks/gpu_host_cost.py``.

    mpiexec -n N python benchmarks/gpu_host_cost.py [--transports ipc staged kernel] [--collectives all_reduce ...]
                                                     [--sizes 8 64K 1M] [--iters 200] [--arrays cupy|torch]
                                                     [--top K] [--json out.json]

For each transport (RINGCOMM_TRANSPORT, one Communicator each), size and collective (``--collectives``:
all_reduce by default, or any of all_reduce, reduce_scatter, all_gather, broadcast, reduce): a float32 call
out of place (broadcast: in place; the root rank 0; the size is the whole buffer's), called back to
back (``--iters`` calls after 20 warm-up ones, the stream synchronized at the end), on CuPy arrays or
(``--arrays torch``) PyTorch CUDA tensors over the same memory (``torch.from_dlpack``), which run on
PyTorch's current stream;
``us/call`` is the slowest rank's mean wall time per call. ``in call``: the slowest rank's mean time
inside the call itself, each call made on an idle stream (synchronized after it, outside the timing): the
host time a call costs (all of it where the call waits for the GPU; the checks and the launch alone where
it returns before its kernel runs: kernel). ``python`` (kernel only): the slowest rank's time
per call with the kernel launch and the event wait and record made no-ops, ringcomm's own Python (with
CuPy's stream and device queries): what the host time per call is without CUDA's launch cost, which is
the same for any library (on the emulated GPU, the emulation's launch dominates ``in call``). Then the
same loop again under cProfile
(every rank; rank 0's figures are shown), its time split by who spent it, each function's own time:

- ``ringcomm``: ringcomm's own Python (argument checks, schedule, engine, transports' handshakes, kernel
  launches' arguments), with the mpi4py calls it makes (compiled Cython methods, which cProfile does
  not see apart from their caller): the host work this library can save;
- ``cuda``: CuPy and cuda-bindings (array views, events, kernel launches, driver queries); on the
  emulated GPU of tests/emulated the emulation, its kernels run on the CPU included;
- ``wait``: polling and yielding the core while a neighbour or the GPU is not done
  (``transports.base.wait_until`` and its polls, ``os.sched_yield``);
- ``other``: the benchmark's own loop.

``--top K`` also lists, under each row, rank 0's K functions of most own time (profiled us per call, calls
per call), builtins and mpi4py's methods by name: what a share is made of.

numpy, the standard library, builtins, lambdas, and calls cProfile does not see (compiled Cython
functions: mpi4py's, and some of CuPy's) count for whoever called them.

Each share of the profiled time is scaled to the unprofiled ``us/call`` (cProfile slows Python calls
more than C work, so the ringcomm share is an upper bound), and divided by the call's steps for
``us/step``. Runs on a GPU (CuPy) or on the CPU through the emulated GPU
(``PYTHONPATH=tests/emulated:tests:. RINGCOMM_EMULATED_HARNESS=lib.so``: see tests/conftest.py).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

SIDES = ("ringcomm", "cuda", "wait", "other")


def side(key: tuple) -> str | None:
    """Whose own time a profiled function's is; None: its callers' (numpy, the standard library,
    builtins, lambdas: a wait's poll is the wait's)."""
    filename, _, name = key
    if filename == "~":  # a builtin, or a compiled method (CuPy's, cuda-bindings') named with its module
        if "sched_yield" in name or "sleep" in name:
            return "wait"
        return "cuda" if "cupy" in name or "cuda" in name else None
    path = filename.replace(os.sep, "/")
    if "/tests/emulated/" in path or "/cupy/" in path or "/cupy_backends/" in path or "/cuda/" in path:
        return "cuda"
    if name == "<lambda>":
        return None
    if "/ringcomm/" in path:
        return "wait" if name == "wait_until" else "ringcomm"
    if "/benchmarks/" in path:
        return "other"
    return None


def split(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per side. A function without a side of its own (numpy, the standard
    library, builtins) is charged to its callers' sides, in proportion to the time each caller's
    calls took (cumulative), through any depth of such functions; what no side called is "other"."""
    table = stats.stats
    shares: dict[tuple, dict[str, float]] = {}
    visiting: set[tuple] = set()

    def owners(key: tuple) -> dict[str, float]:
        if key in shares:
            return shares[key]
        mine = side(key)
        if mine is not None or key not in table:
            shares[key] = {mine or "other": 1.0}
            return shares[key]
        visiting.add(key)
        out: dict[str, float] = {}
        for caller, entry in table[key][4].items():
            if caller in visiting:  # recursion: the outermost call of the cycle decides
                continue
            for name, frac in owners(caller).items():
                out[name] = out.get(name, 0.0) + (entry[3] or 1e-12) * frac
        visiting.discard(key)
        total = sum(out.values())
        shares[key] = {name: v / total for name, v in out.items()} if total else {"other": 1.0}
        return shares[key]

    seconds = dict.fromkeys(SIDES, 0.0)
    for key, (_, _, tottime, _, _) in table.items():
        for name, frac in owners(key).items():
            seconds[name] += tottime * frac
    return seconds


def top(stats: pstats.Stats, k: int, calls: int) -> list[dict]:
    """The k functions of most own time: profiled us and calls per collective call."""
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:k]
    label = lambda f: f[2] if f[0] == "~" else f"{os.path.basename(f[0])}:{f[1]}({f[2]})"  # noqa: E731
    return [
        {"function": label(key), "us_per_call": tt * 1e6 / calls, "calls_per_call": nc / calls}
        for key, (_, nc, tt, _, _) in rows
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", nargs="+", default=["ipc", "staged", "kernel"])
    p.add_argument("--collectives", nargs="+", default=["all_reduce"], choices=sorted(CALLS))
    p.add_argument("--sizes", nargs="+", default=["8", "64K", "1M"], help="buffer sizes in bytes (K/M/G suffixes)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--arrays", choices=["cupy", "torch"], default="cupy", help="what the calls are given")
    p.add_argument("--top", type=int, default=0, metavar="K", help="list rank 0's K functions of most own time")
    p.add_argument("--json")
    args = p.parse_args(argv)

    import cupy as cp
    import numpy as np
    from mpi4py import MPI

    import ringcomm
    from ringcomm.bench.sizes import parse_size

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    cp.cuda.Device(node.rank % cp.cuda.runtime.getDeviceCount()).use()
    n, r = world.size, world.rank
    if args.arrays == "torch":
        import torch

        wrap, stream = torch.from_dlpack, torch.cuda.current_stream()  # (the calls' stream)
    else:
        wrap, stream = (lambda a: a), cp.cuda.get_current_stream()
    rows = []
    for name in args.transports:
        os.environ["RINGCOMM_TRANSPORT"] = name  # read when the communicator first picks a GPU transport
        comm = ringcomm.Communicator(world)
        for size, collective in ((s, c) for s in map(parse_size, args.sizes) for c in args.collectives):
            count = max(size // 4, 1)
            base = (np.arange(count) % 7).astype(np.float32)
            call, wrongs, steps = CALLS[collective](comm, cp, base, n * base + n * (n - 1) // 2, wrap)
            cp.cuda.Device().synchronize()  # (the inputs written before the calls, whatever their stream)
            ran = comm.transport_name(cp.empty(1, cp.float32))
            algorithm = "via host" if comm._via_host("cuda", count * 4) else "ring"  # (the collectives' rule)
            if n > 1 and comm._transport("cuda").kernel:
                algorithm = "one kernel"
            steps = 1 if algorithm == "via host" else steps

            def loop(calls: int, call=call) -> None:
                for _ in range(calls):
                    call()
                stream.synchronize()

            loop(20)
            world.Barrier()
            t0 = time.perf_counter()
            loop(args.iters)
            per_call = world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / args.iters
            inside = 0.0  # the host's time in the call itself, the GPU idle when it starts
            for _ in range(args.iters):
                t1 = time.perf_counter()
                call()
                inside += time.perf_counter() - t1
                stream.synchronize()
            in_call = world.allreduce(inside, op=MPI.MAX) / args.iters
            python = python_alone(comm, call, args.iters) if algorithm == "one kernel" else 0.0
            python = world.allreduce(python, op=MPI.MAX)
            wrong = int(world.allreduce(wrongs(), op=MPI.SUM))
            world.Barrier()
            prof = cProfile.Profile()
            prof.enable()
            loop(args.iters)
            prof.disable()
            stats = pstats.Stats(prof)
            seconds = split(stats)
            total = sum(seconds.values()) or 1.0
            us = {k: per_call * 1e6 * v / total for k, v in seconds.items()}
            rows.append(
                {
                    "transport": name,
                    "collective": collective,
                    "arrays": args.arrays,
                    "ran": ran,
                    "ranks": n,
                    "bytes": count * 4,
                    "steps": steps,
                    "algorithm": algorithm,
                    "us_per_call": per_call * 1e6,
                    "host_us_per_call": in_call * 1e6,
                    "python_us_per_call": python * 1e6,
                    "us_per_step": per_call * 1e6 / max(steps, 1),
                    "us_by_side": us,
                    "us_per_step_by_side": {k: v / max(steps, 1) for k, v in us.items()},
                    "wrong": wrong,
                    "top": top(stats, args.top, args.iters),
                }
            )
        comm.close()
        del os.environ["RINGCOMM_TRANSPORT"]
    if r == 0:
        print(
            f"# GPU host time of {', '.join(args.collectives)}, float32 {args.arrays} arrays, {n} ranks, "
            f"{args.iters} calls; "
            f"per side: rank 0's profiled share of the call (us per step)"
        )
        head = (
            f"{'transport':>10} {'collective':>14} {'ran':>10} {'bytes':>9} {'algorithm':>11} {'steps':>5} "
            f"{'us/call':>9} {'in call':>8}"
            f" {'python':>7} {'us/step':>8}"
        )
        print(head + "".join(f" {k:>8}" for k in SIDES) + f" {'wrong':>6}")
        for row in rows:
            print(
                f"{row['transport']:>10} {row['collective']:>14} {row['ran']:>10} {row['bytes']:9d} "
                f"{row['algorithm']:>11} {row['steps']:5d} "
                f"{row['us_per_call']:9.1f} {row['host_us_per_call']:8.1f} "
                + (f"{row['python_us_per_call']:7.1f}" if row["python_us_per_call"] else f"{'-':>7}")
                + f" {row['us_per_step']:8.1f}"
                + "".join(f" {row['us_per_step_by_side'][k]:8.1f}" for k in SIDES)
                + f" {row['wrong']:6d}"
            )
            for fn in row["top"]:
                print(f"{'':>12}{fn['us_per_call']:9.1f} us {fn['calls_per_call']:6.1f}x  {fn['function']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "gpu_host_cost", "rows": rows}, f, indent=1)
    return 0 if all(row["wrong"] == 0 for row in rows) else 1


def python_alone(comm, call, calls: int) -> float:
    """Seconds per call of ringcomm's own Python on a kernel ring (and CuPy's stream and device
    queries): ``calls`` calls with the kernel launch and the event wait and record made no-ops. No
    rank launches these calls' kernels, so the ring's epochs in device memory stay in step."""
    from ringcomm.devices.cuda import CudaDevice

    ex = next(iter(comm._executors.values()))
    kept, after, record = dict(ex.calls), CudaDevice.after, CudaDevice.record
    for key, kind in kept.items():  # (a kind of call: steps, kernel, arguments, bytes, table)
        ex.calls[key] = (kind[0], lambda *args, **kw: None, *kind[2:])
    CudaDevice.after, CudaDevice.record = (lambda self, last: None), (lambda self, last: last)
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - t0) / calls
    finally:
        ex.calls.update(kept)
        CudaDevice.after, CudaDevice.record = after, record


def _all_reduce(comm, cp, base, total, wrap):
    """(the call, its wrong elements on this rank once it ran, the ring's steps) of each collective:
    every rank's input is ``base`` + its rank (``base``: i % 7, float32), so every result is exact,
    ``total`` the sum over the ranks. The call is given ``wrap`` of the CuPy arrays (the same memory),
    the check reads those."""
    x, out = cp.asarray(base + comm.rank), cp.empty(base.size, cp.float32)
    wx, wout = wrap(x), wrap(out)
    return lambda: comm.all_reduce(wx, out=wout), lambda: int((cp.asnumpy(out) != total).sum()), 2 * (comm.size - 1)


def _reduce_scatter(comm, cp, base, total, wrap):
    lo, hi = comm.shard_bounds(base.size)[comm.rank]
    x, out = cp.asarray(base + comm.rank), cp.empty(hi - lo, cp.float32)
    wx, wout = wrap(x), wrap(out)
    wrong = lambda: int((cp.asnumpy(out) != total[lo:hi]).sum())  # noqa: E731
    return lambda: comm.reduce_scatter(wx, out=wout), wrong, comm.size - 1


def _all_gather(comm, cp, base, total, wrap):
    bounds = comm.shard_bounds(base.size)
    lo, hi = bounds[comm.rank]
    shard, out = cp.asarray(base[lo:hi] + comm.rank), cp.empty(base.size, cp.float32)
    wshard, wout = wrap(shard), wrap(out)
    want = base.copy()
    for k, (a, b) in enumerate(bounds):
        want[a:b] += k
    return lambda: comm.all_gather(wshard, out=wout), lambda: int((cp.asnumpy(out) != want).sum()), comm.size - 1


def _broadcast(comm, cp, base, total, wrap):
    x = cp.asarray(base + comm.rank)
    wx = wrap(x)
    return lambda: comm.broadcast(wx, root=0), lambda: int((cp.asnumpy(x) != base).sum()), comm.size - 1


def _reduce(comm, cp, base, total, wrap):
    x = cp.asarray(base + comm.rank)
    out = cp.empty(base.size, cp.float32) if comm.rank == 0 else None
    wx, wout = wrap(x), None if out is None else wrap(out)
    wrong = lambda: 0 if out is None else int((cp.asnumpy(out) != total).sum())  # noqa: E731
    return lambda: comm.reduce(wx, root=0, out=wout), wrong, comm.size - 1


#: per collective: (call, wrong elements, steps) for a communicator and a count (the chain's steps of
#: broadcast and reduce counted as N - 1: one per place, whatever its pieces)
CALLS = {
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "broadcast": _broadcast,
    "reduce": _reduce,
}


if __name__ == "__main__":
    sys.exit(main())
