"""benchmarks/gpu_check.sh on the CPU (issue 8, item 8): it cannot run its steps here, but its plan and its
set-up can be checked. The steps' limits add up to at most the budget (so no step is cut or skipped for time),
the budget leaves room to rerun within a 10-minute device call, a missing requirement stops the check at once
with one clear line, and the set-up, run against the CuPy stand-in (tests/emulated), prints what the results
depend on: compute mode, /dev/shm, driver, CUDA, CuPy, NCCL, and whether mpiexec is mpi4py's MPI.

NCCL 2.30 carried in .nccl/ (issue 33, item 11): the set-up unpacks it and reads its ncclGetVersion (here a
stand-in library built by the test, packed as the real one is), says so when it is absent, incomplete or broken,
and removes what it unpacked at exit; the script smoke-tests it before the bench steps, which name it in
RINGCOMM_NCCL_LIB only after the smoke test passed.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import CXX

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
DEVICE_CALL_S = 600  # the most one device command may run
NCCL_XZ = "libnccl-2.30.7-sm90.so.xz"  # as in /work/shared/nccl
NCCL_SHA256 = "970b6e2064d966bfe2ca7130c8ec6ca0d3163a590e117b2839b46ec00f4d519b"  # its README: the unpacked library


def _run(env_extra: dict, tmp_path: Path, timeout: float = 60) -> tuple[int, str]:
    """Run the script in its own process group (killed whole on a timeout); (rc, stdout + stderr)."""
    env = dict(os.environ)
    env.update({"OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "GPU_CHECK_NO_INSTALL": "1", **env_extra})
    for name in ("GPU_CHECK_BUDGET", "CUDA_MPS_PIPE_DIRECTORY", "WHEELS", "GPU_CHECK_NCCL_DIR", "RINGCOMM_NCCL_LIB"):
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


# ------------------------------------------------------------------------------------- NCCL 2.30 carried


def _carried_nccl(folder: Path, xz: bytes | None, smoke: bool = True) -> Path:
    """``folder`` laid out as a session's .nccl/: the .xz (``xz``'s bytes; None: absent) and the smoke test."""
    folder.mkdir(parents=True)
    if xz is not None:
        (folder / NCCL_XZ).write_bytes(xz)
    if smoke:
        (folder / "gpu_smoke_test.py").write_text("raise SystemExit('not run by the set-up')\n")
    return folder


@pytest.mark.skipif(shutil.which("mpiexec") is None or CXX is None, reason="no mpiexec or no C++ compiler")
def test_setup_unpacks_the_carried_nccl_and_reads_its_version(tmp_path):
    source = tmp_path / "nccl.cpp"
    source.write_text('extern "C" int ncclGetVersion(int *v) { *v = 23007; return 0; }\n')
    lib = tmp_path / "libnccl.so.2"
    cmd = [CXX, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", str(source), "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    folder = _carried_nccl(tmp_path / "carried", lzma.compress(lib.read_bytes(), format=lzma.FORMAT_XZ))
    env = {"GPU_CHECK_SETUP_ONLY": "1", "GPU_CHECK_NCCL_DIR": str(folder), "PYTHONPATH": _emulated_path(tmp_path)}
    rc, out = _run(env, tmp_path)
    assert rc == 0, out
    got = re.search(
        rf"NCCL carried: {re.escape(str(folder / NCCL_XZ))} unpacked to (/tmp/ringcomm_nccl\.\w+)/libnccl\.so\.2 "
        rf"\(0 MiB, WARNING: sha256 [0-9a-f]{{64}}, not the README's {NCCL_SHA256}\), ncclGetVersion 23007; step 2 "
        r"smoke-tests it, then the bench's NCCL rows use it$",
        out,
        re.M,
    )
    assert got, out
    assert not os.path.exists(got.group(1)), "the unpacked NCCL outlived the script"
    assert out.strip().splitlines()[-1].endswith("GPU_CHECK_SETUP_ONLY=1: no steps run"), out


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_setup_says_when_no_usable_nccl_was_carried(tmp_path):
    """Absent, incomplete or corrupt: one line each, and the bench falls back to CuPy's NCCL."""
    path = _emulated_path(tmp_path)
    cases = [
        (tmp_path / "absent", rf"NCCL carried: none \({re.escape(str(tmp_path / 'absent'))} absent; to measure NCCL "),
        (
            _carried_nccl(tmp_path / "no_smoke", b"", smoke=False),
            r"NCCL carried: \S+/no_smoke lacks libnccl-2\.30\.7-sm90\.so\.xz or gpu_smoke_test\.py ",
        ),
        (
            _carried_nccl(tmp_path / "corrupt", b"\xfd7zXZ\x00 this is no xz stream"),
            rf"NCCL carried: \S+/corrupt/{re.escape(NCCL_XZ)} could not be unpacked or loaded \(see the log\)",
        ),
    ]
    for folder, pattern in cases:
        rc, out = _run({"GPU_CHECK_SETUP_ONLY": "1", "GPU_CHECK_NCCL_DIR": str(folder), "PYTHONPATH": path}, tmp_path)
        assert rc == 0, out
        lines = [line for line in out.splitlines() if "NCCL carried:" in line]
        assert len(lines) == 1 and re.search(pattern, lines[0]), (pattern, out)
        assert lines[0].endswith("the bench uses CuPy's NCCL"), lines[0]


