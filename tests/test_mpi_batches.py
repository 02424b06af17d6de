"""The launches of tests/mpi_batches.py report what the ranks saw: a pass, a failure on one rank (with
its output), a test after a failure (run again), a rank that dies mid-test, a skip, a test alone."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

from conftest import ROOT

MODULE = """
import os
import sys
import time

import pytest
from mpi4py import MPI


@pytest.mark.parallel(nprocs=[2])
def test_a_passes():
    assert MPI.COMM_WORLD.allreduce(1) == 2


@pytest.mark.parallel(nprocs=[2])
def test_b_fails_on_rank_1():
    print("[b] printed by the failing rank")
    assert MPI.COMM_WORLD.rank == 0, "rank 1 disagrees"


@pytest.mark.parallel(nprocs=[2])
def test_c_after_the_failure_passes():
    assert MPI.COMM_WORLD.allreduce(1) == 2


@pytest.mark.parallel(nprocs=[2])
def test_d_a_rank_dies():
    MPI.COMM_WORLD.barrier()
    if MPI.COMM_WORLD.rank == 1:
        sys.stdout.flush()
        os._exit(7)
    MPI.COMM_WORLD.barrier()


@pytest.mark.parallel(nprocs=[2])
def test_e_skips():
    pytest.skip("not here")


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.alone
def test_f_alone_sees_fresh_processes():
    assert "SEEN" not in os.environ
    os.environ["SEEN"] = "1"


@pytest.mark.parallel(nprocs=[2])
def test_g_shares_the_launch():
    assert "SEEN" not in os.environ
    os.environ["SEEN"] = "1"
    if MPI.COMM_WORLD.rank == 1:
        time.sleep(1)  # (its duration: its slowest rank's)


@pytest.mark.parallel(nprocs=[2])
def test_h_after_g_sees_its_change():
    assert os.environ.get("SEEN") == "1"
"""


def test_every_outcome_reaches_the_test_that_had_it():
    path = ROOT / "tests" / f"_batch_selftest_{uuid.uuid4().hex[:8]}.py"  # (the real conftest applies)
    path.write_text(MODULE)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-v",
                "-p",
                "no:cacheprovider",
                "--durations=0",
                str(path.relative_to(ROOT)),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != "RINGCOMM_TEST_BATCH"},
        )
    finally:
        path.unlink()
    out = done.stdout + done.stderr
    got = dict(re.findall(r"::(test_\w+) (PASSED|FAILED|SKIPPED)", out))
    assert got == {
        "test_a_passes": "PASSED",
        "test_b_fails_on_rank_1": "FAILED",
        "test_c_after_the_failure_passes": "PASSED",
        "test_d_a_rank_dies": "FAILED",
        "test_e_skips": "SKIPPED",
        "test_f_alone_sees_fresh_processes": "PASSED",
        "test_g_shares_the_launch": "PASSED",
        "test_h_after_g_sees_its_change": "PASSED",
    }, out
    assert "rank 1, call" in out and "rank 1 disagrees" in out and "[b] printed by the failing rank" in out, out
    assert "the launch ended while it ran" in out, out
    assert "not here" in out and "Skipped: Skipped" not in out, out
    # each test's duration is its own (the first of a launch does not carry the launch's)
    took = {name: float(t) for t, name in re.findall(r"([\d.]+)s call\s+\S+::(test_\w+)", out)}
    assert took.get("test_g_shares_the_launch", 0) >= 1 and took.get("test_a_passes", 0) < 0.5, out
    assert took.get("test_d_a_rank_dies", 0) > 0.5, out  # (its launch's time: it ended in it)
    assert done.returncode == 1, out


SLEEPER = """
import os
import time

import pytest
from mpi4py import MPI


@pytest.mark.parallel(nprocs=[2])
def test_sleeps():
    open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w").close()
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_terminated_session_ends_its_launch(tmp_path):
    """timeout(1) ends a test step's pytest with SIGTERM; the mpiexec of its launch, in a session of
    its own, and the ranks under it end with it, instead of running on into what comes next. With
    RINGCOMM_TEST_REPORTS set (gpu_check.sh does), what the ranks reported until then is kept there."""
    path = ROOT / "tests" / f"_batch_selftest_{uuid.uuid4().hex[:8]}.py"
    path.write_text(SLEEPER)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RINGCOMM_TEST_BATCH"}
    try:
        session = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path.relative_to(ROOT))],
            cwd=ROOT, env={**env, "PIDS": str(pids), "RINGCOMM_TEST_REPORTS": str(tmp_path / "reports")},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline and session.poll() is None:
            time.sleep(0.1)
        ranks = [int(p.name) for p in pids.iterdir()]
        assert len(ranks) == 2, "the ranks never started"
        session.send_signal(signal.SIGTERM)
        assert session.wait(30) == -signal.SIGTERM
    finally:
        path.unlink()
    deadline = time.monotonic() + 10
    while any(map(_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, ranks)), f"ranks {ranks} outlived their session"
    kept = [json.loads(line) for f in (tmp_path / "reports").glob("*/launch1/rank*.jsonl") for line in f.open()]
    assert sorted((r["nodeid"].split("::")[1], r["when"]) for r in kept) == [("test_sleeps", "setup")] * 2, kept
