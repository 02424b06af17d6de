"""Shared test helpers: fresh random seeds agreed by all ranks, references, tolerances."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mpi_batches
import numpy as np
import pytest
from mpi4py import MPI

import ringcomm
from ringcomm.ops import FLOAT_DTYPES, INT_DTYPES, ReduceOp, bfloat16

#: a short deadline so that a failing multi-rank test ends in seconds instead of hanging
TEST_TIMEOUT = float(os.environ.get("RINGCOMM_TEST_TIMEOUT", "30"))


def shared_seed(mpi: MPI.Intracomm) -> int:
    """A fresh random seed, the same on every rank (printed, so a failure can be replayed)."""
    seed = mpi.bcast(int(os.environ.get("RINGCOMM_TEST_SEED", secrets.randbits(32))), root=0)
    if mpi.rank == 0:
        print(f"[ringcomm tests] seed {seed} (set RINGCOMM_TEST_SEED={seed} to replay)")
    return seed


def make_comm(**kw) -> ringcomm.Communicator:
    kw.setdefault("timeout", TEST_TIMEOUT)
    return ringcomm.Communicator(MPI.COMM_WORLD, **kw)


def deadline_barrier(mpi: MPI.Intracomm, timeout: float = TEST_TIMEOUT) -> None:
    """MPI barrier that fails (instead of hanging) when a rank does not arrive within ``timeout`` s."""
    import time

    req, end = mpi.Ibarrier(), time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > end:
            raise AssertionError(f"rank {mpi.rank}: a peer did not reach the barrier within {timeout} s")
        time.sleep(0.001)


def default_gpu_transport() -> str:
    """The transport GPU edges inside a node get in this run: RINGCOMM_TRANSPORT when the run sets
    one (a removed name as its replacement), else ipc."""
    from ringcomm.transports import RENAMED

    name = os.environ.get("RINGCOMM_TRANSPORT", "").strip().lower() or "ipc"
    return RENAMED.get(name, name)


@contextlib.contextmanager
def transport_env(name: str | None):
    """RINGCOMM_TRANSPORT set to ``name`` (unset for None) inside the block, restored after it."""
    before = os.environ.get("RINGCOMM_TRANSPORT")
    if name is None:
        os.environ.pop("RINGCOMM_TRANSPORT", None)
    else:
        os.environ["RINGCOMM_TRANSPORT"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RINGCOMM_TRANSPORT", None)
        else:
            os.environ["RINGCOMM_TRANSPORT"] = before


def random_input(rng: np.random.Generator, count: int, dtype: np.dtype, op: ReduceOp) -> np.ndarray:
    """Random data that never overflows the op over 5 ranks, with no all-zero or all-one pattern."""
    dtype = np.dtype(dtype)
    if dtype in INT_DTYPES:
        lo = 0 if dtype.kind == "u" else -1
        if op is ReduceOp.PROD:
            vals = rng.integers(lo * 2, 3, count)
        else:
            vals = rng.integers(lo * 20, 21, count)
        return vals.astype(dtype)
    if op is ReduceOp.PROD:  # magnitudes near 1 so products stay in range for float16
        vals = rng.uniform(0.5, 1.5, count) * rng.choice([-1.0, 1.0], count)
    else:
        vals = rng.standard_normal(count) * 4
    return vals.astype(dtype)


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """The reduction of float64 copies of every rank's input (ints: in their own type); it rounds for
    float64 data, which assert_matches allows for."""
    dtype = inputs[0].dtype
    if dtype in INT_DTYPES:
        stack = np.stack(inputs)
        with np.errstate(over="ignore"):
            return {
                ReduceOp.SUM: lambda: stack.sum(0, dtype=dtype),
                ReduceOp.PROD: lambda: stack.prod(0, dtype=dtype),
                ReduceOp.MIN: lambda: stack.min(0),
                ReduceOp.MAX: lambda: stack.max(0),
            }[op]()
    stack = np.stack([a.astype(np.float64) for a in inputs])
    return {
        ReduceOp.SUM: lambda: stack.sum(0),
        ReduceOp.AVG: lambda: stack.sum(0) / len(inputs),
        ReduceOp.PROD: lambda: stack.prod(0),
        ReduceOp.MIN: lambda: stack.min(0),
        ReduceOp.MAX: lambda: stack.max(0),
    }[op]()


def unit_roundoff(dtype: np.dtype) -> float:
    """u = 2**-p for a float type with p significand bits (float16 2^-11, bfloat16 2^-8)."""
    return {
        np.dtype(np.float16): 2.0**-11,
        bfloat16: 2.0**-8,
        np.dtype(np.float32): 2.0**-24,
        np.dtype(np.float64): 2.0**-53,
    }[np.dtype(dtype)]


def assert_matches(got: np.ndarray, inputs: list[np.ndarray], op: ReduceOp, what: str) -> None:
    """Ints and MIN/MAX exactly; SUM/AVG within N·u·Σ|x| (+ u·|ref|), PROD within (N+1)·u·|ref|.

    That is the classical bound for recursive summation in any order, with one more rounding for
    the result; it holds for every order the ring may use. The float64 reference is rounded too, so
    its own bound (the same with u = 2^-53) is added: for float64 data it is as large as ours.
    """
    ref = reference(inputs, op)
    if inputs[0].dtype in INT_DTYPES or op in (ReduceOp.MIN, ReduceOp.MAX):
        ok = got.astype(np.float64) == ref.astype(np.float64)
        bad = np.flatnonzero(~ok)
        assert bad.size == 0, f"{what}: {bad.size} wrong, first at {bad[:5]}: got {got[bad[:5]]}, want {ref[bad[:5]]}"
        return
    n = len(inputs)
    g = got.astype(np.float64)
    scale = np.sum([np.abs(a.astype(np.float64)) for a in inputs], axis=0)
    if op is ReduceOp.AVG:
        scale = scale / n

    def bound(u: float) -> np.ndarray:
        if op is ReduceOp.PROD:
            return (n + 1) * u * np.abs(ref)
        return n * u * scale + u * np.abs(ref)

    tol = bound(unit_roundoff(inputs[0].dtype)) + bound(unit_roundoff(np.float64))
    err = np.abs(g - ref)
    bad = np.flatnonzero(~(err <= tol * 1.0000001 + np.finfo(np.float64).tiny))
    assert bad.size == 0, (
        f"{what}: {bad.size} of {got.size} outside tolerance, first at {bad[:5]}: got {g[bad[:5]]}, "
        f"want {ref[bad[:5]]}, tol {tol[bad[:5]]}"
    )


def gather_all(mpi: MPI.Intracomm, a: np.ndarray) -> list[np.ndarray]:
    """Every rank's array (any sizes), gathered on every rank through MPI as raw bytes."""
    raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    sizes = mpi.allgather(raw.size)
    buf = np.empty(sum(sizes), np.uint8)
    mpi.Allgatherv(raw, [buf, sizes])
    out, start = [], 0
    for s in sizes:
        out.append(buf[start : start + s].view(a.dtype))
        start += s
    return out


