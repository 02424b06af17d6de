"""CUDA stream memory operations on the emulated GPU (tests/emulated): cuStreamWaitValue32/64 and
cuStreamWriteValue32/64 through the cuda-bindings stand-in, with cuda-bindings' names and call shapes,
CUDA's wait conditions and refusals, and a GPU's progress: a stream holding a memory operation runs
without the host, so two processes can hand a ring step over through IPC-mapped flags while both
hosts sit in MPI.

The single-process tests load the CuPy stand-in under a private name (as tests/test_emulated_devices.py
does) and the driver stand-in against it; the two-process test runs under ``mpiexec -n 2`` with
``import cupy`` the stand-in. Memory is read and written from the host through ``ndarray._np()`` (the
emulation's view of device memory, which touches no stream), as another process would.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import threading
import time
import types

import numpy as np
import pytest
from conftest import ROOT, run_emulated

EMULATED = ROOT / "tests" / "emulated"
COPY_SRC = 'extern "C" __global__ void ringcomm_copy() {}'  # the stand-in runs csrc's kernels by name
_names = itertools.count()


def _load(name: str, path, package: bool = False):
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(path.parent)] if package else None
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def gpu(monkeypatch, emulated_gpu_env):
    """A fresh CuPy stand-in (2 devices, device 0 current on this thread, CUDA's 8 work queues)
    and the driver stand-in bound to it; queued work left over is dropped at the end (the progress
    thread then idles)."""
    for var in ("RINGCOMM_EMULATED_WORK_QUEUES", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.delenv(var, raising=False)
    yield from _stand_in(monkeypatch, emulated_gpu_env)


@pytest.fixture
def gpu_one_work_queue(monkeypatch, emulated_gpu_env):
    """As ``gpu``, every stream of the process aliased onto one work queue."""
    monkeypatch.setenv("RINGCOMM_EMULATED_WORK_QUEUES", "1")
    yield from _stand_in(monkeypatch, emulated_gpu_env)


def _stand_in(monkeypatch, emulated_gpu_env):
    monkeypatch.setenv("RINGCOMM_EMULATED_HARNESS", emulated_gpu_env["RINGCOMM_EMULATED_HARNESS"])
    monkeypatch.setenv("RINGCOMM_EMULATED_DEVICES", "2")
    for var in (
        "RINGCOMM_EMULATED_PEER_ACCESS",
        "RINGCOMM_EMULATED_NO_STREAM_MEM_OPS",
        "RINGCOMM_EMULATED_DRIVER_FAIL",
        "RINGCOMM_EMULATED_JITTER",
    ):
        monkeypatch.delenv(var, raising=False)
    n = next(_names)
    cp = _load(f"_ringcomm_emulated_cupy_memops_{n}", EMULATED / "cupy" / "__init__.py", package=True)
    monkeypatch.setitem(sys.modules, "cupy", cp)  # the driver stand-in's ``import cupy``
    drv = _load(f"_ringcomm_emulated_driver_memops_{n}", EMULATED / "cuda" / "bindings" / "driver.py")
    cp.cuda.Device(0).use()
    d = drv
    yield types.SimpleNamespace(
        cp=cp,
        d=d,
        ok=(d.CUresult.CUDA_SUCCESS,),
        GEQ=d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
        DEFAULT=d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
        copy=cp.RawModule(code=COPY_SRC).get_function("ringcomm_copy"),
    )
    with cp._lock:
        for s in list(cp.Stream._by_ptr.values()):
            s._queue.clear()
            s._last_memop = None
        cp._progress.notify_all()
    for key in [k for k in sys.modules if k.startswith(f"_ringcomm_emulated_cupy_memops_{n}")]:
        del sys.modules[key]
    sys.modules.pop(f"_ringcomm_emulated_driver_memops_{n}", None)


def _until(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def _in_thread(fn, timeout: float):
    """fn() in a daemon thread: (whether it returned within ``timeout`` seconds, its result); a call
    that blocks for good then fails the test instead of hanging it."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return bool(out), (out[0] if out else None)


def _flags(g, n: int = 4, dtype=np.uint32):
    """Device memory for flags, zeroed from the host; (array, host view)."""
    a = g.cp.empty(n, dtype)
    host = a._np()
    host[:] = 0
    return a, host


def _data(g, n: int = 256):
    """A source filled on the null stream (queued, lazy) and a poisoned destination."""
    src = g.cp.asarray(np.arange(1, n + 1, dtype=np.float32))
    dst = g.cp.empty(n, np.float32)
    dst._np()[:] = -1
    return src, dst


# ----------------------------------------------------------------------------- names and capability
def test_names_values_and_capabilities_are_cuda_bindings(gpu):
    d = gpu.d
    assert {m.name: int(m) for m in d.CUstreamWaitValue_flags} == {
        "CU_STREAM_WAIT_VALUE_GEQ": 0,
        "CU_STREAM_WAIT_VALUE_EQ": 1,
        "CU_STREAM_WAIT_VALUE_AND": 2,
        "CU_STREAM_WAIT_VALUE_NOR": 3,
        "CU_STREAM_WAIT_VALUE_FLUSH": 1 << 30,
    }
    assert {m.name: int(m) for m in d.CUstreamWriteValue_flags} == {
        "CU_STREAM_WRITE_VALUE_DEFAULT": 0,
        "CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER": 1,
    }
    A = d.CUdevice_attribute  # noqa: N806
    expected = {
        "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1": (92, 0),
        "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1": (93, 0),
        "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1": (94, 0),
        "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES": (98, 0),
        "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS": (122, 1),
        "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR": (123, 1),
    }
    for name, (value, answer) in expected.items():
        assert int(getattr(A, name)) == value, name
        for dev in (0, 1, d.CUdevice(1)):
            assert d.cuDeviceGetAttribute(getattr(A, name), dev) == (d.CUresult.CUDA_SUCCESS, answer), (name, dev)
    for missing in (
        "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V2",
        "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V2",
        "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS",
    ):
        assert not hasattr(A, missing)  # CUDA 11.7/11.8 names; cuda-bindings 12/13 has none of them
    assert d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, 2) == (
        d.CUresult.CUDA_ERROR_INVALID_DEVICE,
        None,
    )
    assert d.cuDriverGetVersion() == (d.CUresult.CUDA_SUCCESS, 13000)
    assert d.cuInit(0) == (d.CUresult.CUDA_SUCCESS,)


