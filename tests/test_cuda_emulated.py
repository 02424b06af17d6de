"""The GPU tests (tests/gpu) on the CPU, through the CuPy stand-in in tests/emulated (no GPU needed).

The stand-in runs ringcomm's real kernels (tests/csrc_harness.cpp), real CUDA-IPC-style sharing
of memory between the ranks (shared memory), and lazy streams that run queued work only when
something waits for it; so the CUDA device, the IPC and staged transports, their handshakes and
the GPU tests themselves run end to end at N = 1, 2, 4. Skipped without a C++ compiler or mpiexec.
Where a real CuPy is installed, the GPU tests run on the GPU instead and this test is skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _real_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return not getattr(sys.modules["cupy"], "_emulated", False)


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler found")
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
@pytest.mark.skipif(_real_cupy(), reason="CuPy is installed: tests/gpu run on the GPU")
@pytest.mark.parametrize("variant", ["pool-exported", "scratch"])
def test_gpu_tests_pass_on_the_emulated_gpu(tmp_path, variant):
    lib = tmp_path / "libringcomm_harness.so"
    build = [CXX, "-std=c++17", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-Wno-unknown-pragmas",
             str(ROOT / "tests" / "csrc_harness.cpp"), "-o", str(lib)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "emulated"), str(ROOT), env.get("PYTHONPATH", "")])
    env["RINGCOMM_EMULATED_HARNESS"] = str(lib)
    env.setdefault("RINGCOMM_TEST_TIMEOUT", "60")
    env.pop("RINGCOMM_TRANSPORT", None)
    tests = [str(ROOT / "tests" / "gpu")]
    if variant == "scratch":  # pool blocks that cannot be exported: the IPC scratch-buffer path
        env["RINGCOMM_EMULATED_NO_IPC_POOL"] = "1"
        tests = [str(ROOT / "tests" / "gpu" / "test_cuda_collectives.py"), "-k", "every_op_and_dtype or back_to_back"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    summary = re.findall(r"(\d+) (passed|failed|skipped|error)", run.stdout.splitlines()[-1] if run.stdout else "")
    counts = {kind: int(n) for n, kind in summary}
    assert counts.get("passed", 0) >= 5 and not counts.get("skipped") and not counts.get("failed"), tail
