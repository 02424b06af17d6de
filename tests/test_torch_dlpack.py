"""PyTorch tensors and other DLPack producers.

- Host: DLPack tensors of every dtype are viewed without a copy, bfloat16 included (as
  ``ml_dtypes.bfloat16``, which numpy.from_dlpack cannot make), checked with a DLPack producer of
  our own (tests/dlpack_producer.py: layouts, flags, strides, offsets, ownership) and with
  PyTorch CPU tensors where PyTorch is installed (skipped without it).
- GPU: a collective on a PyTorch CUDA tensor runs on PyTorch's current stream and imports the
  tensor by DLPack on the collective's stream; checked on the emulated GPU with a fake
  ``torch`` (tests/emulated_torch_streams.py, one rank, in a subprocess), and on a real GPU with
  PyTorch and CuPy where both are there.
"""

from __future__ import annotations

import gc
import importlib.util

import numpy as np
import pytest
from conftest import make_comm, real_cupy, run_emulated
from dlpack_producer import KDL_BFLOAT, KDL_FLOAT, Producer
from mpi4py import MPI

from ringcomm.arrays import classify
from ringcomm.ops import bfloat16

HAVE_TORCH = importlib.util.find_spec("torch") is not None
TORCH_DTYPES = ["float32", "float16", "bfloat16"]


@pytest.fixture(scope="module")
def comm():
    return make_comm()


def bf16(n: int, rng: np.random.Generator | None = None) -> np.ndarray:
    rng = rng or np.random.default_rng()
    return (rng.standard_normal(n) * 4).astype(bfloat16)


def bf16_producer(a: np.ndarray, **kw) -> Producer:
    """A DLPack bfloat16 tensor (kDLBfloat, 16 bits) over the memory of ``a``."""
    return Producer(a.view(np.uint16), code=KDL_BFLOAT, bits=16, **kw)


def released(*producers: Producer) -> bool:
    """Whether every tensor the producers exported has been deleted, exactly once (the arrays over
    them gone, the unconsumed capsules freed)."""
    for p in producers:
        p.drop_capsules()
    gc.collect()
    return all(p.exported == p.deleted for p in producers)


# ---------------------------------------------------------------------------------------- host
def test_the_test_producer_is_read_by_numpy():
    """The producer itself follows the spec: numpy.from_dlpack reads it, in both layouts."""
    base = np.random.default_rng().standard_normal(12).astype(np.float32)
    for versioned in (None, False):
        p = Producer(base, versioned=versioned)
        a = np.from_dlpack(p)
        assert np.shares_memory(a, base) and a.tobytes() == base.tobytes() and p.deleted == 0
        del a
        assert released(p)
    t = np.from_dlpack(Producer(base, shape=(3, 2), strides=(1, 3), byte_offset=4))
    assert t.tolist() == np.lib.stride_tricks.as_strided(base[1:], (3, 2), (4, 12)).tolist()
    assert not np.from_dlpack(Producer(base, readonly=True)).flags.writeable
    c = Producer(base)
    capsule = c.__dlpack__()
    del capsule  # never consumed: the capsule's destructor frees it, once
    assert released(c)


def test_bfloat16_dlpack_is_viewed_without_a_copy(comm):
    """numpy.from_dlpack raises 'Unsupported dtype in DLTensor' for bfloat16: ringcomm views it itself."""
    base = bf16(37)
    x = bf16_producer(base)
    kind, a = classify(x, "x")
    assert kind == "host" and a.dtype == bfloat16 and a.shape == (37,)
    assert a.__array_interface__["data"][0] == base.ctypes.data, "a copy was made"
    assert a.flags.writeable and x.calls[0]["max_version"] == (1, 0)
    del a
    assert released(x), "the deleter was not called once the array went"

    out = np.full(37, np.nan, bfloat16)
    y = bf16_producer(out)
    assert comm.all_reduce(x, out=y) is y
    assert out.tobytes() == base.tobytes()  # the result is in y's memory
    out[...] = np.nan
    assert comm.reduce_scatter(x, out=y) is y and out.tobytes() == base.tobytes()
    out[...] = np.nan
    assert comm.all_gather(x, out=y) is y and out.tobytes() == base.tobytes()
    inplace = base.copy()
    assert comm.all_reduce(bf16_producer(inplace), "avg") is not None and inplace.tobytes() == base.tobytes()
    assert comm.broadcast(bf16_producer(inplace)) is not None
    assert released(x, y)