# ------------------------------------------------------------------------------------- semantics
U32, U64 = 2**32, 2**64
WAITS = [  # bits, condition, value, memory values that hold the wait, one that releases it
    (32, "GEQ", 6, [0, 5], 6),
    (32, "GEQ", 1, [U32 - 1, 2**31 + 1], 3),  # cyclic: 0xffffffff is "before" 1, and 3 after it
    (32, "GEQ", U32 - 16, [U32 - 17], 5),  # wrapped past the value: 5 counts as after 0xfffffff0
    (32, "EQ", 4, [3, 5, U32 - 1], 4),
    (32, "AND", 0b100, [0, 0b011], 0b110),
    (32, "NOR", 0xFFFF0000, [0x0000FFFF, U32 - 1], 0x00007FFF),
    (64, "GEQ", 1, [U64 - 1, 2**63 + 1], 3),
    (64, "GEQ", 2**40, [2**40 - 1, 2**32 + 5], 2**40),  # all 64 bits compared (the low 32 would pass 2**32+5)
    (64, "EQ", 2**33 + 1, [1, 2**32 + 1], 2**33 + 1),
    (64, "AND", 2**50, [2**50 - 1], 2**50 | 1),
    (64, "NOR", 2**63 - 1, [2**63, 2**63 + 5], 5),  # only bit 63 is free: a 32-bit NOR would never release
]


