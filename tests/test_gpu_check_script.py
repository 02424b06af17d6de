"""benchmarks/gpu_check.sh on the CPU (issue 8, item 8): it cannot run its steps here, but its plan and its
set-up can be checked. The steps' limits add up to at most the budget (so no step is cut or skipped for time),
the budget leaves room to rerun within a 10-minute device call, a missing requirement stops the check at once
with one clear line, and the set-up, run against the CuPy stand-in (tests/emulated), prints what the results
depend on: compute mode, /dev/shm, driver, CUDA, CuPy, NCCL, and whether mpiexec is mpi4py's MPI.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
DEVICE_CALL_S = 600  # the most one device command may run


def _run(env_extra: dict, tmp_path: Path, timeout: float = 60) -> tuple[int, str]:
    """Run the script in its own process group (killed whole on a timeout); (rc, stdout + stderr)."""
    env = dict(os.environ)
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, GPU_CHECK_NO_INSTALL="1", **env_extra)
    for name in ("GPU_CHECK_BUDGET", "CUDA_MPS_PIPE_DIRECTORY", "WHEELS"):
        if name not in env_extra:
            env.pop(name, None)
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"gpu_check.sh ran past {timeout} s (it should have stopped after its set-up):\n{out[-3000:]}")
    return proc.returncode, out


def _emulated_path(tmp_path: Path) -> str:
    """PYTHONPATH with the CuPy stand-in first, and a stand-in cuda.bindings.driver where none is importable
    (the check requires NVIDIA's cuda-bindings)."""
    shim = tmp_path / "shim"
    (shim / "cuda" / "bindings").mkdir(parents=True)
    (shim / "cuda" / "__init__.py").write_text("")
    (shim / "cuda" / "bindings" / "__init__.py").write_text("")
    (shim / "cuda" / "bindings" / "driver.py").write_text('"""Placeholder for the set-up check only."""\n')
    return os.pathsep.join([str(ROOT / "tests" / "emulated"), str(shim), os.environ.get("PYTHONPATH", "")])


def test_script_parses():
    run = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr


def test_limits_fit_the_budget_and_the_budget_a_device_call():
    text = SCRIPT.read_text()
    budget = int(re.search(r"BUDGET=\$\{GPU_CHECK_BUDGET:-(\d+)\}", text).group(1))
    plan = re.search(r"\nPLAN=\(\n(.*?)\n\)", text, re.S)
    assert plan, "no PLAN=( ... ) table of the steps' limits"
    limits = {m.group(1): int(m.group(2)) for m in re.finditer(r'"(.+) (\d+)"', plan.group(1))}
    assert sum(limits.values()) <= budget, limits
    assert budget <= DEVICE_CALL_S * 0.7, "no room to rerun the check within one device call"
    # every step the script runs has its limit in the plan
    used = set(re.findall(r'^\s*(?:step|run_tests) (?:"([^"$]+)"|([^"$\s]+)) ', text, re.M))
    used = {a or b for a, b in used}
    assert used and used <= set(limits), (used, set(limits))


def test_a_budget_below_the_limits_stops_before_anything_runs(tmp_path):
    rc, out = _run({"GPU_CHECK_BUDGET": "300", "PYTHONPATH": _emulated_path(tmp_path)}, tmp_path)
    assert rc == 2, out
    assert re.search(r"gpu_check: the steps' limits add up to \d+s, more than the budget of 300s", out), out
    assert len(out.strip().splitlines()) == 1, out


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_setup_dry_run_prints_what_the_results_depend_on(tmp_path):
    rc, out = _run({"GPU_CHECK_SETUP_ONLY": "1", "PYTHONPATH": _emulated_path(tmp_path)}, tmp_path)
    assert rc == 0, out
    assert re.search(r"budget 420s; the steps' limits add up to (\d+)s", out), out
    want = [
        r"GPU: nvidia-smi not found \(compute mode and driver unknown\)"
        if shutil.which("nvidia-smi") is None
        else r"GPU \(index, name, memory, driver, compute mode",
        r"MPS: (no control daemon|a control daemon runs)",
        r"/dev/shm: \S+ size, \S+ free",
        r"CUDA: driver supports 13\.0, runtime 13\.0; CuPy 0\.0\+ringcomm-emulated; 1 GPU\(s\)",
        r"NCCL: 2\.30\.7 \(CuPy built with 2\.30\.7\)",
        r"mpiexec: \S+: \S+.*; the library: .*; match: yes",
        r"set-up done in \d+s \(limit \d+s\); GPU_CHECK_SETUP_ONLY=1: no steps run",
    ]
    for pattern in want:
        assert re.search(pattern, out), (pattern, out)
    assert "MISSING" not in out


def test_something_missing_stops_the_check_with_one_line(tmp_path):
    gone = tmp_path / "gone" / "pytest_mpi"
    gone.mkdir(parents=True)
    (gone / "__init__.py").write_text("raise ImportError('mpi-pytest is not installed')\n")
    path = os.pathsep.join([str(tmp_path / "gone"), _emulated_path(tmp_path)])
    rc, out = _run({"PYTHONPATH": path}, tmp_path)
    assert rc == 2, out
    lines = [line for line in out.splitlines() if "MISSING" in line and "gpu_check:" in line]
    assert len(lines) == 1 and lines[0] == out.strip().splitlines()[-1], out
    assert re.search(
        r"gpu_check: MISSING mpi-pytest: carry the wheels \(the pip download command at the top of "
        r"benchmarks/gpu_check.sh\) in wheels/ and rerun$",
        lines[0],
    ), lines[0]
    # the command at the top names the wheels the H200 image lacks, and its header every other one the set-up
    # requires, with a version
    lines = SCRIPT.read_text().splitlines()
    command = next(line for line in lines if line.startswith("#   pip download"))
    for wheel in ("mpich", "mpi4py", "mpi-pytest"):
        assert re.search(rf" {re.escape(wheel)}==\S+", command), wheel
    header = " ".join(line for line in lines[:30] if line.startswith("#"))
    for wheel in (
        "ml_dtypes",
        "pytest",
        "iniconfig",
        "packaging",
        "pluggy",
        "pygments",
        "cuda-bindings",
        "cuda-pathfinder",
    ):
        assert re.search(rf" {re.escape(wheel)}==\S+", header), wheel
