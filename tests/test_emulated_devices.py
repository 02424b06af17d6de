"""The emulated GPU's devices (tests/emulated): RINGCOMM_EMULATED_DEVICES devices, the current device
per thread, and the peer-access rules of RINGCOMM_EMULATED_PEER_ACCESS, as CuPy 14 and CUDA behave.

The single-process tests load the CuPy stand-in under a private module name (so that ``import cupy``
elsewhere in this session is not affected) with the variables set by monkeypatch (the emulation reads
them at each call). The IPC tests run an exporting and an importing process; the NCCL ones run
under ``mpiexec -n 2``. What each refusal must look like is CuPy's and CUDA's: see the docstrings in
tests/emulated/cupy/__init__.py.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, run_emulated

EMULATED = ROOT / "tests" / "emulated" / "cupy" / "__init__.py"
_names = itertools.count()
# the stand-in runs csrc's kernels by name, reading their arguments by the signature in the source
COPY_SRC = (
    'extern "C" __global__ void ringcomm_copy(unsigned char* dst, const unsigned char* src, unsigned long long n) {}'
)


@pytest.fixture
def emu(monkeypatch):
    """A fresh instance of the CuPy stand-in, with 4 devices unless a test sets otherwise."""
    yield from _fresh(monkeypatch)


@pytest.fixture
def emu_queues(monkeypatch, request):
    """As ``emu``, with ``request.param`` hardware work queues per process (RINGCOMM_EMULATED_WORK_QUEUES)."""
    monkeypatch.setenv("RINGCOMM_EMULATED_WORK_QUEUES", str(request.param))
    yield from _fresh(monkeypatch)


def _fresh(monkeypatch):
    monkeypatch.setenv("RINGCOMM_EMULATED_DEVICES", "4")
    monkeypatch.delenv("RINGCOMM_EMULATED_PEER_ACCESS", raising=False)
    monkeypatch.delenv("RINGCOMM_EMULATED_JITTER", raising=False)
    name = f"_ringcomm_emulated_cupy_{next(_names)}"
    spec = importlib.util.spec_from_file_location(name, EMULATED, submodule_search_locations=[str(EMULATED.parent)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    yield mod
    with mod._lock:  # queued work left over (a gated ring kernel) is dropped: the progress thread idles
        for s in list(mod.Stream._by_ptr.values()):
            s._queue.clear()
            s._last_eager = None
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    return out[0]


# ------------------------------------------------------------------------------- devices, threads
def test_device_count_follows_the_variable(emu, monkeypatch):
    assert emu.cuda.runtime.getDeviceCount() == 4
    monkeypatch.delenv("RINGCOMM_EMULATED_DEVICES")
    assert emu.cuda.runtime.getDeviceCount() == 1  # the default: one device, as before
    monkeypatch.setenv("RINGCOMM_EMULATED_DEVICES", "two")
    with pytest.raises(ValueError, match="RINGCOMM_EMULATED_DEVICES"):
        emu.cuda.runtime.getDeviceCount()


def test_current_device_is_per_thread(emu):
    rt = emu.cuda.runtime
    assert rt.getDevice() == 0
    rt.setDevice(2)
    assert rt.getDevice() == 2 and emu.cuda.Device().id == 2
    assert _in_thread(rt.getDevice) == 0  # a new thread starts on device 0, as with the CUDA runtime

    def other() -> int:
        emu.cuda.Device(3).use()
        return rt.getDevice()

    assert _in_thread(other) == 3
    assert rt.getDevice() == 2  # the other thread's choice is its own


def test_with_device_makes_it_current_and_restores_the_previous(emu):
    rt = emu.cuda.runtime
    emu.cuda.Device(1).use()
    with emu.cuda.Device(3) as d:
        assert d.id == 3 and rt.getDevice() == 3 and emu.cuda.Device() == emu.cuda.Device(3)
        with emu.cuda.Device(0):
            assert rt.getDevice() == 0
        assert rt.getDevice() == 3
        with emu.cuda.Device(3):  # the current one: still restored to it
            pass
        assert rt.getDevice() == 3
    assert rt.getDevice() == 1
    assert int(emu.cuda.Device(2)) == 2 and repr(emu.cuda.Device(2)) == "<CUDA Device 2>"


@pytest.mark.parametrize("use", ["use", "with", "setDevice", "pci_bus_id", "properties", "peer"])
def test_an_invalid_ordinal_is_cudaErrorInvalidDevice(emu, use):
    """CuPy's Device(4) constructs (device.pyx checks nothing); using it fails in cudaSetDevice etc."""
    dev = emu.cuda.Device(4)
    calls = {
        "use": dev.use,
        "with": lambda: dev.__enter__(),
        "setDevice": lambda: emu.cuda.runtime.setDevice(-1),
        "pci_bus_id": lambda: dev.pci_bus_id,
        "properties": lambda: emu.cuda.runtime.getDeviceProperties(4),
        "peer": lambda: emu.cuda.runtime.deviceCanAccessPeer(0, 4),
    }
    with pytest.raises(emu.cuda.runtime.CUDARuntimeError) as err:
        calls[use]()
    assert err.value.status == 101 and str(err.value) == "cudaErrorInvalidDevice: invalid device ordinal"
    assert emu.cuda.runtime.getDevice() == 0