@pytest.mark.parametrize(
    "bits,cond,value,holding,releasing", WAITS, ids=[f"{b}-{c}-{i}" for i, (b, c, *_) in enumerate(WAITS)]
)
def test_a_value_wait_holds_its_stream_until_the_condition_holds(gpu, bits, cond, value, holding, releasing):
    d = gpu.d
    mem, host = _flags(gpu, dtype=np.uint32 if bits == 32 else np.uint64)
    host[0] = holding[0]
    s = gpu.cp.cuda.Stream(non_blocking=True)
    wait = d.cuStreamWaitValue32 if bits == 32 else d.cuStreamWaitValue64
    flag = getattr(d.CUstreamWaitValue_flags, f"CU_STREAM_WAIT_VALUE_{cond}")
    assert wait(d.CUstream(s.ptr), d.CUdeviceptr(mem.data.ptr), value, flag) == gpu.ok
    ev = gpu.cp.cuda.Event()
    ev.record(s)
    for v in holding:
        host[0] = v
        time.sleep(0.02)  # the progress thread looks every 20 us
        assert not ev.done and not s.done, f"{cond} {value:#x} released at {v:#x}"
    host[0] = releasing
    assert _until(lambda: ev.done), f"{cond} {value:#x} not released at {releasing:#x}"


@pytest.mark.parametrize("bits", [32, 64])
def test_a_value_write_stores_when_its_stream_reaches_it(gpu, bits):
    d = gpu.d
    gate, gate_host = _flags(gpu)
    mem, host = _flags(gpu, dtype=np.uint32 if bits == 32 else np.uint64)
    value = 0xDEADBEEF if bits == 32 else 2**63 + 0xDEADBEEF
    host[:] = 7
    s = gpu.cp.cuda.Stream(non_blocking=True)
    write = d.cuStreamWriteValue32 if bits == 32 else d.cuStreamWriteValue64
    assert d.cuStreamWaitValue32(d.CUstream(s.ptr), d.CUdeviceptr(gate.data.ptr), 1, gpu.GEQ) == gpu.ok
    assert write(d.CUstream(s.ptr), d.CUdeviceptr(mem.data.ptr + host.itemsize), value, gpu.DEFAULT) == gpu.ok
    time.sleep(0.05)
    assert host.tolist() == [7, 7, 7, 7]  # behind the wait
    gate_host[0] = 1
    assert _until(lambda: host[1] == value), host
    assert host[0] == host[2] == 7  # exactly its 4 or 8 bytes


def test_a_write_on_one_stream_releases_a_wait_on_another_without_any_host_sync(gpu):
    """One process, two streams: [wait, kernel, write] on one, [write] on the other, and no host
    call touches a stream after that. The stream's dependency on the legacy null stream (the
    source was filled there) is followed too."""
    d, cp = gpu.d, gpu.cp
    flags, host = _flags(gpu)
    src, dst = _data(gpu)
    waiter, writer = cp.cuda.Stream(), cp.cuda.Stream(non_blocking=True)
    assert d.cuStreamWaitValue32(d.CUstream(waiter.ptr), d.CUdeviceptr(flags.data.ptr), 1, gpu.GEQ) == gpu.ok
    gpu.copy((1,), (512,), (dst.data.ptr, src.data.ptr, dst.nbytes), stream=waiter)
    assert d.cuStreamWriteValue32(d.CUstream(waiter.ptr), d.CUdeviceptr(flags.data.ptr + 4), 1, gpu.DEFAULT) == gpu.ok
    time.sleep(0.05)
    assert cp._emulated_kernels_run() == 0 and host[1] == 0  # the wait holds the kernel
    assert d.cuStreamWriteValue32(d.CUstream(writer.ptr), d.CUdeviceptr(flags.data.ptr), 1, gpu.DEFAULT) == gpu.ok
    assert _until(lambda: host[1] == 1), "the waiting stream did not go on by itself"
    assert cp._emulated_kernels_run() == 1
    assert (dst._np() == np.arange(1, 257)).all()


def test_streams_aliased_onto_one_work_queue_run_in_the_order_queued(gpu_one_work_queue):
    """RINGCOMM_EMULATED_WORK_QUEUES=1: a write queued on stream B after a wait on stream A sits
    behind that wait, though it would satisfy it (on a GPU whose streams share a work queue it
    never runs: the first ipc-stream test run under MPS hung so); a store from the host releases
    both. On streams of different work queues the same write releases the wait (the test above)."""
    g = gpu_one_work_queue
    d, cp = g.d, g.cp
    flags, host = _flags(g)
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    assert d.cuStreamWaitValue32(d.CUstream(a.ptr), d.CUdeviceptr(flags.data.ptr), 1, g.GEQ) == g.ok
    assert d.cuStreamWriteValue32(d.CUstream(b.ptr), d.CUdeviceptr(flags.data.ptr + 4), 1, g.DEFAULT) == g.ok
    assert d.cuStreamWriteValue32(d.CUstream(b.ptr), d.CUdeviceptr(flags.data.ptr), 1, g.DEFAULT) == g.ok
    time.sleep(0.05)  # the progress thread looks every 20 us
    assert host.tolist() == [0, 0, 0, 0] and not b.done and not a.done
    host[0] = 1
    assert _until(lambda: b.done and a.done) and host[1] == 1