def test_the_bench_steps_use_the_carried_nccl_only_after_its_smoke_test():
    text = SCRIPT.read_text()
    lines = text.splitlines()
    # the header says how a session carries it: the copy from /work/shared/nccl into .nccl/, and the carry list
    head = "\n".join(line for line in lines if line.startswith("#"))
    copy = "mkdir -p .nccl && cp /work/shared/nccl/libnccl-2.30.7-sm90.so.xz /work/shared/nccl/gpu_smoke_test.py .nccl/"
    assert f"#   {copy}" in lines and '#   carry: [".nccl", "wheels"]' in lines, head
    assert "NCCL_DIR=${GPU_CHECK_NCCL_DIR:-$ROOT/.nccl}" in text
    # .nccl/ is git-ignored, so a session's copy never lands in a commit
    ignored = subprocess.run(["git", "check-ignore", "-q", ".nccl/" + NCCL_XZ], cwd=ROOT, timeout=30)
    if ignored.returncode == 128:  # not a git checkout
        assert "/.nccl/" in (ROOT / ".gitignore").read_text().split()
    else:
        assert ignored.returncode == 0, ".nccl/ is not git-ignored"
    # order: the smoke test (its output in $OUT), then the bench steps; RINGCOMM_NCCL_LIB is set only when it passed
    smoke = text.index('step "nccl smoke"')
    assert smoke < text.index("step compile") < text.index('step "ringcomm-bench"') < text.index('step "one-kernel')
    assert re.search(
        r"NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN \$PY '\$NCCL_SMOKE' '\$NCCL_LIB' \\\n\s+"
        r"2>&1 \| tee '\$OUTDIR/nccl_smoke.txt'",
        text,
    )
    assigned = [m.start() for m in re.finditer(r"^\s*NCCL_ENV=", text, re.M)]
    assert len(assigned) == 2 and text[assigned[0] :].startswith('NCCL_ENV=""'), assigned
    passed = text.index('if [ "${RCS[-1]}" = 0 ]; then', smoke)
    assert smoke < passed < assigned[1] < text.index("else", passed)
    assert text[assigned[1] :].split("\n")[0].strip() == (
        'NCCL_ENV="RINGCOMM_NCCL_LIB=$NCCL_LIB NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN"'
    )
    # every mpiexec of the bench steps (and the graph replay's) runs with it (and only those: the tests keep
    # CuPy's NCCL)
    bench = [line for line in lines if "mpiexec" in line and ("ringcomm.bench" in line or "graph replay" in line)]
    assert len(bench) == 3 and all(
        re.search(r"\$NCCL_ENV RINGCOMM_\w+=\S+ (RINGCOMM_\w+=\S+ )?mpiexec", b) for b in bench
    )
    assert text.count("$NCCL_ENV") == 3


_STUB = '''#!{python}
"""The interpreter the steps see: logs each step's command (and the NCCL it would load) to {calls}, then
exits 0 (the smoke test: $STUB_SMOKE_RC); the set-up's probes and the summary run on the real interpreter."""
import json, os, sys

args = sys.argv[1:]
if args[:1] == ["-"] or (args[:1] == ["-c"] and "warm_up" not in args[1]):
    os.execv({python!r}, [{python!r}, *args])
env = os.environ
call = {{"args": args, "lib": env.get("RINGCOMM_NCCL_LIB"), "multi": env.get("NCCL_MULTI_RANK_GPU_ENABLE")}}
with open({calls!r}, "a") as f:
    f.write(json.dumps(call) + "\\n")
smoke = bool(args) and args[0].endswith("gpu_smoke_test.py")
sys.exit(int(os.environ.get("STUB_SMOKE_RC", "0")) if smoke else 0)
'''