def test_each_device_has_its_own_pci_bus_id(emu):
    rt = emu.cuda.runtime
    ids = [emu.cuda.Device(i).pci_bus_id for i in range(4)]
    assert ids[0] == "0000:00:00.0"  # device 0 is the same GPU in every process (the shared-GPU checks)
    assert len(set(ids)) == 4 and ids == [rt.deviceGetPCIBusId(i) for i in range(4)]
    assert all(isinstance(i, str) and len(i) == 12 for i in ids)  # CuPy: str, 13 bytes with the NUL
    assert [rt.deviceGetByPCIBusId(i) for i in ids] == [0, 1, 2, 3]
    assert [rt.getDeviceProperties(i)["pciBusID"] for i in range(4)] == [int(i.split(":")[1], 16) for i in ids]


# ----------------------------------------------------------------------------------- peer access
@pytest.mark.parametrize(
    "rule,pairs",
    [
        (None, {(i, j) for i in range(4) for j in range(4) if i != j}),
        ("all", {(i, j) for i in range(4) for j in range(4) if i != j}),
        ("none", set()),
        ("0-1,2-3", {(0, 1), (1, 0), (2, 3), (3, 2)}),
        ("0-1-2,3", {(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)}),
    ],
)
def test_peer_access_rules(emu, monkeypatch, rule, pairs):
    if rule is not None:
        monkeypatch.setenv("RINGCOMM_EMULATED_PEER_ACCESS", rule)
    rt = emu.cuda.runtime
    got = {(i, j): rt.deviceCanAccessPeer(i, j) for i in range(4) for j in range(4)}
    assert all(type(v) is int for v in got.values())  # CuPy returns the int cudaDeviceCanAccessPeer sets
    assert {k for k, v in got.items() if v == 1} == pairs
    assert all(got[(i, i)] == 0 for i in range(4))  # a device never "accesses itself" through this call


def test_a_malformed_peer_rule_is_refused(emu, monkeypatch):
    monkeypatch.setenv("RINGCOMM_EMULATED_PEER_ACCESS", "0-1;2-3")
    with pytest.raises(ValueError, match="RINGCOMM_EMULATED_PEER_ACCESS"):
        emu.cuda.runtime.deviceCanAccessPeer(0, 1)


def test_enabling_peer_access_follows_the_rules(emu, monkeypatch):
    monkeypatch.setenv("RINGCOMM_EMULATED_PEER_ACCESS", "0-1,2-3")
    rt, err = emu.cuda.runtime, emu.cuda.runtime.CUDARuntimeError
    for peer in (2, 0):  # no P2P between 0 and 2; a device is not its own peer
        with pytest.raises(err) as e:
            rt.deviceEnablePeerAccess(peer)
        assert e.value.status == 101 and "cudaErrorInvalidDevice" in str(e.value)
    rt.deviceEnablePeerAccess(1)
    with pytest.raises(err) as e:
        rt.deviceEnablePeerAccess(1)
    assert e.value.status == 704 and str(e.value).startswith("cudaErrorPeerAccessAlreadyEnabled")
    rt.deviceDisablePeerAccess(1)
    with pytest.raises(err) as e:
        rt.deviceDisablePeerAccess(1)
    assert e.value.status == 705 and str(e.value).startswith("cudaErrorPeerAccessNotEnabled")