def test_queries_never_block(gpu):
    d, cp = gpu.d, gpu.cp
    flags, host = _flags(gpu)
    s = cp.cuda.Stream()
    assert d.cuStreamWaitValue32(d.CUstream(s.ptr), d.CUdeviceptr(flags.data.ptr), 1, gpu.GEQ) == gpu.ok
    ev = cp.cuda.Event()
    ev.record(s)
    returned, answers = _in_thread(lambda: [(s.done, ev.done) for _ in range(5)], 2.0)
    assert returned and answers == [(False, False)] * 5
    host[0] = 1
    assert _until(lambda: ev.done and s.done)


@pytest.mark.parametrize("how", ["stream", "event", "device", "get"])
def test_host_waits_block_until_some_process_writes_the_value(gpu, how):
    """As on a GPU, a host wait on a stream held by a value wait returns once the value is written
    (here by a host thread writing the shared memory, as another process would), not before."""
    d, cp = gpu.d, gpu.cp
    flags, host = _flags(gpu)
    src, dst = _data(gpu)
    s = cp.cuda.Stream()
    assert d.cuStreamWaitValue32(d.CUstream(s.ptr), d.CUdeviceptr(flags.data.ptr), 1, gpu.GEQ) == gpu.ok
    gpu.copy((1,), (512,), (dst.data.ptr, src.data.ptr, dst.nbytes), stream=s)
    ev = cp.cuda.Event()
    ev.record(s)
    written = []

    def write() -> None:
        time.sleep(0.3)
        written.append(time.monotonic())
        host[0] = 1

    def host_wait():
        if how == "stream":
            s.synchronize()
        elif how == "event":
            ev.synchronize()
        elif how == "device":
            cp.cuda.Device(0).synchronize()
        else:
            with s:
                return dst.get()  # a copy to the host on the current stream
        return None

    threading.Thread(target=write, daemon=True).start()
    returned, got = _in_thread(host_wait, 30)
    assert returned and written and time.monotonic() >= written[0]
    if how == "get":
        assert (got == np.arange(1, 257)).all()
    assert (dst._np() == np.arange(1, 257)).all()


def test_a_stalled_stream_still_hangs_a_host_wait(gpu):
    s = gpu.cp.cuda.Stream()
    gpu.cp._stall(s)
    returned, _ = _in_thread(s.synchronize, 0.5)
    assert not returned


def test_the_kernel_count_counts_executed_launches_only(gpu):
    cp = gpu.cp
    src, dst = _data(gpu)
    s = cp.cuda.Stream()
    for _ in range(3):
        gpu.copy((1,), (512,), (dst.data.ptr, src.data.ptr, dst.nbytes), stream=s)
    assert cp._emulated_kernels_run() == 0  # queued, not run
    s.synchronize()
    assert cp._emulated_kernels_run() == 3


def test_streams_without_memory_operations_stay_lazy(gpu):
    """A queued kernel does not run until something waits for it, even while the progress thread
    runs another stream: the missing-wait bugs still show."""
    d, cp = gpu.d, gpu.cp
    src, dst = _data(gpu)
    s = cp.cuda.Stream()
    gpu.copy((1,), (512,), (dst.data.ptr, src.data.ptr, dst.nbytes), stream=s)
    flags, host = _flags(gpu)
    other = cp.cuda.Stream(non_blocking=True)
    assert d.cuStreamWaitValue32(d.CUstream(other.ptr), d.CUdeviceptr(flags.data.ptr), 1, gpu.GEQ) == gpu.ok
    assert d.cuStreamWriteValue32(d.CUstream(other.ptr), d.CUdeviceptr(flags.data.ptr + 4), 1, 0) == gpu.ok
    host[0] = 1
    assert _until(lambda: host[1] == 1)  # the progress thread is running
    time.sleep(0.2)
    assert cp._emulated_kernels_run() == 0 and (dst._np() == -1).all()
    s.synchronize()
    assert (dst._np() == np.arange(1, 257)).all()


