"""The benchmark driver run for real on the host path (one mpiexec launch per rank count).

The driver's main(argv) runs in-process on every rank; rank 0's output is parsed like a person
would read it: every table, every row checked (#wrong 0), then a run with planted corruption whose
#wrong must count exactly what was planted and whose footer must say FAILED. The same launch also
runs the measuring code on cases the driver's sweep never makes (unequal shards, bfloat16 on MPI).
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import time

import numpy as np
import pytest
from conftest import TEST_TIMEOUT
from mpi4py import MPI

import ringcomm
from ringcomm import communicator, schedule
from ringcomm.bench import env
from ringcomm.bench.__main__ import main
from ringcomm.bench.impls import MpiImpl, RingcommImpl
from ringcomm.bench.report import parse_tables
from ringcomm.bench.runner import Runner, Settings, Watchdog
from ringcomm.ops import ReduceOp

PLANTED = 3
SWEEP = [
    "-b",
    "256",
    "-e",
    "16K",
    "-f",
    "8",
    "-n",
    "2",
    "-w",
    "1",
    "--device",
    "host",
    "--impl",
    "ringcomm,mpi",
    "--timeout",
    "60",
    "--min-time",
    "0.002",
]


def _run(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def _check_paths_the_sweep_does_not_take() -> None:
    """Unequal shards (MPI_Reduce_scatter and MPI_Allgatherv; the driver rounds counts so shards are
    equal) and bfloat16 through the MPI user op, measured and checked by the same Runner."""
    comm = ringcomm.init(timeout=TEST_TIMEOUT)
    mpi = MpiImpl(comm, "host", cuda_aware=False)
    runner = Runner(comm, [RingcommImpl(comm), mpi], Settings(iters=2, warmup=1))
    try:
        count = 16 * comm.size + 16
        cases = [
            runner.case("reduce_scatter", count, np.float32, ReduceOp.SUM, 0),
            runner.case("all_gather", count, np.int32, None, 0),
            runner.case("all_reduce", 1000, ringcomm.bfloat16, ReduceOp.MAX, 0),
            runner.case("reduce", 1000, ringcomm.bfloat16, ReduceOp.AVG, comm.size - 1),
        ]
        assert len({hi - lo for lo, hi in cases[0].bounds}) > 1
        for case in cases:
            for row in runner.run(case):
                assert [r.wrong for r in row.results.values()] == [0, 0], (case, row)
        # a shortest loop: fast calls run more than -n iterations, the same number on every rank
        runner.settings = Settings(iters=2, warmup=2, min_time=0.01)
        for row in runner.run(runner.case("all_reduce", 16, np.float32, ReduceOp.SUM, 0)):
            iters = [r.iters for r in row.results.values()]
            assert min(iters) > 2 and [r.wrong for r in row.results.values()] == [0, 0], row
            assert MPI.COMM_WORLD.allgather(iters) == [iters] * comm.size
        _check_rounds(runner)
    finally:
        runner.close()
        mpi.close()


def _check_rounds(runner: Runner) -> None:
    """--rounds 3: every implementation and mode measured once per round, interleaved, the check
    only in the last round, and each reports its fastest round (here: a round made slow on purpose
    is never the one reported, and the fastest of the others is)."""
    calls, real = [], runner._measure
    seen: dict[tuple[str, bool], list[float]] = {}

    def measure(name, case, arrays, inplace, prep, tdata, cdata, expected):
        calls.append((name, inplace, cdata is not None))
        m = real(name, case, arrays, inplace, prep, tdata, cdata, expected)
        m.times = m.times + 1.0 * (len(calls) % 3 == 1)  # (one round in three: a second slower)
        seen.setdefault((name, inplace), []).append(float(m.times[0]))
        return m

    runner._measure = measure
    runner.settings = Settings(iters=2, warmup=1, rounds=3)
    try:
        rows = runner.run(runner.case("all_reduce", 1000, np.float32, ReduceOp.SUM, 0))
    finally:
        del runner._measure
    impls = [row.impl for row in rows]
    assert calls == [(i, p, r == 2) for r in range(3) for i in impls for p in (False, True)], calls
    for row in rows:
        for inplace, res in zip((False, True), row.results.values()):
            assert res.wrong == 0, row
            mine = seen[row.impl, inplace]  # this rank's rounds; the row's time: the slowest rank's fastest round
            assert res.time_us < 1e6 and res.time_us >= min(mine) * 1e6 * 0.999999, (row, mine)


def _check_env_and_mpi_setup() -> list[str]:
    """The header's node layout against the host names (MPI's own allgather), gather_strings
    against the strings each rank gave, and the MPI baseline's communicator duplicate under a
    deadline: rank 0 alone creating an MpiImpl gets ringcomm.TimeoutError instead of hanging (a
    watchdog aborts the job if it hangs; the other ranks complete rank 0's abandoned MPI_Comm_idup
    well after the deadline, so nothing stays pending). Returns this rank's failures (collected,
    so no rank leaves its peers waiting)."""
    errors = []
    comm = ringcomm.init(timeout=TEST_TIMEOUT)
    hosts = MPI.COMM_WORLD.allgather(socket.gethostname())
    layout = env.node_layout(comm)
    if layout != (len(set(hosts)), max(hosts.count(h) for h in hosts)):
        errors.append(f"node_layout {layout} for hosts {hosts}")
    texts = [f"rank {r} {'ünïcode ' * r}" for r in range(comm.size)]
    got = env.gather_strings(comm, texts[comm.rank])
    if got != texts:
        errors.append(f"gather_strings gave {got}, expected {texts}")

    late = ringcomm.init()
    late.timeout = 0.3
    if late.rank == 0:
        dog = Watchdog(10.0, 0)  # a blocking duplicate would hang here: end the job instead
        dog.beat("MpiImpl() without its peers (must raise ringcomm.TimeoutError within 0.3 s)")
        try:
            MpiImpl(late, "host", cuda_aware=False)
            errors.append("MpiImpl() without its peers returned instead of timing out")
        except ringcomm.TimeoutError as e:
            if not str(e).startswith("MpiImpl(): rank 0 waited 0.3 s") or "duplicating" not in str(e):
                errors.append(f"MpiImpl() timed out with an unclear error: {e}")
        finally:
            dog.stop()
    else:
        time.sleep(1.0)
        dup, request = late.mpi.Idup()  # rank 0's abandoned duplicate may complete with this one
        deadline = time.monotonic() + 5.0
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(0.01)
    MPI.COMM_WORLD.Barrier()
    return errors


def _measured(group: dict) -> bool:
    return group["time"] is not None


@pytest.mark.parallel(nprocs=[2, 3])
def test_driver_tables_check_and_planted_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGCOMM_TIMEOUT", str(TEST_TIMEOUT))  # a failure ends in seconds, not minutes
    comm = MPI.COMM_WORLD
    nranks = comm.size
    path = tmp_path / "bench.json"

    rc, text = _run(["-c", "all", *SWEEP, "--json", str(path)])
    assert rc == 0
    rc_bad, bad = _run(["-c", "all", *SWEEP, "--corrupt-for-tests", str(PLANTED)])
    assert rc_bad == 1
    wide = tmp_path / "accumulate.json"  # float32 accumulation: in the header and the JSON, results checked
    rc_acc, acc = _run(["-c", "reduce_scatter", "-d", "half", "-a", "float32", *SWEEP, "--json", str(wide)])
    assert rc_acc == 0
    _check_paths_the_sweep_does_not_take()
    assert _check_env_and_mpi_setup() == []
    if comm.rank != 0:
        assert text == bad == ""  # only rank 0 prints
        return

    assert "# Accumulate: float32" in acc and "partial sums in float32" in acc
    assert json.loads(wide.read_text())["settings"]["accumulate"] == "float32"
    # the header names the algorithm that runs at each size (the small all-reduce's gather-fold, the
    # shared-memory window's, the ring)
    assert "# Algorithm: all_reduce up to 65536 B: gather-fold" in text and "reduce_scatter and reduce up to" in text
    if nranks == 2:  # the window's own limits at 2 ranks (the defaults' slots and inbox hold more)
        pair = communicator.SHARED_PAIR_LIMITS
        assert (
            f"broadcast up to {pair['broadcast']} B" in text
            and f"all_gather up to {pair['all_gather']} B a shard" in text
        ), text
    # (all-reduces stay in the window at every size: the default inbox holds N runs of SHARED_PIECE_BYTES)
    assert "; above: direct (shared memory: " in text and " B in pieces)" in text, text
    assert "above (not all_reduce): ring, and chain for broadcast and reduce" in text
    assert json.loads(path.read_text())["environment"]["small_bytes"] == 65536
    assert all(t.status == "OK" and t.wrong == 0 for t in parse_tables(acc))
    tables = parse_tables(text)
    assert len(tables) == len(schedule.COLLECTIVES)
    for table in tables:
        assert table.status == "OK" and table.wrong == 0 and table.avg_busbw is not None
        assert {r["impl"] for r in table.rows} == {"ringcomm", "mpi"}
        assert len({r["size"] for r in table.rows}) >= 2
        for row in table.rows:
            for mode in ("out-of-place", "in-place"):
                g = row[mode]
                if _measured(g):
                    assert g["#wrong"] == 0 and g["time"] > 0 and g["busbw"] >= 0
                    if row["impl"] == "mpi":
                        assert g["ratio"] is not None and g["ratio"] >= 0  # its value depends on the load
    broadcast = tables[schedule.COLLECTIVES.index("broadcast")]
    assert all(not _measured(r["out-of-place"]) and _measured(r["in-place"]) for r in broadcast.rows)
    doc = json.loads(path.read_text())
    assert doc["environment"]["ranks"] == nranks
    assert len(doc["rows"]) == sum(len(t.rows) for t in tables)

    planted_total = 0
    for table in parse_tables(bad):
        assert table.status == "FAILED"
        measured = 0
        for row in table.rows:
            for mode in ("out-of-place", "in-place"):
                g = row[mode]
                if not _measured(g):
                    continue
                # every rank's result has at least PLANTED elements at these sizes
                expected = PLANTED * nranks if row["impl"] == "ringcomm" else 0
                assert g["#wrong"] == expected, (row, mode)
                measured += expected
        assert table.wrong == measured > 0
        planted_total += measured
    assert planted_total > 0
