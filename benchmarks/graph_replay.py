"""All-reduces replayed from a CUDA graph against the same calls made eagerly, ringcomm's ring kernel
beside NCCL in the same run: ``mpiexec -n 2 python benchmarks/graph_replay.py``.

    mpiexec -n N python benchmarks/graph_replay.py [--sizes 8 1K 64K 1M] [--calls 10] [--replays 100]
                                                   [--impl ringcomm,nccl] [--json out.json]

For each implementation and size, a float32 sum out of place, on one stream of its own:

- ``eager``: ``calls`` x ``replays`` calls back to back, then the stream synchronized: µs per call;
- ``graph``: ``calls`` calls captured into one CUDA graph (``stream.begin_capture()`` /
  ``end_capture()``), the graph launched ``replays`` times back to back, then the stream synchronized:
  µs per call (the issue's target for ringcomm at 2 ranks up to 64 KiB: 8 µs).

Times are the slowest rank's wall time, after one warm-up pass of each. Every result is checked:
``out`` is poisoned (NaN) before each timed loop and must then equal the sum of every rank's input
(small integers: exact in float32) on every rank; ``#wrong`` counts the elements that do not (any
makes the exit status 1). ringcomm runs with ``RINGCOMM_TRANSPORT=kernel`` (set here when unset: only
a ring kernel's calls can be captured); its bench header line says whether the ring is one (else the
graph row says why not). NCCL is CuPy's ``cupy.cuda.nccl``, or the library ``RINGCOMM_NCCL_LIB`` names
(loaded first, as ``ringcomm-bench`` loads it), with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` where ranks share
a GPU. A capture that an implementation refuses (the emulated GPU of tests/emulated captures kernels
only, so its NCCL rows say so) is a row saying why, on every rank alike, and nothing is replayed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["8", "1K", "64K", "1M"], help="buffer sizes in bytes (K/M/G)")
    p.add_argument("--calls", type=int, default=10, help="all-reduces per graph")
    p.add_argument("--replays", type=int, default=100, help="graph launches per timed loop")
    p.add_argument("--impl", default="ringcomm,nccl", help="comma-separated: ringcomm, nccl")
    p.add_argument("--json")
    args = p.parse_args(argv)
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    if not impls or set(impls) - {"ringcomm", "nccl"}:
        p.error(f"--impl: ringcomm and/or nccl, got {args.impl!r}")
    os.environ.setdefault("RINGCOMM_TRANSPORT", "kernel")

    from ringcomm.bench import env

    named = env.nccl_library_named(None) if "nccl" in impls else None
    library, refused = None, ""
    if named is not None:  # before CuPy's NCCL bindings are imported, which bind to the first libnccl.so.2
        try:
            library = env.load_nccl_library(*named)
        except env.NcclLibraryError as e:
            refused = str(e)

    from mpi4py import MPI

    try:
        return measure(args, impls, library, refused)
    except Exception:
        # a failure on some ranks would leave the others waiting in MPI: end the whole job, as ringcomm-bench does
        traceback.print_exc()
        sys.stderr.write(f"graph_replay: rank {MPI.COMM_WORLD.rank} failed; aborting the MPI job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1


def measure(args, impls: list[str], library, refused: str) -> int:
    import cupy as cp
    import numpy as np
    from mpi4py import MPI

    import ringcomm
    from ringcomm.bench import env
    from ringcomm.bench.impls import NcclImpl
    from ringcomm.bench.sizes import parse_size

    world = MPI.COMM_WORLD
    n, r = world.size, world.rank
    comm = ringcomm.Communicator(world)
    env.select_gpu(comm, cp)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        comm.transport_name(cp.empty(1, cp.float32))  # (collective: the ring's transports, and the executor)
    link = comm._transport("cuda")
    link_note = "" if link.kernel or n == 1 else link.note or f"the ring is {link.name}, not a ring kernel"
    if r == 0:
        header(args, n, library, link_note)
    rows: list[dict] = []

    def measure_impl(name: str, run, note: str) -> None:
        """Every size's row of ``name`` (``run``: its all-reduce; None: not run, ``note`` says why)."""
        for size in map(parse_size, args.sizes):
            count = max(size // 4, 1)
            row = {"impl": name, "bytes": count * 4, "eager_us": None, "graph_us": None, "wrong": 0, "note": ""}
            rows.append(row)
            if run is None:
                row["note"] = note
            else:
                base = (np.arange(count) % 7).astype(np.float32)
                with stream:
                    x = cp.asarray(base + r)
                    out = cp.empty_like(x)
                measure_row(row, run, world, stream, x, out, base * n + n * (n - 1) / 2, args, comm, note)
            if r == 0:
                print(line(row), flush=True)  # (as measured: a run cut short keeps its rows)

    # ringcomm's rows first, then NCCL's, set up only then: an NCCL start that fails or hangs costs no ringcomm row
    if "ringcomm" in impls:
        measure_impl("ringcomm", lambda x, out: comm.all_reduce(x, out=out), link_note)
    nimpl = None
    if "nccl" in impls:
        nccl, why = (None, refused) if refused else env.nccl_module()
        if nccl is not None and library is not None:
            why = library.mismatch(nccl)  # (CuPy's bindings must use the library named)
            nccl = None if why else nccl
        if env.all_true(comm, nccl is not None):  # (NcclImpl.create is collective: every rank or none)
            nimpl, why = NcclImpl.create(comm, cp, nccl, stream, env.ranks_per_gpu(comm, cp), env.mps_status())
        if nimpl is not None:
            measure_impl(
                "nccl",
                lambda x, out: nimpl.ncomm.allReduce(
                    x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr
                ),
                "",
            )
        else:
            measure_impl("nccl", None, why or "NCCL could not run on another rank")
    if nimpl is not None:
        nimpl.close()
    comm.close()
    if r == 0:
        ratios(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "graph_replay", "ranks": n, "calls": args.calls, "rows": rows}, f, indent=1)
    return 0 if all(row["wrong"] == 0 for row in rows) else 1