def test_work_after_the_last_memory_operation_stays_lazy(gpu):
    d, cp = gpu.d, gpu.cp
    flags, host = _flags(gpu)
    src, dst = _data(gpu)
    s = cp.cuda.Stream()
    gpu.copy((1,), (512,), (dst.data.ptr, src.data.ptr, dst.nbytes), stream=s)
    assert d.cuStreamWriteValue32(d.CUstream(s.ptr), d.CUdeviceptr(flags.data.ptr), 5, gpu.DEFAULT) == gpu.ok
    gpu.copy((1,), (512,), (dst.data.ptr, src.data.ptr, dst.nbytes), stream=s)
    assert _until(lambda: host[0] == 5)
    time.sleep(0.1)
    assert cp._emulated_kernels_run() == 1  # the kernel before the write ran; the one after waits
    s.synchronize()
    assert cp._emulated_kernels_run() == 2


# -------------------------------------------------------------------------------------- refusals
def test_without_stream_memory_operations_every_call_is_not_supported(gpu, monkeypatch):
    d, cp = gpu.d, gpu.cp
    monkeypatch.setenv("RINGCOMM_EMULATED_NO_STREAM_MEM_OPS", "1")
    A = d.CUdevice_attribute  # noqa: N806
    for a in (
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR,
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1,
    ):
        assert d.cuDeviceGetAttribute(a, 0) == (d.CUresult.CUDA_SUCCESS, 0)
    flags, host = _flags(gpu, dtype=np.uint64)
    s = cp.cuda.Stream()
    for call in (d.cuStreamWaitValue32, d.cuStreamWaitValue64, d.cuStreamWriteValue32, d.cuStreamWriteValue64):
        assert call(d.CUstream(s.ptr), d.CUdeviceptr(flags.data.ptr), 3, 0) == (d.CUresult.CUDA_ERROR_NOT_SUPPORTED,)
    assert s.done  # nothing was queued
    s.synchronize()
    assert host.tolist() == [0, 0, 0, 0]