# ------------------------------------------------------------------ memory, streams, events, pool
def test_allocations_streams_and_events_belong_to_the_current_device(emu):
    cuda = emu.cuda
    with cuda.Device(2):
        a, m = emu.empty(100, np.float32), cuda.Memory(1024)
        s, ev = cuda.Stream(), cuda.Event()
    b = emu.zeros(10, np.float32)
    assert (a.data.device_id, a.device.id, m.device_id, s.device_id, ev.device_id) == (2, 2, 2, 2, 2)
    assert b.data.device_id == 0 and cuda.Stream().device_id == 0
    assert cuda.Stream.null.device_id == -1  # CuPy: -1 for the singleton streams
    assert emu._region(a.data.ptr).device == 2 and emu._region(b.data.ptr).device == 0
    assert cuda.UnownedMemory(a.data.ptr, 400, a).device_id == 2  # device_id=-1: the pointer's device
    assert not emu._is_device(cuda.alloc_pinned_memory(64).ptr)  # pinned host memory: no device's


def test_the_pool_is_per_device(emu):
    pool = emu.get_default_memory_pool()
    with emu.cuda.Device(1):
        x = emu.empty(1000, np.float32)
        assert pool.total_bytes() > 0 and pool.used_bytes() > 0
    assert pool.total_bytes() == 0 and pool.used_bytes() == 0  # device 0's pool: nothing yet
    y = emu.empty(1000, np.float32)
    assert emu._region(y.data.ptr) is not emu._region(x.data.ptr)  # not device 1's block
    del x
    pool.free_all_blocks()  # on device 0: device 1's idle block stays
    with emu.cuda.Device(1):
        assert pool.total_bytes() > 0 and pool.used_bytes() == 0
        pool.free_all_blocks()
        assert pool.total_bytes() == 0


def test_a_stream_of_another_device_cannot_be_made_current(emu):
    cuda = emu.cuda
    with cuda.Device(1):
        s = cuda.Stream()
        with s:
            assert cuda.get_current_stream() is s
        assert cuda.get_current_stream() is cuda.Stream.null
        s.use()
    assert cuda.get_current_stream() is cuda.Stream.null and cuda.get_current_stream(1) is s  # per device
    with pytest.raises(RuntimeError, match=r"stream is created on \(1\) does not match with the current device \(0\)"):
        s.use()
    with pytest.raises(RuntimeError, match="does not match with the current device"), s:
        pass
    with cuda.Stream.null:  # the null stream is every device's
        pass


def test_an_event_records_only_on_its_devices_streams(emu):
    cuda = emu.cuda
    ev = cuda.Event()
    with cuda.Device(1):
        s1 = cuda.Stream()
        with pytest.raises(cuda.runtime.CUDARuntimeError) as e:
            ev.record(s1)
        assert e.value.status == 400 and str(e.value) == "cudaErrorInvalidResourceHandle: invalid resource handle"
        with pytest.raises(cuda.runtime.CUDARuntimeError):
            ev.record()  # the null stream of device 1
        cuda.Event().record(s1)
    ev.record()
    s1.wait_event(ev)  # waiting across devices is allowed


# ---------------------------------------------------------------------------------------- kernels
@pytest.fixture
def harness(emulated_gpu_env, monkeypatch):
    monkeypatch.setenv("RINGCOMM_EMULATED_HARNESS", emulated_gpu_env["RINGCOMM_EMULATED_HARNESS"])


def _copy_kernel(emu):
    return emu.RawModule(code=COPY_SRC).get_function("ringcomm_copy")


def test_a_kernel_on_a_stream_of_another_device_is_refused(emu, harness):
    k = _copy_kernel(emu)
    with emu.cuda.Device(1):
        s1 = emu.cuda.Stream()
    a, b = emu.zeros(256, np.float32), emu.arange(256, dtype=np.float32)
    with pytest.raises(emu.cuda.driver.CUDADriverError) as e:
        k((1,), (512,), (a.data.ptr, b.data.ptr, a.nbytes), stream=s1)
    assert e.value.status == 400 and str(e.value) == "CUDA_ERROR_INVALID_HANDLE: invalid resource handle"
    k((1,), (512,), (a.data.ptr, b.data.ptr, a.nbytes), stream=emu.cuda.Stream())  # this device's: runs
    assert (a.get() == np.arange(256)).all()