def test_dlpack_host_memory_of_every_kind_runs_on_the_host(comm):
    """Pinned memory (kDLCUDAHost: PyTorch's pin_memory() tensors; kDLROCMHost) is host memory:
    viewed without a copy and reduced on the host, as a CPU tensor. (Managed memory is imported as
    a GPU array, as CuPy's from_dlpack takes it, on the collective's stream.)"""
    for device_type in (1, 3, 11):
        base = np.arange(40, dtype=np.float32) + device_type
        x = Producer(base, device=(device_type, 0))
        kind, a = classify(x, "x")
        assert kind == "host" and a.__array_interface__["data"][0] == base.ctypes.data, device_type
        del a
        want = base * MPI.COMM_WORLD.size
        assert comm.all_reduce(Producer(base, device=(device_type, 0))) is not None
        assert (base == want).all(), device_type


def test_bfloat16_dlpack_layouts_flags_and_ownership(comm):
    base = bf16(24)
    # byte_offset: the data starts there (the pointer stays the buffer's start)
    _, a = classify(bf16_producer(base, shape=(20,), byte_offset=8), "x")
    assert a.__array_interface__["data"][0] == base.ctypes.data + 8 and a.tobytes() == base[4:].tobytes()
    # strides in elements; C-contiguity is the collectives' rule (arrays.flat)
    p = bf16_producer(base, shape=(4, 6), strides=(6, 1))
    _, a = classify(p, "x")
    assert a.shape == (4, 6) and a.flags.c_contiguous and a.tobytes() == base.tobytes()
    t = bf16_producer(base, shape=(6, 4), strides=(1, 6))
    _, a = classify(t, "x")
    assert a.strides == (2, 12) and a.tolist() == base.reshape(4, 6).T.tolist()
    with pytest.raises(TypeError, match=r"shape \(6, 4\) with strides \(2, 12\) is not C-contiguous"):
        comm.all_reduce(t)
    # DLPack 1.0's read-only flag gives a read-only array; a legacy capsule a writable one
    ro = bf16_producer(base, readonly=True)
    with pytest.raises(TypeError, match="read-only"):
        comm.all_reduce(ro)
    assert comm.all_reduce(ro, out=np.empty(24, bfloat16)).tobytes() == base.tobytes()
    assert classify(bf16_producer(base, versioned=False), "x")[1].flags.writeable

    class Legacy(Producer):  # a producer older than DLPack 1.0: __dlpack__(stream=None) only
        def __dlpack__(self, stream=None):
            return super().__dlpack__(stream=stream)

    old = Legacy(base.view(np.uint16), code=KDL_BFLOAT, bits=16)
    _, a = classify(old, "x")
    assert a.tobytes() == base.tobytes() and old.calls[-1]["max_version"] is None
    # 0-d and empty tensors
    _, a = classify(bf16_producer(base, shape=()), "x")
    assert a.shape == () and a.tobytes() == base[:1].tobytes()
    assert comm.all_reduce(bf16_producer(base[:0], shape=(0,))) is not None
    del a
    assert released(p, t, ro, old)


def test_dlpack_dtypes_numpy_cannot_view_are_a_clear_type_error(comm):
    base = np.zeros(8, np.uint8)
    for code, bits in ((KDL_BFLOAT, 32), (KDL_FLOAT, 8), (10, 8)):  # bfloat32, float8, float8_e4m3fn
        p = Producer(base, code=code, bits=bits)
        with pytest.raises(TypeError, match=rf"x: numpy cannot view this DLPack tensor .*code {code}, {bits} bits"):
            comm.all_reduce(p)
        assert released(p), "an unconsumed capsule must be freed by its own destructor, once"