def test_refusals_are_cudas(gpu, monkeypatch):
    d, cp = gpu.d, gpu.cp
    r = d.CUresult
    flags, host = _flags(gpu, dtype=np.uint64)
    p = flags.data.ptr
    s = cp.cuda.Stream()
    hs = d.CUstream(s.ptr)
    w32, w64, v32, v64 = d.cuStreamWaitValue32, d.cuStreamWaitValue64, d.cuStreamWriteValue32, d.cuStreamWriteValue64
    numpy_buf = np.zeros(4, np.uint64)
    direct = cp.cuda.Memory(4096)
    freed = cp.cuda.Memory(4096)
    freed_ptr = freed.ptr
    del freed
    for call, addr, flag, want in [
        (v32, numpy_buf.ctypes.data, 0, r.CUDA_ERROR_INVALID_VALUE),  # host memory that is not pinned
        (w32, freed_ptr, 0, r.CUDA_ERROR_INVALID_VALUE),  # freed
        (v32, direct.ptr + 4096, 0, r.CUDA_ERROR_INVALID_VALUE),  # just past the allocation
        (v32, p + 2, 0, r.CUDA_ERROR_INVALID_VALUE),  # 32-bit: 4-byte alignment
        (w64, p + 4, 0, r.CUDA_ERROR_INVALID_VALUE),  # 64-bit: 8-byte alignment
        (w32, p, 4, r.CUDA_ERROR_INVALID_VALUE),  # no such condition
        (w32, p, d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_FLUSH, r.CUDA_ERROR_NOT_SUPPORTED),
        (v32, p, d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER, r.CUDA_ERROR_NOT_SUPPORTED),
        (v32, p, 2, r.CUDA_ERROR_INVALID_VALUE),
    ]:
        assert call(hs, d.CUdeviceptr(addr), 1, flag) == (want,), (call.__name__, addr - p, flag)
    assert d.cuStreamWriteValue32(d.CUstream(999_999), d.CUdeviceptr(p), 1, 0) == (r.CUDA_ERROR_INVALID_HANDLE,)
    with pytest.raises(OverflowError):
        v32(hs, d.CUdeviceptr(p), 2**32, 0)
    with pytest.raises(OverflowError):
        v64(hs, d.CUdeviceptr(p), -1, 0)
    with pytest.raises(OverflowError):
        w32(hs, d.CUdeviceptr(p), 1, -1)
    out = []
    t = threading.Thread(target=lambda: out.append(v32(hs, d.CUdeviceptr(p), 1, 0)))  # no context there
    t.start()
    t.join(10)
    assert out == [(r.CUDA_ERROR_INVALID_CONTEXT,)]
    assert s.done and host.tolist() == [0, 0, 0, 0]  # nothing refused was queued

    # accepted: plain ints for the stream and the address (and None, the null stream), the last word
    # of an allocation, pinned host memory, a 64-bit value
    pinned = cp.alloc_pinned_memory(64)
    pinned_view = np.frombuffer(pinned, np.uint32)
    assert v32(s.ptr, p, 1, 0) == gpu.ok
    assert v32(None, p + 4, 2, 0) == gpu.ok
    assert v32(hs, direct.ptr + 4092, 3, 0) == gpu.ok
    assert v32(hs, pinned.ptr + 8, 4, 0) == gpu.ok
    assert v64(hs, d.CUdeviceptr(p + 8), 2**64 - 1, 0) == gpu.ok
    s.synchronize()
    cp.cuda.Stream.null.synchronize()
    assert host.view(np.uint32)[:2].tolist() == [1, 2] and host[1] == 2**64 - 1
    direct_words = cp.ndarray((1024,), np.uint32, cp.cuda.MemoryPointer(direct, 0))._np()
    assert direct_words[-1] == 3 and pinned_view[2] == 4


@pytest.mark.parametrize(
    "rule,enable,want",
    [
        ("none", False, "CUDA_ERROR_INVALID_VALUE"),
        ("all", False, "CUDA_ERROR_INVALID_VALUE"),
        ("all", True, "CUDA_SUCCESS"),
    ],
)
def test_memory_of_another_device_needs_peer_access(gpu, monkeypatch, rule, enable, want):
    """A stream of device 0 may use memory of device 1 only once device 0 enabled peer access to it
    (CUDA names no error for it: CUDA_ERROR_INVALID_VALUE is the emulation's choice)."""
    d, cp = gpu.d, gpu.cp
    monkeypatch.setenv("RINGCOMM_EMULATED_PEER_ACCESS", rule)
    with cp.cuda.Device(1):
        far, host = _flags(gpu)
    s = cp.cuda.Stream()  # on device 0
    if enable:
        cp.cuda.runtime.deviceEnablePeerAccess(1)
    assert d.cuStreamWriteValue32(d.CUstream(s.ptr), d.CUdeviceptr(far.data.ptr), 9, 0) == (getattr(d.CUresult, want),)
    s.synchronize()
    assert host[0] == (9 if want == "CUDA_SUCCESS" else 0)