@pytest.mark.parametrize("which", ["dst", "src"])
def test_a_kernel_touching_another_devices_memory_is_an_illegal_address(emu, harness, monkeypatch, which):
    monkeypatch.setenv("RINGCOMM_EMULATED_PEER_ACCESS", "all")  # possible, but not enabled
    k = _copy_kernel(emu)
    with emu.cuda.Device(1):
        far = emu.arange(256, dtype=np.float32)
    near = emu.zeros(256, np.float32)
    dst, src = (far, near) if which == "dst" else (near, far)
    with pytest.raises(
        RuntimeError,
        match=r"kernel ringcomm_copy on device 0 touches .* memory of device 1.*"
        r"no peer access to device 1: an illegal memory access",
    ):
        k((1,), (512,), (dst.data.ptr, src.data.ptr, near.nbytes))
    emu.cuda.runtime.deviceEnablePeerAccess(1)  # now device 0 may touch device 1's memory
    k((1,), (512,), (dst.data.ptr, src.data.ptr, near.nbytes))
    assert (dst.get() == src.get()).all()
    # one way only: device 1 did not enable access to device 0
    with emu.cuda.Device(1), pytest.raises(RuntimeError, match="kernel ringcomm_copy on device 1 touches"):
        k((1,), (512,), (far.data.ptr, near.data.ptr, near.nbytes))


def test_kernel_arguments_are_read_as_the_driver_reads_them(emu):
    """cuLaunchKernel reads each parameter's own size from the argument CuPy packed (a numpy scalar by
    its dtype, a Python int as int64, a float as float64), from the signature in the module's source:
    an int64 for an ``int`` gives its low half, a float64 for a ``float`` its low 4 bytes (0.5 reads
    0.0), an argument shorter than its parameter, or a wrong count, is refused (the GPU would read
    past it)."""
    from ringcomm.devices.cuda import kernel_source

    reduce, acc = kernel_source("reduce.cu"), kernel_source("accumulate.cu")
    name = "ringcomm_reduce_sum_f32"  # (T* dst, const T* a, const T* b, unsigned long long n, int use_div, double div)
    good = (np.uint64(16), np.uint64(32), 48, np.uint64(5), np.int32(1), np.float64(0.5))
    assert emu._kernel_params(name, reduce, good) == [16, 32, 48, 5, 1, 0.5]
    assert emu._kernel_params(name, reduce, (*good[:4], np.int64(2**32 + 7), 0.5))[4] == 7
    final = "ringcomm_reduce_acc_final_sum_f16"  # (..., int use_div, float div)
    args = (16, 32, 48, np.uint64(5), np.int32(1))
    assert emu._kernel_params(final, acc, (*args, np.float32(0.5)))[5] == 0.5
    assert emu._kernel_params(final, acc, (*args, 0.5))[5] == 0.0  # a Python float is a double
    with pytest.raises(RuntimeError, match=r"parameter 3 \(unsigned long long\) is 8 bytes, .* holds 4"):
        emu._kernel_params(name, reduce, (*good[:3], np.int32(5), *good[4:]))
    with pytest.raises(RuntimeError, match="takes 6 parameters, launched with 5"):
        emu._kernel_params(name, reduce, good[:5])
    with pytest.raises(RuntimeError, match="no kernel 'ringcomm_reduce_sum_f32x'"):  # (exact names: copy's)
        emu._kernel_params(name + "x", COPY_SRC, good)


def test_memcpy_across_devices_is_allowed(emu):
    """A copy, unlike a kernel, may use another device's stream and memory (CUDA Programming Guide)."""
    with emu.cuda.Device(1):
        far, s1 = emu.arange(64, dtype=np.float32), emu.cuda.Stream()
    near = emu.zeros(64, np.float32)
    rt = emu.cuda.runtime
    rt.memcpyAsync(near.data.ptr, far.data.ptr, near.nbytes, rt.memcpyDeviceToDevice, s1.ptr)
    assert (near.get() == 0).all()  # (device 0's null stream is not ordered after device 1's streams)
    s1.synchronize()
    assert (near.get() == np.arange(64)).all()