@pytest.mark.skipif(shutil.which("mpiexec") is None or CXX is None, reason="no mpiexec or no C++ compiler")
@pytest.mark.parametrize("carried", ["smoke test passes", "smoke test fails", "none"])
def test_every_step_with_the_carried_nccl_or_without(tmp_path, carried):
    """The whole script with every step's command stubbed (the interpreter the steps run logs what it was asked
    and which NCCL it would load): the smoke test gets the unpacked library; the bench's mpiexec runs, and only
    they, name it in RINGCOMM_NCCL_LIB with NCCL_MULTI_RANK_GPU_ENABLE=1 when the smoke test passed; otherwise
    they run on CuPy's NCCL, and the summary says which."""
    calls = tmp_path / "calls.jsonl"
    stub = tmp_path / "python"
    stub.write_text(_STUB.format(python=sys.executable, calls=str(calls)))
    stub.chmod(0o755)
    folder = tmp_path / "none"
    if carried != "none":
        source = tmp_path / "nccl.cpp"
        source.write_text('extern "C" int ncclGetVersion(int *v) { *v = 23007; return 0; }\n')
        lib = tmp_path / "libnccl.so.2"
        cmd = [CXX, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", str(source), "-o", str(lib)]
        assert subprocess.run(cmd, capture_output=True, text=True, timeout=120).returncode == 0
        folder = _carried_nccl(tmp_path / "carried", lzma.compress(lib.read_bytes(), format=lzma.FORMAT_XZ))
    env = {
        "PYTHON": str(stub),
        "GPU_CHECK_NCCL_DIR": str(folder),
        "PYTHONPATH": _emulated_path(tmp_path),
        "STUB_SMOKE_RC": "1" if carried == "smoke test fails" else "0",
    }
    rc, out = _run(env, tmp_path, timeout=240)
    log = [json.loads(line) for line in calls.read_text().splitlines()]
    smoke = [c for c in log if c["args"][0].endswith("gpu_smoke_test.py")]
    bench = [c for c in log if c["args"][:2] == ["-m", "ringcomm.bench"] or "graph_replay.py" in c["args"][0]]
    others = [c for c in log if c not in smoke and c not in bench]
    # ringcomm-bench at N = 2; ipc, kernel and kernel without one-shot at N = 2 and 4; the graph replay at N = 2
    assert len(bench) == 2 + 3 * (2 + 4) + 2, log
    assert others and all(c["lib"] is None for c in others), others  # the tests and other benchmarks: CuPy's NCCL
    if carried == "none":
        assert rc == 0 and smoke == [], out
        assert "== nccl smoke: not run (no NCCL carried): the bench's NCCL rows use CuPy's NCCL" in out
        assert all(c["lib"] is None for c in bench), bench
        assert "the bench's NCCL rows: CuPy's NCCL\n" in out, out
        return
    (call,) = smoke
    unpacked = call["args"][1]
    assert re.fullmatch(r"/tmp/ringcomm_nccl\.\w+/libnccl\.so\.2", unpacked) and call["multi"] == "1", call
    assert not os.path.exists(unpacked), "the unpacked NCCL outlived the script"
    with tarfile.open(tmp_path / "out" / "results.tgz") as tgz:  # what a device call brings back
        assert "nccl_smoke.txt" in tgz.getnames(), tgz.getnames()
    if carried == "smoke test passes":
        assert rc == 0, out
        assert all(c["lib"] == unpacked and c["multi"] == "1" for c in bench), bench
        assert f"the bench's NCCL rows: NCCL 2.30.7 carried in {folder} (RINGCOMM_NCCL_LIB={unpacked}; its smoke" in out
    else:
        assert rc == 1, out  # a step failed
        assert all(c["lib"] is None for c in bench), bench
        assert "the bench's NCCL rows: CuPy's NCCL (the carried NCCL failed its smoke test: " in out, out
        assert re.search(r"^nccl smoke\s+1\s+\d+\s+20$", out, re.M), out