# ------------------------------------------------------------------------------------ two processes
RING = r"""
import json, sys, time
import numpy as np
from mpi4py import MPI
import cupy
from cuda.bindings import driver as d

comm = MPI.COMM_WORLD
r, peer = comm.rank, 1 - comm.rank
N, CHUNK = int(sys.argv[1]), 256  # steps, floats per step
rt = cupy.cuda.runtime
cupy.cuda.Device(0).use()
OK = (d.CUresult.CUDA_SUCCESS,)
GEQ = d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
DEFAULT = d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT


def view(mem, dtype):  # the host's view of emulated device memory (ndarray._np()): no stream is touched
    return cupy.ndarray((mem.size // np.dtype(dtype).itemsize,), dtype, cupy.cuda.MemoryPointer(mem, 0))._np()


flag = cupy.cuda.Memory(4096)  # word 0: written by the peer through its IPC mapping
inbox = cupy.cuda.Memory(N * CHUNK * 4)  # rank 1's: written by rank 0's kernels through IPC
view(flag, np.uint32)[:] = 0
handles = comm.allgather((rt.ipcGetMemHandle(flag.ptr), rt.ipcGetMemHandle(inbox.ptr)))
peer_flag = rt.ipcOpenMemHandle(handles[peer][0])
peer_inbox = rt.ipcOpenMemHandle(handles[1][1]) if r == 0 else None
src = cupy.asarray(np.arange(N * CHUNK, dtype=np.float32) + 1000 * r)
out = cupy.empty(N * CHUNK, np.float32)
out._np()[:] = -1
cupy.cuda.Stream.null.synchronize()
comm.Barrier()

copy = cupy.RawModule(code='extern "C" __global__ void ringcomm_copy() {}').get_function("ringcomm_copy")
s = cupy.cuda.Stream(non_blocking=True)
hs = d.CUstream(s.ptr)
for i in range(1, N + 1):
    off = (i - 1) * CHUNK * 4
    if r == 0:  # send step i into rank 1's inbox, say so, wait until rank 1 has read it
        copy((1,), (512,), (peer_inbox + off, src.data.ptr + off, CHUNK * 4), stream=s)
        assert d.cuStreamWriteValue32(hs, d.CUdeviceptr(peer_flag), i, DEFAULT) == OK
        assert d.cuStreamWaitValue32(hs, d.CUdeviceptr(flag.ptr), i, GEQ) == OK
    else:  # wait for step i, read it out of the inbox, say so
        assert d.cuStreamWaitValue32(hs, d.CUdeviceptr(flag.ptr), i, GEQ) == OK
        copy((1,), (512,), (out.data.ptr + off, inbox.ptr + off, CHUNK * 4), stream=s)
        assert d.cuStreamWriteValue32(hs, d.CUdeviceptr(peer_flag), i, DEFAULT) == OK

# From here the hosts make no stream call until both sides are done: each sits in MPI while its
# peer's progress needs this process's stream to run.
mine = view(flag, np.uint32)


def wait_flag(v):
    t = time.monotonic()
    while mine[0] < v:
        if time.monotonic() - t > 60:
            print(f"rank {r}: flag {mine[0]} after 60 s, waiting for {v}", file=sys.stderr, flush=True)
            comm.Abort(3)
        time.sleep(0.001)


if r == 0:
    comm.recv(source=1)  # rank 1 needs every write of this stream meanwhile
    wait_flag(N)
    comm.send("done", dest=1)
else:
    wait_flag(N)
    comm.send("go", dest=0)
    comm.recv(source=0)  # rank 0 needs the last write of this stream meanwhile
result = {"kernels": cupy._emulated_kernels_run(), "flag": int(mine[0])}
if r == 1:
    result["out_ok"] = bool((out._np() == np.arange(N * CHUNK)).all())
comm.Barrier()
s.synchronize()
rt.ipcCloseMemHandle(peer_flag)
if peer_inbox is not None:
    rt.ipcCloseMemHandle(peer_inbox)
comm.Barrier()
with open(f"{sys.argv[2]}.{r}", "w") as f:
    json.dump(result, f)
"""


def test_two_processes_hand_steps_over_through_ipc_flags_while_both_hosts_sit_in_mpi(emulated_gpu_env, tmp_path):
    """Rank 0 queues [kernel into rank 1's inbox, write rank 1's flag, wait for its own] per step,
    rank 1 [wait for its flag, kernel out of the inbox, write rank 0's flag], then both hosts block
    in MPI. On a GPU both streams finish; a purely lazy emulation would deadlock."""
    steps = 20
    env = {**emulated_gpu_env, "RINGCOMM_EMULATED_DEVICES": "1"}
    run = run_emulated(env, ["mpiexec", "-n", "2", "python", "-c", RING, str(steps), str(tmp_path / "out")], 180)
    assert run.returncode == 0, run.stderr[-4000:]
    outs = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert [o["kernels"] for o in outs] == [steps, steps], outs
    assert [o["flag"] for o in outs] == [steps, steps], outs
    assert outs[1]["out_ok"], outs