def test_queued_kernels_run_only_when_waited_for_and_a_stalled_stream_hangs_a_host_wait(emu, harness):
    """Streams are lazy: a queued kernel is not run (nor counted) until something waits for it; a
    stream that never completes (a hung kernel: ``_stall``) keeps a host wait from returning."""
    k = _copy_kernel(emu)
    a, b = emu.zeros(256, np.float32), emu.arange(256, dtype=np.float32)
    emu.cuda.Stream.null.synchronize()
    s = emu.cuda.Stream()
    for _ in range(3):
        k((1,), (512,), (a.data.ptr, b.data.ptr, a.nbytes), stream=s)
    assert emu._emulated_kernels_run() == 0 and (a._np() == 0).all()  # queued, not run
    s.synchronize()
    assert emu._emulated_kernels_run() == 3 and (a._np() == np.arange(256)).all()
    emu._stall(s)
    t = threading.Thread(target=s.synchronize, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive()


def _gated_ring_kernel(emu, stream):
    """A ring kernel's stand-in (the emulation's _Running: one block) queued on ``stream``, whose block
    runs until ``open`` is set: (started, open, finished) events."""
    started, gate, finished = threading.Event(), threading.Event(), threading.Event()

    def block(b: int) -> None:
        started.set()
        gate.wait(30)

    stream._enqueue(emu._Running(1, block, finished.set))
    return started, gate, finished


def test_a_ring_kernel_runs_without_the_host_and_holds_its_stream(emu, harness):
    """As on a GPU, a stream whose queue holds a ring kernel runs up to it without any host wait
    (the work before it included); queries never block while its blocks run; the work queued after
    it waits for every block to return, and then stays lazy, as does another stream's work."""
    k = _copy_kernel(emu)
    a, b = emu.zeros(256, np.float32), emu.arange(256, dtype=np.float32)
    emu.cuda.Stream.null.synchronize()
    s, other = emu.cuda.Stream(non_blocking=True), emu.cuda.Stream(non_blocking=True)
    k((1,), (512,), (a.data.ptr, b.data.ptr, a.nbytes), stream=other)  # lazy: nothing waits for it
    k((1,), (512,), (a.data.ptr, b.data.ptr, a.nbytes), stream=s)
    started, gate, finished = _gated_ring_kernel(emu, s)
    k((1,), (512,), (a.data.ptr, b.data.ptr, a.nbytes), stream=s)
    assert started.wait(10), "the ring kernel did not start without a host wait"
    assert emu._emulated_kernels_run() == 1  # the kernel before it ran; the one after it waits
    t0 = time.monotonic()
    assert [s.done for _ in range(5)] == [False] * 5 and time.monotonic() - t0 < 1  # queries never block
    gate.set()
    assert finished.wait(10), "the ring kernel's stream did not go on once its block returned"
    time.sleep(0.1)
    assert emu._emulated_kernels_run() == 1  # after the last ring kernel, and the other stream: lazy
    s.synchronize()
    assert emu._emulated_kernels_run() == 2
    other.synchronize()
    assert emu._emulated_kernels_run() == 3


@pytest.mark.parametrize("emu_queues", [1, 8], indirect=True)
def test_streams_aliased_onto_one_work_queue_wait_behind_a_ring_kernel(emu_queues):
    """Streams alias onto RINGCOMM_EMULATED_WORK_QUEUES hardware work queues, round robin (CUDA's
    CUDA_DEVICE_MAX_CONNECTIONS, 8 by default; fewer per process under MPS): with one queue a ring
    kernel queued on stream B after one on stream A that spins does not start until A's returns;
    with 8 queues, it starts at once."""
    emu = emu_queues
    sa, sb = emu.cuda.Stream(non_blocking=True), emu.cuda.Stream(non_blocking=True)
    a_started, a_gate, a_finished = _gated_ring_kernel(emu, sa)
    try:
        b_started, b_gate, _ = _gated_ring_kernel(emu, sb)
        b_gate.set()
        assert a_started.wait(10)
        assert b_started.wait(0.3 if emu._WORK_QUEUES == 1 else 10) is (emu._WORK_QUEUES != 1)
        a_gate.set()
        assert a_finished.wait(10) and b_started.wait(10)
    finally:
        a_gate.set()


# -------------------------------------------------------------------------------- IPC, two processes
EXPORTER = """
import sys
import numpy as np
import cupy
with cupy.cuda.Device(int(sys.argv[1])):
    mem = cupy.cuda.Memory(4096)
    x = cupy.ndarray((1024,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    x.set(np.arange(1024, dtype=np.float32))
    handle = cupy.cuda.runtime.ipcGetMemHandle(mem.ptr)
print(handle.hex(), flush=True)
sys.stdin.readline()
"""

IMPORTER = (
    f"COPY_SRC = {COPY_SRC!r}\n"
    + """
import json, sys
import numpy as np
import cupy
from cuda.bindings import driver
rt = cupy.cuda.runtime
dev, exporter, handle, flags, enable = (int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]),
                                        int(sys.argv[4]), sys.argv[5] == "1")
cupy.cuda.Device(dev).use()
if enable:
    rt.deviceEnablePeerAccess(exporter)
out = {}
try:
    ptr = rt.ipcOpenMemHandle(handle, flags)
except rt.CUDARuntimeError as e:
    out.update(opened=False, status=e.status, error=str(e))
else:
    out["opened"] = True
    mapped = cupy.ndarray((1024,), cupy.float32, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, 4096, None), 0))
    out["device_id"] = mapped.data.device_id
    out["ordinal"] = driver.cuPointerGetAttribute(
        driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)[1]
    k = cupy.RawModule(code=COPY_SRC).get_function("ringcomm_copy")
    y = cupy.zeros(1024, cupy.float32)
    k((1,), (512,), (y.data.ptr, ptr, 4096))  # on the device the mapping was opened on
    out["copied"] = bool((y.get() == np.arange(1024)).all())
    other = (dev + 1) % rt.getDeviceCount()
    with cupy.cuda.Device(other):
        z = cupy.zeros(1024, cupy.float32)
        try:
            k((1,), (512,), (z.data.ptr, ptr, 4096))
            out["other_device"] = "ran"
        except RuntimeError as e:
            out["other_device"] = str(e)
    rt.ipcCloseMemHandle(ptr)
print(json.dumps(out))
"""
)


def _ipc(env: dict, exporter: int, importer: int, flags: int = 1, enable: bool = False, **extra: str) -> dict:
    env = {**env, "RINGCOMM_EMULATED_DEVICES": "4", **extra}
    exp = subprocess.Popen(
        [sys.executable, "-c", EXPORTER, str(exporter)],
        cwd=ROOT,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        handle = exp.stdout.readline().strip()
        assert handle, exp.stderr.read()
        run = run_emulated(
            env,
            ["python", "-c", IMPORTER, str(importer), str(exporter), handle, str(flags), "1" if enable else "0"],
            60,
        )
        assert run.returncode == 0, run.stderr[-4000:]
        return json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        exp.communicate("\n", timeout=30)


def _mapped_ok(out: dict, importer: int) -> None:
    assert out["opened"], out
    assert out["device_id"] == importer and out["ordinal"] == importer, out  # the mapping is the importer's
    assert out["copied"], out
    assert "illegal memory access" in out["other_device"], out  # only the device it was opened on


@pytest.mark.parametrize("rule", ["all", "none"])
def test_ipc_on_the_same_device_opens_whatever_the_peer_rule(emulated_gpu_env, rule):
    """Several ranks on one GPU: the existing case."""
    _mapped_ok(_ipc(emulated_gpu_env, 2, 2, RINGCOMM_EMULATED_PEER_ACCESS=rule), 2)


@pytest.mark.parametrize("rule,exporter", [("all", 3), ("0-1,2-3", 1)])
def test_ipc_across_peer_devices_opens_with_lazy_peer_access(emulated_gpu_env, rule, exporter):
    _mapped_ok(_ipc(emulated_gpu_env, exporter, 0, RINGCOMM_EMULATED_PEER_ACCESS=rule), 0)


@pytest.mark.parametrize("rule,exporter", [("none", 1), ("0-1,2-3", 2)])
def test_ipc_across_devices_without_peer_access_is_refused(emulated_gpu_env, rule, exporter):
    out = _ipc(emulated_gpu_env, exporter, 0, RINGCOMM_EMULATED_PEER_ACCESS=rule)
    assert not out["opened"] and out["status"] == 217, out
    assert out["error"] == "cudaErrorPeerAccessUnsupported: peer access is not supported between these two devices"


def test_ipc_across_devices_without_the_lazy_flag_needs_peer_access_enabled(emulated_gpu_env):
    out = _ipc(emulated_gpu_env, 1, 0, flags=0)
    assert not out["opened"] and out["status"] == 705 and out["error"].startswith("cudaErrorPeerAccessNotEnabled")
    _mapped_ok(_ipc(emulated_gpu_env, 1, 0, flags=0, enable=True), 0)


# ------------------------------------------------------------------------------- NCCL, two ranks
NCCL = """
import json, sys
import numpy as np
import cupy
from cupy.cuda import nccl
from mpi4py import MPI
r = MPI.COMM_WORLD.rank
dev = r if sys.argv[1] == "distinct" else 0
cupy.cuda.Device(dev).use()
uid = MPI.COMM_WORLD.bcast(nccl.get_unique_id() if r == 0 else None)
out = {"token": uid.rstrip(b"\\0").split(b":")[1].decode()}
try:
    comm = nccl.NcclCommunicator(2, uid, r)
except nccl.NcclError as e:
    out["init"] = str(e)
else:
    out["init"], out["device_id"] = "ok", comm.device_id()
    x = cupy.full(8, r + 1.0, cupy.float32)
    with cupy.cuda.Device(1 - dev):
        far = cupy.zeros(8, cupy.float32)
    try:
        comm.allReduce(x.data.ptr, far.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
        out["far"] = "accepted"
    except nccl.NcclError as e:
        out["far"] = str(e)
    comm.allReduce(x.data.ptr, x.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    out["sum"] = x.get().tolist()
    comm.destroy()
with open(f"{sys.argv[2]}.{r}", "w") as f:  # one file per rank: their stdout lines may interleave
    json.dump(out, f)
"""


@pytest.mark.parametrize("placement", ["distinct", "shared"])
def test_nccl_follows_the_device(emulated_gpu_env, tmp_path, placement):
    """Ranks on distinct devices have distinct bus ids, so an NCCL before 2.30 accepts them; ranks on
    one device are refused as several ranks on one GPU. A buffer of another device is refused as
    NCCL's CudaPtrCheck refuses it."""
    env = {
        **emulated_gpu_env,
        "RINGCOMM_EMULATED_DEVICES": "2",
        "RINGCOMM_EMULATED_NCCL_VERSION": "2.27.7",
        "NCCL_DEBUG": "WARN",
    }
    env.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
    run = run_emulated(env, ["mpiexec", "-n", "2", "python", "-c", NCCL, placement, str(tmp_path / "out")], 120)
    assert run.returncode == 0, run.stderr[-4000:]
    outs = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    for r in range(2):  # a refused ncclCommInitRank leaves its rendezvous file
        Path("/dev/shm", f"ringcomm-emu-nccl-{outs[r]['token']}.{r}").unlink(missing_ok=True)
    if placement == "shared":
        assert all(o["init"].startswith("NCCL_ERROR_INVALID_USAGE") for o in outs), outs
        assert "Duplicate GPU detected" in run.stderr
        return
    assert sorted(o["device_id"] for o in outs) == [0, 1], outs
    assert all(o["far"].startswith("NCCL_ERROR_INVALID_ARGUMENT") for o in outs), outs
    assert "mismatchs with NCCL device" in run.stderr
    assert all(o["sum"] == [3.0] * 8 for o in outs), outs


def test_the_default_is_one_device_shared_by_every_process(emulated_gpu_env):
    """Without the variables: one device, whose bus id is 0000:00:00.0 in every process."""
    env = {k: v for k, v in emulated_gpu_env.items() if not k.startswith("RINGCOMM_EMULATED_")}
    env["RINGCOMM_EMULATED_HARNESS"] = emulated_gpu_env["RINGCOMM_EMULATED_HARNESS"]
    code = (
        "import cupy; rt = cupy.cuda.runtime; print(rt.getDeviceCount(), cupy.cuda.Device().pci_bus_id, "
        "rt.deviceCanAccessPeer(0, 0))"
    )
    run = run_emulated(env, ["python", "-c", code], 60)
    assert run.returncode == 0 and run.stdout.split() == ["1", "0000:00:00.0", "0"], run.stderr