def measure_row(row: dict, run, world, stream, x, out, want, args, comm, link_note: str) -> None:
    """``row``'s eager and replayed times and wrong elements (or why nothing was replayed)."""

    def eager(k: int) -> None:
        with stream:
            for _ in range(k):
                run(x, out)

    row["eager_us"], row["wrong"] = timed(world, stream, out, want, eager, args.calls * args.replays, comm)
    graph, why = capture(world, stream, lambda: eager(args.calls))
    if graph is None:
        row["note"] = f"capture refused: {why}" + (f" ({link_note})" if link_note else "")
        return

    def replay(k: int) -> None:
        for _ in range(k):
            graph.launch(stream)

    row["graph_us"], wrong = timed(world, stream, out, want, replay, args.replays, comm, args.calls)
    row["wrong"] += wrong


def timed(world, stream, out, want, loop, k: int, comm, per: int = 1) -> tuple[float, int]:
    """(the slowest rank's µs per call of ``loop(k)``, after ``loop(1)`` as a warm-up; wrong elements
    of ``out`` afterwards, summed over the ranks): each pass after ``out`` was poisoned."""
    import numpy as np
    from mpi4py import MPI

    wrong = 0
    for passes in (1, k):
        with stream:
            out.fill(np.nan)
        stream.synchronize()
        world.Barrier()
        t0 = time.perf_counter()
        loop(passes)
        stream.synchronize()
        seconds = time.perf_counter() - t0
        comm.check_errors()
        wrong += int((out.get() != want).sum())
    return world.allreduce(seconds, op=MPI.MAX) * 1e6 / (k * per), world.allreduce(wrong)


def capture(world, stream, calls) -> tuple[object | None, str]:
    """(the graph of ``calls()`` captured on ``stream``, "") on every rank, or (None, why) on every rank
    where any rank's capture failed (the first reason)."""
    stream.synchronize()
    graph, errors = None, []
    try:
        stream.begin_capture()
    except Exception as e:  # noqa: BLE001 - said in the row, on every rank alike
        errors.append(e)
    else:
        try:
            calls()
        except Exception as e:  # noqa: BLE001 - (the capture is then ended, and its error is the second)
            errors.append(e)
        try:
            graph = stream.end_capture()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    why = f"{type(errors[0]).__name__}: {errors[0]}".splitlines()[0][:200] if errors else ""
    whys = [w for w in world.allgather(why) if w]
    return (graph, "") if not whys else (None, whys[0])


def header(args, n: int, library, link_note: str) -> None:
    lib = f"; NCCL library {library.path} ({library.version})" if library is not None else ""
    print(
        f"# CUDA graph replay: all_reduce float32 sum out of place, {n} ranks, {args.calls} calls per graph, "
        f"{args.replays} replays; RINGCOMM_TRANSPORT={os.environ.get('RINGCOMM_TRANSPORT')}{lib}"
    )
    if link_note:
        print(f"# Ring kernel: {link_note}")
    print(f"{'bytes':>9} {'impl':>9} {'eager us':>9} {'graph us':>9} {'#wrong':>6}  note", flush=True)


def line(row: dict) -> str:
    fmt = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
    times = f"{fmt(row['eager_us'])} {fmt(row['graph_us'])}"
    return f"{row['bytes']:9d} {row['impl']:>9} {times} {row['wrong']:6d}  {row['note']}"


def ratios(rows: list[dict]) -> None:
    """NCCL's replayed time / ringcomm's, per size where both were replayed."""
    by = {(row["bytes"], row["impl"]): row for row in rows}
    pairs = [(b, by[b, "ringcomm"], by.get((b, "nccl"))) for b, i in by if i == "ringcomm"]
    found = [
        f"{b} B {nc['graph_us'] / rc['graph_us']:.2f}x"
        for b, rc, nc in pairs
        if nc and rc["graph_us"] and nc["graph_us"]
    ]
    if found:
        print("# NCCL's time / ringcomm's, replayed: " + ", ".join(found))


if __name__ == "__main__":
    sys.exit(main())