def assert_identical_on_all_ranks(mpi: MPI.Intracomm, a: np.ndarray, what: str) -> None:
    """The bytes of ``a`` are the same on every rank."""
    everyone = gather_all(mpi, a)
    for r, b in enumerate(everyone):
        assert b.view(np.uint8).tobytes() == everyone[0].view(np.uint8).tobytes(), (
            f"{what}: rank {r} differs from rank 0"
        )


DTYPES = FLOAT_DTYPES + INT_DTYPES


def ops_for(dtype: np.dtype) -> list[ReduceOp]:
    return [op for op in ReduceOp if not (op is ReduceOp.AVG and np.dtype(dtype) in INT_DTYPES)]


def require_gpu():
    """(cupy, number of GPUs) for a GPU test module; skips the whole module without CuPy or a GPU."""
    cupy = pytest.importorskip("cupy")
    try:
        ngpu = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver
        ngpu = 0
    if ngpu == 0:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cupy, ngpu


@pytest.fixture
def seed(request) -> int:
    if mpi_batches.batched(request.node):  # the test runs in a launch, with a seed (printed) of its own
        return 0
    return shared_seed(MPI.COMM_WORLD)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A rank whose part of a multi-rank test failed leaves its peers waiting in the test's next MPI
    call (a reference gather, a barrier) for ever, and its own report, printed at the end of its
    session, is never seen: print it now, then abort every rank, so the test fails with the reason."""
    report = (yield).get_result()
    mpi_batches.report(item, report)
    world = MPI.COMM_WORLD
    if report.failed and world.size > 1 and item.get_closest_marker("parallel") is not None:
        sys.stderr.write(
            f"\n[ringcomm tests] rank {world.rank} of {world.size}: {item.nodeid} failed ({report.when}); aborting "
            f"every rank (the others would wait for it):\n{report.longreprtext}\n"
        )
        sys.stderr.flush()
        world.Abort(1)


@pytest.hookimpl(trylast=True)
def pytest_runtest_setup(item):
    mpi_batches.runtest_setup(item)


# ------------------------------------------------------------------------------- the emulated GPU
ROOT = Path(__file__).resolve().parent.parent
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def real_cupy() -> bool:
    """Whether a real CuPy is installed (then GPU tests run on the GPU, not on the emulated one)."""
    try:
        import cupy
    except ImportError:
        return False
    return not getattr(cupy, "_emulated", False)


def why_not_emulated() -> str:
    """Why processes on the emulated GPU (tests/emulated) cannot run here; "" when they can."""
    if CXX is None:
        return "no host C++ compiler found"
    if shutil.which("mpiexec") is None:
        return "no mpiexec"
    return "CuPy is installed: these run on the GPU" if real_cupy() else ""


#: the builds of tests/csrc_harness.cpp a session uses, by name: "plain" (the emulated GPU's kernels, the
#: kernels' arithmetic on the host: test_csrc_host, test_zero) and "cupy options" (optimizer.cu's and
#: accumulate.cu's float arithmetic as CuPy's NVRTC options make it: test_csrc_host's lib_cupy)
HARNESS_BUILDS = {"plain": (), "cupy options": ("-DRC_HOST_CUPY_OPTIONS",)}


@pytest.fixture(scope="session")
def harness_libraries(tmp_path_factory):
    """tests/csrc_harness.cpp as a shared library, each of HARNESS_BUILDS built once per session, all
    started at once, side by side (about 13 s each on one core): by name, the future of its path
    (``.result()`` waits for that build, and fails on its errors alone); -ffp-contract=off: the host
    compiler fuses nothing itself. Skipped without a host C++ compiler."""
    if CXX is None:
        pytest.skip("no host C++ compiler found")
    folder = tmp_path_factory.mktemp("harness")

    def build(name: str) -> Path:
        lib = folder / f"libringcomm_harness_{name.replace(' ', '_')}.so"
        cmd = [CXX, "-std=c++20", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-Wno-unknown-pragmas"]
        cmd += [*HARNESS_BUILDS[name], str(ROOT / "tests" / "csrc_harness.cpp"), "-o", str(lib)]
        done = run_beside(cmd, timeout=300)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"
        return lib

    with ThreadPoolExecutor(max_workers=len(HARNESS_BUILDS)) as pool:
        yield {name: pool.submit(build, name) for name in HARNESS_BUILDS}


@pytest.fixture(scope="session")
def emulated_gpu_env(request) -> dict[str, str]:
    """The environment of a process that sees the emulated GPU: tests/emulated first on
    PYTHONPATH, the kernels' C++ harness (tests/csrc_harness.cpp, built once per session)."""
    why = why_not_emulated()
    if why:
        pytest.skip(why)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "tests" / "emulated"), str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")]
    )
    env["RINGCOMM_EMULATED_HARNESS"] = str(request.getfixturevalue("harness_libraries")["plain"].result())
    env.setdefault("RINGCOMM_TEST_TIMEOUT", "60")
    env.pop("RINGCOMM_TRANSPORT", None)
    return env


_SPAWN = threading.Lock()


def run_beside(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) for commands run side by side from several
    threads: each is started under one lock (started from two threads at once, CPython 3.11's vfork
    start failed now and then on the CI machine with "OSError: [Errno 14] Bad address"), then runs
    beside the others."""
    with _SPAWN:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_emulated(env: dict[str, str], cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` (python is this interpreter) in the repository root, in ``env``; output captured."""
    return subprocess.run(
        [sys.executable if c == "python" else c for c in cmd],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
