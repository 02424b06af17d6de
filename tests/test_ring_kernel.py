"""csrc/ring.cu, the ring executor's kernel, on the CPU: its ranks as threads of one process
(tests/ring_selftest.cpp), built plainly and with ThreadSanitizer.

- Back-to-back all-reduces, reduce-scatters and all-gathers at N = 2..5 over counts 0, 1, N-1, 3,
  333 and 4099 (FIFO slots of 256 bytes, so the counters and the FIFO wrap many times), each result
  bitwise the ring's fold on every rank, the epoch advanced once per call.
- A rank that skips the last call: every other rank records a failure and returns (no hang).
- Under ThreadSanitizer the same run is clean; and a build whose acquire loads are relaxed, or whose
  release stores are, is reported as a data race: a kernel missing either fails here, not first on
  a GPU (x86 would hide it at run time: the weakened builds still compute the right results); the
  weakened builds run a shorter sequence (N = 2 and 3, three counts), which already races.

The emulated GPU (tests/test_cuda_emulated.py: the kernel transport's tests in tests/gpu) runs the
same kernel across processes, through ringcomm.executor.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import run_beside

ROOT = Path(__file__).resolve().parent.parent
SELFTEST = ROOT / "tests" / "ring_selftest.cpp"
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
BUILDS = {
    "plain": ["-O2"],
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
    "no acquire": ["-O1", "-g", "-fsanitize=thread", "-DRC_TEST_RELAXED_ACQUIRE"],
    "no release": ["-O1", "-g", "-fsanitize=thread", "-DRC_TEST_RELAXED_RELEASE"],
}

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler found")


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    """Every build of tests/ring_selftest.cpp (compiled side by side); a build the compiler cannot
    make (no ThreadSanitizer runtime) is left out, and its tests skip."""
    out = tmp_path_factory.mktemp("ring")

    def build(name: str) -> tuple[str, Path | None, str]:
        exe = out / name.replace(" ", "_")
        cmd = [CXX, "-std=c++20", "-ffp-contract=off", "-Wno-unknown-pragmas", "-pthread", *BUILDS[name]]
        done = run_beside([*cmd, str(SELFTEST), "-o", str(exe)], timeout=300)
        return name, exe if done.returncode == 0 else None, done.stderr

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        built = list(pool.map(build, BUILDS))
    name, exe, err = built[0]
    assert exe is not None, err  # the plain build must compile
    return {name: exe for name, exe, _ in built if exe is not None}


def _run(programs, build: str, *args: str) -> subprocess.CompletedProcess:
    if build not in programs:
        pytest.skip(f"{CXX} cannot build with ThreadSanitizer here")
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=0 exitcode=66"}
    return subprocess.run([str(programs[build]), *args], capture_output=True, text=True, timeout=300, env=env)


def test_every_call_is_the_rings_fold_on_every_rank(programs):
    run = _run(programs, "plain")
    assert run.returncode == 0 and run.stdout.startswith("ok 336"), run.stdout + run.stderr


def test_a_rank_that_skips_a_call_ends_in_a_recorded_failure(programs):
    run = _run(programs, "plain", "timeout")
    assert run.returncode == 0 and "ok timeout" in run.stdout, run.stdout + run.stderr


def test_thread_sanitizer_finds_no_race(programs):
    run = _run(programs, "tsan")
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]
    assert run.returncode == 0 and run.stdout.startswith("ok 336"), run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("build", ["no acquire", "no release"])
def test_a_missing_acquire_or_release_is_a_reported_race(programs, build):
    run = _run(programs, build, "short")  # (N = 2 and 3: each reported race costs ThreadSanitizer time)
    assert "WARNING: ThreadSanitizer: data race" in run.stderr, (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 66


def test_the_executor_lays_out_memory_and_reads_failures_as_ring_cu_does():
    """ringcomm/executor.py's copies of csrc/ring.cu's constants: the FIFO's offset, the one-shot
    ranks, the error record's size, the failure kinds."""
    from ringcomm import executor

    text = (ROOT / "csrc" / "ring.cu").read_text()
    assert (
        "#define RC_RING_FIFO_OFFSET(C) ((((3 * (C) + 1 + 2 * (C) * RC_ONESHOT_MAX_RANKS) * 128) + 4095) / 4096 * 4096)"
        in text
    )
    assert f"#define RC_ONESHOT_MAX_RANKS {executor.ONESHOT_MAX_RANKS}\n" in text
    assert [executor.fifo_offset(c) for c in (1, 2, 8)] == [4096, 8192, 20480]
    assert f"#define RC_RING_ERR_WORDS {executor.ERR_WORDS}\n" in text
    assert f"#define RC_RING_ABORTED {executor.ABORTED}\n" in text
    assert f"#define RC_RING_MISMATCH {executor.MISMATCH}\n" in text
