"""The fault matrix (tests/fault_matrix.py) at N = 2 and 3, on host arrays and on the emulated GPU.

With check=False, for every case where the ranks did not make the same call (count, dtype of
another or the same size, op, collective, a skipped call, root), every rank raises a RingcommError
subclass within a second, none returns normally, and the messages say which rank, step and peer.
A stuck peer (SIGSTOP): the ranks that wait on it time out after the timeout (TimeoutError), the
others are told at once (AbortError, naming the origin), and the stuck rank, once resumed, raises
too. A peer that exits: MPICH's mpiexec ends the whole job; nothing hangs past the timeout + 5 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
from conftest import ROOT, run_emulated

import ringcomm.errors

TIMEOUT = 2.0
ERRORS = {name for name in dir(ringcomm.errors) if name.endswith("Error")}
#: The case whose last-to-know ranks may see the error only after the propagation (slow CI: 1 s)
PROPAGATION = 1.0


def _env(device: str, request) -> dict:
    """The environment of the MPI job: the emulated GPU's for device "gpu" (or the real GPU's)."""
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    if device in ("gpu", "gpu-kernel"):
        env = dict(request.getfixturevalue("emulated_gpu_env"))
        if device == "gpu-kernel":  # every collective one kernel (ringcomm.executor): errors at the next sync
            env["RINGCOMM_TRANSPORT"] = "kernel"
        return env
    return {k: v for k, v in os.environ.items() if k != "RINGCOMM_TRANSPORT"}


def _matrix(env: dict, n: int, device: str, tmp_path) -> dict:
    out = tmp_path / "matrix.json"
    cmd = [
        "mpiexec",
        "-n",
        str(n),
        "python",
        str(ROOT / "tests" / "fault_matrix.py"),
        "--device",
        device.split("-")[0],
        "--timeout",
        str(TIMEOUT),
        "--json",
        str(out),
    ]
    run = run_emulated(env, cmd, 300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("device", ["host", "gpu", "gpu-kernel"])
@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_raises_and_says_why(n, device, request, tmp_path):
    env = _env(device, request)
    matrix = _matrix(env, n, device, tmp_path)
    by_case: dict[str, list[dict]] = {}
    for rec in matrix["records"]:
        by_case.setdefault(rec["case"], []).append(rec)
    assert set(by_case) == set(matrix["cases"]) | {"stuck peer"}
    for case, recs in by_case.items():
        assert sorted(r["rank"] for r in recs) == list(range(n)), case
        for rec in recs:
            what = f"{case}, rank {rec['rank']}: {rec['outcome']} after {rec['seconds']} s: {rec['message']}"
            assert rec["outcome"] in ERRORS, what  # a RingcommError subclass; nobody returned normally
            assert "rank" in rec["message"] and ("step" in rec["message"] or "set-up" in rec["message"]), what
            if case != "stuck peer":
                assert rec["outcome"] in ("MismatchError", "AbortError"), what
                assert rec["seconds"] < PROPAGATION, what
            elif rec.get("resumed"):  # the stopped rank, once resumed, is told at once
                assert rec["outcome"] == "AbortError" and rec["seconds"] < PROPAGATION, what
            else:  # a wait on the stopped rank times out; everyone else is told then
                assert rec["outcome"] in ("TimeoutError", "AbortError"), what
                assert TIMEOUT - 0.1 < rec["seconds"] < TIMEOUT + 2, what
            if rec["outcome"] == "AbortError":
                assert f"rank {rec['origin']} aborted the communicator" in rec["message"], what
        if case != "stuck peer":
            assert any(r["outcome"] == "MismatchError" for r in recs), f"{case}: nobody saw the mismatch: {recs}"
        else:
            assert any(r["outcome"] == "TimeoutError" for r in recs), recs


@pytest.mark.parametrize("device", ["host", "gpu"])
def test_a_peer_that_exits_ends_the_job(device, request):
    """MPICH's mpiexec (Hydra) ends the whole job when a rank exits before MPI_Finalize, killing the
    others: its own status is then that exit status or 9 (signal 9, "BAD TERMINATION"), as seen
    here from run to run: no survivor waits."""
    env = _env(device, request)
    for code in (3, 0):
        t0 = time.monotonic()
        run = run_emulated(
            {**env, "FAULT_EXIT_CODE": str(code)},
            [
                "mpiexec",
                "-n",
                "3",
                "python",
                str(ROOT / "tests" / "fault_matrix.py"),
                "--device",
                device,
                "--timeout",
                str(TIMEOUT),
                "--case",
                "exit",
            ],
            TIMEOUT + 60,
        )
        took = time.monotonic() - t0
        assert run.returncode in ((code, 9) if code else (0, 9)), (code, run.returncode, run.stdout, run.stderr)
        assert took < TIMEOUT + 5 + 10, f"exit {code}: the job took {took:.1f} s (start-up included)"
        for line in run.stdout.splitlines():  # a survivor that got as far as raising
            if line.startswith("RESULT "):
                assert json.loads(line[7:])["outcome"] in ERRORS, line


EXITS_AFTER_A_FAILED_KERNEL = """
import cupy
from mpi4py import MPI

import ringcomm

r = MPI.COMM_WORLD.rank
comm = ringcomm.Communicator(MPI.COMM_WORLD, timeout=2.0)
x = cupy.ones(1007 if r == 0 else 1000, cupy.float32)  # (the ranks' calls differ: every ring kernel fails)
comm.all_reduce(x)
print(f"rank {r} read {float(x.sum())}", flush=True)  # (a copy after the kernel: it has ended, its failure recorded)
"""


def test_a_kernel_failure_that_nothing_raised_is_said_at_exit(request):
    """A program whose last kernel call failed, and that ends after reading its result (no later
    call, check_errors() or close()): at exit every rank says on stderr that a ring kernel failed
    after its call returned, with the error, instead of ending as if all went well."""
    env = _env("gpu-kernel", request)
    run = run_emulated(env, ["mpiexec", "-n", "2", "python", "-c", EXITS_AFTER_A_FAILED_KERNEL], 120)
    assert run.returncode == 0, run.stdout + run.stderr
    said = [line for line in run.stderr.splitlines() if "a ring kernel failed after its call returned" in line]
    assert sorted(line.split(":")[1].strip() for line in said) == ["rank 0", "rank 1"], run.stderr
    assert all(re.search(r"(MismatchError|AbortError): all_reduce", line) for line in said), said