# --------------------------------------------------------------------------------- torch, host
@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_cpu_tensors_one_rank(comm, dtype):
    import torch

    td = getattr(torch, dtype)
    x = (torch.randn(37) * 4).to(td)
    _, a = classify(x, "x")
    assert a.dtype == np.dtype(bfloat16 if dtype == "bfloat16" else dtype)
    assert a.__array_interface__["data"][0] == x.data_ptr(), "a copy was made"
    ref = x.clone()
    for call in ("all_reduce", "reduce_scatter", "all_gather"):
        y = torch.full((37,), float("nan"), dtype=td)
        assert getattr(comm, call)(x, out=y) is y
        assert torch.equal(y, ref), call
    assert comm.all_reduce(x, "avg") is x and torch.equal(x, ref)
    shard = comm.reduce_scatter(x)
    assert isinstance(shard, np.ndarray) and shard.tobytes() == a.tobytes()


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed")
@pytest.mark.parallel(nprocs=[2])
def test_torch_cpu_tensors_two_ranks():
    import torch

    mpi = MPI.COMM_WORLD
    comm = make_comm()
    n, r = comm.size, comm.rank
    count = 16 * n + 5
    lo, hi = comm.shard_bounds(count)[r]
    for dtype in TORCH_DTYPES:
        td = getattr(torch, dtype)
        base = torch.arange(count, dtype=torch.float32)  # small integers: exact sums in every dtype
        x = (base + r).to(td)
        want = (base * n + sum(range(n))).to(td)
        comm.all_reduce(x)
        assert torch.equal(x, want), f"{dtype}: all_reduce in place"
        y = torch.full((hi - lo,), float("nan"), dtype=td)
        assert comm.reduce_scatter((base + r).to(td), out=y) is y and torch.equal(y, want[lo:hi]), dtype
        g = torch.full((count,), float("nan"), dtype=td)
        assert comm.all_gather(want[lo:hi].clone(), out=g) is g and torch.equal(g, want), dtype
        assert comm.all_gather(g[lo:hi], out=g) is g and torch.equal(g, want), f"{dtype}: in place"
    mpi.Barrier()


# ---------------------------------------------------------------------------------- torch, GPU
def test_torch_cuda_tensors_run_on_torchs_current_stream_emulated(emulated_gpu_env):
    run = run_emulated(emulated_gpu_env, ["python", "tests/emulated_torch_streams.py"], 300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]


@pytest.mark.parametrize("n", [2, 3])
def test_torch_cuda_tensors_take_the_kernel_lanes_emulated(emulated_gpu_env, n):
    env = dict(emulated_gpu_env, RINGCOMM_TRANSPORT="kernel")
    run = run_emulated(env, ["mpiexec", "-n", str(n), "python", "tests/emulated_torch_lanes.py"], 300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]


@pytest.mark.skipif(not HAVE_TORCH or not real_cupy(), reason="needs PyTorch and CuPy")
def test_torch_cuda_tensors_on_a_gpu(comm):
    import cupy
    import torch

    if not torch.cuda.is_available() or cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no GPU")
    dtypes = list(TORCH_DTYPES)
    try:  # CuPy reads DLPack bfloat16 with ml_dtypes from CuPy 14 on
        cupy.from_dlpack(torch.zeros(1, dtype=torch.bfloat16, device="cuda"))
    except (NotImplementedError, TypeError):
        dtypes.remove("bfloat16")
    s = torch.cuda.Stream()
    for dtype in dtypes:
        td = getattr(torch, dtype)
        with torch.cuda.stream(s):
            x = (torch.randn(1 << 20, device="cuda") * 4).to(td)
            y = torch.full_like(x, float("nan"))
            comm.all_reduce(x, out=y)  # on s, PyTorch's current stream
            seen = y.clone()  # PyTorch's next kernel, on s
        s.synchronize()
        assert torch.equal(seen, x), dtype
