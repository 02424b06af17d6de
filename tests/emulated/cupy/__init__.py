"""A CPU stand-in for the part of CuPy that ringcomm uses: for tests only, never installed.

tests/test_cuda_emulated.py puts this folder first on PYTHONPATH and runs the GPU tests
(tests/gpu) on a machine without a GPU, so the CUDA device, the IPC and staged transports and the
GPU tests themselves run end to end before they meet a real GPU. What is emulated:

- device memory: POSIX shared memory mapped into the process; a "device pointer" is its address.
  ``empty`` sub-allocates 512-byte aligned chunks from 2 MiB blocks (as CuPy's pool does), so IPC
  sees arrays at offsets inside an allocation. RINGCOMM_EMULATED_NO_IPC_POOL=1 makes pool blocks
  not exportable (like stream-ordered allocations), to exercise the IPC scratch path.
- IPC: a handle names the shared-memory file; opening maps it. Opening a handle of this process
  raises, as CUDA does; opening one handle twice raises too (CUDA counts it: stricter here, so that
  the transport's cache is checked).
- kernels: ``RawModule`` runs ringcomm's kernels through tests/csrc_harness.cpp (built by the
  caller, path in RINGCOMM_EMULATED_HARNESS): every thread of the launched grid, with every
  pointer checked to lie in emulated device memory and every vector access checked for alignment.
  The ring executor's kernel (csrc/ring.cu), whose blocks wait on each other and on other
  processes, runs as a GPU runs it: it starts when its stream reaches it, whether or not the host
  waits, with every block on an OS thread of its own, all at once (co-resident, as under MPS); the
  stream's later work runs once every block has returned. Its error record must lie in pinned host
  memory. As on a GPU, such streams progress without the host: a stream whose queue holds a ring
  kernel is run by a daemon thread of the process (the progress thread) up to and including its
  last ring kernel, together with everything it waits for (other streams' events, the legacy null
  stream); work after it, and streams without one, stay lazy. Host waits (Stream/Event/device
  synchronize, a copy to the host on the current stream) on a stream whose ring kernel runs poll
  until its blocks have returned; queries (``done``) never block. Queued work runs under one
  process-wide lock. ``_emulated_kernels_run()``: how many kernel launches this process has
  executed (not queued).
- streams and events are lazy: queued work runs only when something waits for it (an event
  query or synchronize, a stream waiting on an event, or a copy to the host), never earlier. A
  missing wait in a transport then reads stale data, as it might on a GPU.
  RINGCOMM_EMULATED_JITTER=<ms> also delays some queued work at random, so ranks drift apart.
- hardware work queues: as a GPU, a process's streams are aliased onto k work queues, round robin
  in the order they are made (the null stream keeps its own): work queued on a stream also runs
  after everything queued before it on the other streams of its work queue, so work queued behind a
  ring kernel on the same work queue never runs while that kernel's blocks spin. k is
  CUDA_DEVICE_MAX_CONNECTIONS (CUDA's default 8); RINGCOMM_EMULATED_WORK_QUEUES=<k> overrides it
  (under MPS the clients share one pool of work queues, so each gets fewer: an H200 under MPS hung
  on a stream memory write queued 4 streams after the stream wait it was to release, and did not
  without MPS).
- CUDA graphs: ``Stream.begin_capture()`` / ``end_capture()`` / ``is_capturing()`` and
  ``Graph.launch(stream)``: kernels queued while a stream captures become the graph's nodes, and a
  launch queues them again (a ring kernel as a new run of its blocks). Anything else queued on a
  capturing stream (a copy, a wait on an event, an event record, a synchronize) is refused with
  CUDA's capture errors and invalidates the capture (CUDA allows event records there: stricter).
- NCCL: ``cupy.cuda.nccl`` (_nccl.py) with CuPy 14's signatures, its collectives done with MPI and
  queued on the given stream; RINGCOMM_EMULATED_NCCL_VERSION picks the NCCL version it reports.
- devices: RINGCOMM_EMULATED_DEVICES=<n> (default 1) devices, the same n in every process of a node
  (device i has PCI bus id "0000:<i as 2 hex digits>:00.0", so device 0 is "0000:00:00.0" in every
  process: ranks on one device share one GPU). The current device is per thread (0 in a new thread),
  as the CUDA runtime's. Memory (the pool is per device, as CuPy's), streams and events belong to the
  device current when they were made; pinned host memory to none. RINGCOMM_EMULATED_PEER_ACCESS says
  which devices can access each other's memory (cudaDeviceCanAccessPeer): "all" (default), "none",
  or groups of device ids joined by "-", separated by "," ("0-1,2-3": 0 and 1 can, 2 and 3 can, no
  other pair; a device in no group has no peers). A kernel launched on device d may touch memory of
  device d (its own allocations and the IPC mappings opened on d) and of devices that d enabled peer
  access to (cudaDeviceEnablePeerAccess); anything else is an illegal address. A kernel launched on
  a stream of another device fails as cuLaunchKernel does (CUDA_ERROR_INVALID_HANDLE).
  RINGCOMM_EMULATED_SMS=<n> sets every device's multiprocessor count (default 5) and
  RINGCOMM_EMULATED_MPS=0 says that the processes sharing a device are not under MPS
  (cudaDevAttrMpsEnabled 0; default 1): what ringcomm's ring-kernel set-up reads. Kernels still run
  at once either way (no time slicing, no occupancy limit is emulated).
- threads, as CuPy's and the CUDA runtime's: the current stream is per thread and device, and
  ``Stream.use()`` sets it without touching the stack of ``with stream:`` blocks (leaving a block
  makes the stream under it current). A thread has no current context until cudaSetDevice or a
  runtime call that needs one (an allocation from the device, a stream, an event, a copy, a kernel
  launch); ``with Device(i)`` where i is current already makes none, and driver calls without
  one fail (CUDA_ERROR_INVALID_CONTEXT).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import glob
import itertools
import mmap
import os
import random
import re
import threading
import time
import types
import warnings
import weakref

import numpy as np

__version__ = "0.0+ringcomm-emulated"
_emulated = True

float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64

#: RINGCOMM_EMULATED_SMS=<n>: the emulated GPU's multiprocessors (default 5: a ring kernel gets 2
#: blocks per rank for one or two ranks on a device, 1 for three to five)
_SM_COUNT = max(1, int(os.environ.get("RINGCOMM_EMULATED_SMS") or 5))
#: RINGCOMM_EMULATED_MPS=0: the processes sharing an emulated GPU do not run under MPS
#: (cudaDevAttrMpsEnabled reads 0; default 1, as the GPU tests run on a GPU: benchmarks/gpu_check.sh starts MPS)
_MPS = os.environ.get("RINGCOMM_EMULATED_MPS", "1").strip() != "0"
#: RINGCOMM_EMULATED_JITTER=<ms>: queued work sometimes waits up to that long before it runs
_JITTER = float(os.environ.get("RINGCOMM_EMULATED_JITTER", "0") or 0) / 1000.0
_rng = random.Random(os.getpid())
_BLOCK = 2 << 20
_ALIGN = 512
_ids = itertools.count(3)  # stream handles: 1 and 2 are CUDA's cudaStreamLegacy and cudaStreamPerThread
#: the process-wide lock of everything queued: queue manipulation and execution hold it (an op runs
#: under it); a host wait or the progress thread releases it while a ring kernel's blocks run
_lock = threading.RLock()
_progress = threading.Condition(_lock)  # wakes the progress thread (a ring kernel was queued)
_POLL = 0.00002  # seconds between two looks at a running ring kernel (a GPU's stream goes on at once)
_WORK_QUEUES = max(
    1, int(os.environ.get("RINGCOMM_EMULATED_WORK_QUEUES") or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") or 8)
)
_work_queue_ids = itertools.count()
_kernels_run = 0  # kernel launches executed (not queued) by this process


# --------------------------------------------------------------------------------- devices, errors
#: the CUDA runtime's error names and strings (cudaGetErrorName, cudaGetErrorString) of the errors
#: the emulation raises
_CUDA_ERRORS = {
    1: ("cudaErrorInvalidValue", "invalid argument"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    201: ("cudaErrorDeviceUninitialized", "invalid device context"),
    205: ("cudaErrorAlreadyMapped", "image is already mapped"),
    217: ("cudaErrorPeerAccessUnsupported", "peer access is not supported between these two devices"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    704: ("cudaErrorPeerAccessAlreadyEnabled", "peer access is already enabled"),
    705: ("cudaErrorPeerAccessNotEnabled", "peer access has not been enabled"),
    900: ("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    901: ("cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"),
    905: ("cudaErrorStreamCaptureIsolation", "dependency created on uncaptured work in another stream"),
    906: (
        "cudaErrorStreamCaptureImplicit",
        "operation would make the legacy stream depend on a capturing blocking stream",
    ),
}
_ERROR_BY_NAME = {name: status for status, (name, _) in _CUDA_ERRORS.items()}
#: the driver's (cuGetErrorName, cuGetErrorString)
_CU_ERRORS = {400: ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle")}


class CUDARuntimeError(RuntimeError):
    """cupy_backends/cuda/api/runtime.pyx's: ``CUDARuntimeError(status)``, ``.status`` the cudaError_t,
    str() "cudaErrorName: cudaGetErrorString". The emulation also raises it with a message of its own
    that starts with the error's name ("cudaErrorInvalidValue: why"); ``.status`` is then that name's."""

    def __init__(self, status) -> None:
        self._arg = status
        if isinstance(status, int):
            self.status = status
            name, text = _CUDA_ERRORS.get(status, ("cudaErrorUnknown", "unknown error"))
            super().__init__(f"{name}: {text}")
        else:
            self.status = _ERROR_BY_NAME.get(str(status).split(":", 1)[0], 999)
            super().__init__(status)

    def __reduce__(self):
        return (type(self), (self._arg,))


class CUDADriverError(RuntimeError):
    """cupy_backends/cuda/api/driver.pyx's (what CuPy's kernel launch, cuLaunchKernel, raises):
    ``.status`` the CUresult, str() "CUDA_ERROR_NAME: cuGetErrorString"."""

    def __init__(self, status: int) -> None:
        self.status = int(status)
        name, text = _CU_ERRORS.get(self.status, ("CUDA_ERROR_UNKNOWN", "unknown error"))
        super().__init__(f"{name}: {text}")

    def __reduce__(self):
        return (type(self), (self.status,))


def _device_count() -> int:
    """cudaGetDeviceCount: RINGCOMM_EMULATED_DEVICES (default 1)."""
    text = os.environ.get("RINGCOMM_EMULATED_DEVICES", "").strip() or "1"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"RINGCOMM_EMULATED_DEVICES={text!r}: expected a number of devices >= 1")
    return n


def _peer_rule():
    """RINGCOMM_EMULATED_PEER_ACCESS: "all" (default), "none", or a list of groups ("0-1,2-3")."""
    text = os.environ.get("RINGCOMM_EMULATED_PEER_ACCESS", "").strip().lower() or "all"
    if text in ("all", "none"):
        return text
    groups = []
    for part in text.split(","):
        try:
            groups.append({int(m) for m in part.strip().split("-")})
        except ValueError:
            raise ValueError(
                f"RINGCOMM_EMULATED_PEER_ACCESS={text!r}: expected all, none or groups of device "
                "ids joined by '-' and separated by ',' (e.g. 0-1,2-3)"
            ) from None
    return groups


def _check_device(device) -> int:
    """A device ordinal, or CUDARuntimeError(cudaErrorInvalidDevice) as the CUDA runtime raises."""
    device = int(device)
    if not 0 <= device < _device_count():
        raise CUDARuntimeError(101)
    return device


def _can_access(device: int, peer: int) -> bool:
    """cudaDeviceCanAccessPeer's answer for valid ordinals; 0 for the device itself, as CUDA answers
    (CuPy's device.pyx _enable_peer_access never asks it for device == peer)."""
    if device == peer:
        return False
    rule = _peer_rule()
    if rule in ("all", "none"):
        return rule == "all"
    return any(device in g and peer in g for g in rule)


#: (device, peer): cudaDeviceEnablePeerAccess(peer) was called with device current (process-wide,
#: as the primary contexts are)
_peer_enabled: set[tuple[int, int]] = set()


def _pci_bus_id(device: int) -> str:
    """cudaDeviceGetPCIBusId's form, "[domain]:[bus]:[device].[function]" in hex."""
    return f"0000:{device:02X}:00.0"


# ----------------------------------------------------------------------------------- device memory
_ctx = threading.local()  # per thread: .device (the current device), .current (the current context)


def _current_device() -> int:
    """cudaGetDevice: the calling thread's current device (0 until the thread sets one)."""
    return getattr(_ctx, "device", 0)


def _make_context_current() -> None:
    """What the CUDA runtime does at cudaSetDevice (CUDA 12+) and at a thread's first runtime call
    that needs a context (cudaMalloc, a stream's or an event's creation, a copy; CuPy makes one
    before a kernel launch or a pointer query): make the current device's primary context current.
    cudaGetDevice, CuPy's pool reusing a chunk, and ``with Device(i)`` where i is current already
    make none. Driver calls (tests/emulated/cuda/bindings/driver.py) on a thread without one fail
    with CUDA_ERROR_INVALID_CONTEXT, as on a GPU."""
    _ctx.current = _current_device()


def _has_context() -> bool:
    return getattr(_ctx, "current", None) is not None


def _set_device(device) -> None:
    """cudaSetDevice: the thread's current device; it also makes its primary context current (CUDA 12+)."""
    _ctx.device = _check_device(device)
    _make_context_current()


#: the byte new device and pinned memory holds (CUDA does not clear an allocation): 0xa5a5a5a5 is a
#: plain float32 (-2.9e-16), so a result that reads memory nothing wrote is wrong, not NaN, and a
#: counter nothing zeroed is huge
GARBAGE = 0xA5


class _Allocation:
    """One shared-memory mapping: an allocation of this process, or a neighbour's opened by IPC."""

    def __init__(
        self,
        size: int,
        name: str | None = None,
        ipc: bool = True,
        imported: bool = False,
        exporter_device: int | None = None,
    ) -> None:
        self.size = max(int(size), 1)
        self.imported = imported
        # the device it belongs to: the current one when it was allocated, or for an IPC mapping the
        # one it was opened on; exporter_device: the device of the exporter's allocation
        self.device = _current_device()
        self.exporter_device = self.device if exporter_device is None else int(exporter_device)
        fresh = name is None
        if fresh:
            name = f"/dev/shm/ringcomm-emu-{os.getpid()}-{next(_ids)}"
            with open(name, "wb") as f:
                f.truncate(self.size)
            _own_files.append(name)
        self.name = name
        with open(name, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), self.size)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        if fresh:  # "The memory is not cleared" (cudaMalloc): what was there, here a pattern, never zeros
            ctypes.memset(self.ptr, GARBAGE, self.size)
        self.ipc = ipc
        self.buffer_id = next(_ids)
        self.live = 0  # pool blocks: chunks in use
        _regions[self.ptr] = self

    def free(self) -> None:
        """cudaFree. CUDA leaves freeing memory that another process still has open through IPC
        undefined; the emulation makes it an error (raised at the next synchronizing call)."""
        openers = [f for f in glob.glob(f"{self.name}.open-*") if _alive(int(f.rsplit("-", 1)[1]))]
        if openers:
            _violations.append(
                f"emulated CUDA: cudaFree of {self.size} bytes that process(es) "
                f"{[int(f.rsplit('-', 1)[1]) for f in openers]} still have open through CUDA IPC (undefined in CUDA)"
            )
        _regions.pop(self.ptr, None)
        try:
            os.unlink(self.name)
        except OSError:
            pass
        # the mapping stays: a kernel of a buggy caller may still touch it; reads then see stale
        # data instead of crashing the test process


_regions: dict[int, _Allocation] = {}
_own_files: list[str] = []
_violations: list[str] = []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _check_violations() -> None:
    if _violations:
        raise RuntimeError("; ".join(_violations))


@atexit.register
def _cleanup() -> None:
    for name in _own_files:
        try:
            os.unlink(name)
        except OSError:
            pass
    for name in list(_open_markers.values()):
        try:
            os.unlink(name)
        except OSError:
            pass


def _region(ptr: int, nbytes: int = 1) -> _Allocation:
    for base, a in list(_regions.items()):  # a snapshot: queued work also runs on the progress thread
        if base <= ptr and ptr + max(nbytes, 0) <= base + a.size:
            return a
    raise RuntimeError(f"emulated CUDA: address {ptr:#x} (+{nbytes} bytes) is not device memory")


def _device_region(ptr: int, nbytes: int, device: int, what: str) -> _Allocation:
    """The allocation of ``ptr`` for work on ``device`` (a kernel): refused unless it is memory of
    ``device`` (an allocation made there or an IPC mapping opened there) or of a device that
    ``device`` enabled peer access to. On a GPU the kernel would fault with an illegal address."""
    a = _region(ptr, nbytes)
    if a.device != device and (device, a.device) not in _peer_enabled:
        kind = "an IPC mapping opened on device" if a.imported else "memory of device"
        raise RuntimeError(
            f"emulated CUDA: {what} on device {device} touches address {ptr:#x} (+{nbytes} bytes), {kind} "
            f"{a.device}, and device {device} has no peer access to device {a.device}: an illegal memory "
            "access on a GPU (cudaErrorIllegalAddress)"
        )
    return a


def _is_device(ptr: int) -> bool:
    return any(base <= ptr < base + a.size for base, a in list(_regions.items()))


class _PoolChunk:
    """A chunk of a pool block. Freed chunks go back to the free list of the stream that was
    current when they were allocated, as in CuPy's stream-aware pool (memory.pyx: Chunk.stream_ptr):
    only later allocations on that stream reuse them."""

    def __init__(self, block: _Allocation, offset: int, size: int, stream_ptr: int) -> None:
        self.block, self.offset, self.size, self.stream_ptr = block, offset, size, stream_ptr
        self.ptr = block.ptr + offset
        block.live += 1

    def __del__(self) -> None:
        try:
            self.block.live -= 1
            _pool_free[(self.block.device, self.size, self.stream_ptr)].append((self.block, self.offset))
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_pool_free: dict[tuple[int, int, int], list] = collections.defaultdict(list)  # (device, size, stream)
_pool_block: dict[int, list] = {}  # per device: current block, bump offset
_pool_blocks: list[_Allocation] = []


def _pool_alloc(nbytes: int) -> _PoolChunk:
    """From the current device's pool (CuPy's MemoryPool keeps one SingleDeviceMemoryPool per device)."""
    size = max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN)
    stream = get_current_stream().ptr
    dev = _current_device()
    with _lock:
        if _pool_free[(dev, size, stream)]:  # (a chunk the pool holds: no CUDA call)
            block, offset = _pool_free[(dev, size, stream)].pop()
            return _PoolChunk(block, offset, size, stream)
    _unsafe_call()  # (else CuPy's pool calls cudaMalloc: here a part of a bigger shared block)
    _make_context_current()
    with _lock:
        block, used = _pool_block.get(dev, (None, 0))
        if block is None or used + size > block.size:
            ipc = os.environ.get("RINGCOMM_EMULATED_NO_IPC_POOL", "") != "1"
            block = _Allocation(max(_BLOCK, size), ipc=ipc)
            _pool_blocks.append(block)
            used = 0
        _pool_block[dev] = [block, used + size]
        return _PoolChunk(block, used, size, stream)


class MemoryPool:
    """cupy.cuda.MemoryPool's bookkeeping calls, each on the current device's pool (as CuPy's:
    ``self._pools[device.get_device_id()]``); free_all_blocks() frees every pool block none of
    whose chunks is in use (CuPy frees free chunks that are whole allocations), as CuPy itself does
    before retrying an allocation that ran out of memory."""

    def free_all_blocks(self, stream=None) -> None:
        dev = _current_device()
        with _lock:
            idle = [b for b in _pool_blocks if b.live == 0 and b.device == dev]
            for b in idle:
                _pool_blocks.remove(b)
                for key in list(_pool_free):
                    _pool_free[key] = [(blk, off) for blk, off in _pool_free[key] if blk is not b]
                if _pool_block.get(dev, [None])[0] is b:
                    del _pool_block[dev]
                b.free()
        _check_violations()

    def used_bytes(self) -> int:
        dev = _current_device()
        return sum(b.size for b in _pool_blocks if b.live and b.device == dev)

    def total_bytes(self) -> int:
        dev = _current_device()
        return sum(b.size for b in _pool_blocks if b.device == dev)


_default_pool = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _default_pool


class Memory:
    """A direct allocation (cudaMalloc): always exportable; cudaFree when the object goes."""

    def __init__(self, size: int) -> None:
        _unsafe_call()
        _make_context_current()
        self.device_id = _current_device()  # CuPy's Memory.device_id
        self._a = _Allocation(size)
        self.ptr, self.size = self._a.ptr, int(size)

    def __del__(self) -> None:
        try:
            self._a.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class UnownedMemory:
    """CuPy's: ``device_id`` < 0 means the device of the pointer (cudaPointerGetAttributes; the
    current device for host memory), which a null pointer does not have."""

    def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
        self.ptr, self.size, self.owner = int(ptr), int(size), owner
        if device_id < 0:
            if self.ptr == 0:
                raise RuntimeError("UnownedMemory requires explicit device ID for a null pointer.")
            _make_context_current()  # (CuPy's runtime._ensure_context before cudaPointerGetAttributes)
            device_id = _device_of(self.ptr)
        self.device_id = int(device_id)


def _device_of(ptr: int) -> int:
    """The device of the memory at ``ptr``; the current device for memory that is not device memory."""
    for base, a in list(_regions.items()):
        if base <= ptr < base + a.size:
            return a.device
    return _current_device()


class MemoryPointer:
    def __init__(self, mem: object, offset: int) -> None:
        self.mem, self.offset = mem, int(offset)
        self.ptr = mem.ptr + self.offset
        self.device_id = getattr(mem, "device_id", None)
        if self.device_id is None:  # a pool chunk
            self.device_id = mem.block.device if hasattr(mem, "block") else _current_device()

    @property
    def device(self) -> Device:
        return Device(self.device_id)


class _Pinned(bytearray):
    @property
    def ptr(self) -> int:
        return np.frombuffer(self, np.uint8).ctypes.data


def alloc_pinned_memory(nbytes: int) -> _Pinned:
    p = _Pinned(bytes([GARBAGE]) * int(nbytes))  # (cudaHostAlloc does not clear it either)
    _pinned[id(p)] = p
    return p


#: live pinned host buffers (cudaHostAlloc'd memory: with unified addressing its device pointer is
#: its host address, for every device)
_pinned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # by id (a bytearray is unhashable)


# ---------------------------------------------------------------------------------- streams, events
class _Marker:
    """A point in a stream's queue: ``ran`` once everything queued before it has run."""

    def __init__(self) -> None:
        self.ran = False

    def __call__(self) -> None:
        self.ran = True


class _Stall:
    """Queued work that never completes (a hung kernel): :func:`_stall` puts one on a stream."""


class _Wait:
    """A stream's wait for a point (a marker) in another stream: that stream runs up to it first."""

    def __init__(self, stream: Stream, marker: _Marker) -> None:
        self.stream, self.marker = stream, marker

    def __call__(self) -> None:
        pass  # run (popped) only once the marker was reached: see Stream._advance


class _Running:
    """A kernel whose blocks wait for each other and for other processes (csrc/ring.cu's ring
    executor). As on a GPU, it starts when its stream reaches it, whether or not the host waits
    (the progress thread runs its stream), every block at once, each
    on a thread of its own (a spinning block never holds up another, as with co-resident blocks);
    the stream's later work runs once every block has returned. ``body(block)`` runs one block;
    ``check()``, when given, first (an illegal address it finds ends the kernel before any block runs)."""

    eager = True  # (the progress thread runs its stream up to it)

    def __init__(self, blocks: int, body, done, check=None) -> None:
        self.blocks, self.body, self.done, self.check = blocks, body, done, check
        self.threads: list[threading.Thread] | None = None
        self.errors: list[str] = []
        self.ran = False

    def start(self) -> None:
        if self.check is not None:
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - reported at the next synchronize
                self.errors.append(f"{type(e).__name__}: {e}")
                self.threads = []
                return

        def block(b: int) -> None:
            try:
                self.body(b)
            except Exception as e:  # noqa: BLE001 - reported at the next synchronize
                self.errors.append(f"{type(e).__name__}: {e}")

        self.threads = [threading.Thread(target=block, args=(b,), daemon=True) for b in range(self.blocks)]
        for t in self.threads:
            t.start()

    def finished(self) -> bool:
        return self.threads is not None and not any(t.is_alive() for t in self.threads)

    def __call__(self) -> None:
        self.ran = True
        if self.errors:
            raise RuntimeError("; ".join(self.errors))
        self.done()


def _hang() -> None:
    """A host wait on work that can never complete (a hung stream): it never returns, as on a GPU."""
    while True:
        time.sleep(1)


class Stream:
    """A lazy stream. Like CUDA's: work on a blocking stream (the default) runs after the work
    queued before it on the legacy null stream, and work on the null stream after the work queued
    before it on every blocking stream; ``non_blocking=True`` streams are not ordered with the null
    stream. ``device_id``: the device current when it was made (CuPy's Stream.device_id; -1 for the
    null stream, which is every device's). A stream with a ring kernel queued is run by the
    progress thread up to its last one (``_last_eager``)."""

    _by_ptr: dict[int, Stream] = {}

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        if not null:
            _make_context_current()  # (cudaStreamCreateWithFlags, a runtime call)
        self.ptr = 0 if null else next(_ids)
        self.blocking = not non_blocking and not null
        self._device_id = -1 if null or ptds else _current_device()
        self._queue: collections.deque = collections.deque()
        self._last_eager = None
        self._work_queue = None if null else next(_work_queue_ids) % _WORK_QUEUES
        self._capture: list | None = None  # begin_capture(): the kernels captured so far
        with _lock:
            Stream._by_ptr[self.ptr] = self

    def _mark(self) -> _Marker | None:
        """A marker after the work queued so far (None when nothing is queued). Under ``_lock``."""
        if not self._queue:
            return None
        m = _Marker()
        self._queue.append(m)
        return m

    def _enqueue(self, fn) -> None:
        if self._capture is not None:
            self._captured(fn)
            return
        with _lock:
            if self.ptr == 0:  # the current device's null stream: after that device's blocking streams
                dev = _current_device()
                before = [s for s in list(Stream._by_ptr.values()) if s.blocking and s.device_id == dev]
            else:
                before = [Stream.null] if self.blocking else []
                if self._work_queue is not None:  # the streams aliased onto this one's work queue
                    before += [
                        s for s in list(Stream._by_ptr.values()) if s is not self and s._work_queue == self._work_queue
                    ]
            for s in before:
                m = s._mark()
                if m is not None:
                    self._queue.append(_Wait(s, m))
            self._queue.append(fn)
            if getattr(fn, "eager", False):
                self._last_eager = fn
                _start_progress()
                _progress.notify_all()

    def _advance(self, upto=None):
        """Run queued work from the head, never blocking, until ``upto`` (an item of this queue with
        ``ran``; None: everything) has run. True once it has; else why not: "running" (a ring
        kernel is ahead, here or in a stream waited for, whose blocks still run) or "stall"
        (a hung stream is ahead: it never completes). Called with ``_lock`` held."""
        while self._queue:
            if upto is not None and upto.ran:
                return True
            head = self._queue[0]
            if isinstance(head, _Stall):
                return "stall"
            if isinstance(head, _Wait):
                why = head.stream._advance(head.marker)
                if why is not True:
                    return why
            elif isinstance(head, _Running):
                if head.threads is None:
                    head.start()
                if not head.finished():
                    return "running"  # (it may still finish: look again)
            op = self._queue.popleft()
            if _JITTER and _rng.random() < 0.2:
                time.sleep(_rng.random() * _JITTER)  # a slow GPU, now and then: races show up
            op()
        return True if upto is None or upto.ran else "stall"

    def _host_wait(self, upto=None, stall_hangs: bool = True) -> None:
        """A host thread waits until ``upto`` (None: all queued work) has run: while a ring kernel's
        blocks run ahead of it, it polls with the lock released (as on a GPU it waits forever if they
        never return); on a hung stream it never returns (``stall_hangs``) or returns at once,
        leaving the work queued."""
        while True:
            with _lock:
                why = self._advance(upto)
            if why is True:
                return
            if why == "stall":
                if stall_hangs:
                    _hang()
                return
            time.sleep(_POLL)

    def _flush(self, upto=None) -> None:
        """All queued work (blocking, as cudaStreamSynchronize), or up to ``upto`` (never blocking)."""
        if upto is None:
            self._host_wait(None)
        else:
            with _lock:
                self._advance(upto)

    def synchronize(self) -> None:
        self._refuse_in_capture()
        _unsafe_call()
        self._host_wait(None)
        _check_violations()

    # ---- CUDA graphs (stream capture): kernels only, as ringcomm captures them
    def begin_capture(self, mode=None) -> None:
        """cudaStreamBeginCapture in ``mode`` (runtime.streamCaptureMode*; CuPy's default: relaxed).
        Refused on the legacy null stream (by CuPy, a RuntimeError) and on a stream already
        capturing. A global or thread-local capture prohibits unsafe calls (_unsafe_call)."""
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self._capture is not None:
            raise CUDARuntimeError(900)  # cudaErrorStreamCaptureUnsupported
        self._capture = []
        self._capture_mode = _CAPTURE_RELAXED if mode is None else int(mode)
        self._capture_thread = threading.get_ident()

    def is_capturing(self) -> bool:
        """cudaStreamIsCapturing as CuPy raises it: a RuntimeError once an operation the capture
        could not hold invalidated it, and cudaErrorStreamCaptureImplicit for the legacy null
        stream while a blocking stream of the current device captures (the query would join the
        null stream to that capture)."""
        if self.ptr == 0:
            dev = _current_device()
            if any(t._capture is not None and t.blocking and t.device_id == dev for t in list(Stream._by_ptr.values())):
                raise CUDARuntimeError(906)  # cudaErrorStreamCaptureImplicit
            return False
        if self._capture is not None and _INVALIDATED in self._capture:
            raise RuntimeError("the stream was capturing, but an error has invalidated the capture sequence")
        return self._capture is not None

    def end_capture(self) -> Graph:
        """cudaStreamEndCapture: the graph of what was captured; cudaErrorStreamCaptureInvalidated
        when an operation refused during the capture invalidated it."""
        captured, self._capture = self._capture, None
        if captured is None:
            raise CUDARuntimeError(1)  # cudaErrorInvalidValue: not capturing
        if _INVALIDATED in captured:
            raise CUDARuntimeError(901)  # cudaErrorStreamCaptureInvalidated
        return Graph(captured)

    def _captured(self, fn) -> None:
        """Work queued while capturing: a kernel becomes a node of the graph. Anything else the
        emulation does not capture is refused as CUDA refuses an operation the capture cannot hold
        (a copy from pageable host memory, a wait on an event recorded outside the capture:
        cudaErrorStreamCaptureUnsupported / Isolation), which also invalidates the capture."""
        if isinstance(fn, _Running) or getattr(fn, "kernel", False):
            self._capture.append(fn)
            return
        self._capture.append(_INVALIDATED)
        raise CUDARuntimeError(905 if isinstance(fn, _Wait) else 900)

    def _refuse_in_capture(self) -> None:
        if self._capture is not None:  # a synchronization of a capturing stream: refused, invalidating
            self._capture.append(_INVALIDATED)
            raise CUDARuntimeError(900)

    def wait_event(self, event: Event) -> None:
        if event._stream is not None:
            self._enqueue(_Wait(event._stream, event._marker))

    def use(self) -> Stream:
        """Makes this stream current (CuPy's: the with-stack is left as it is, so that leaving a
        ``with`` block makes the stream of the enclosing block current again, not this one)."""
        _streams().current[_stream_device(self)] = self
        return self

    def __enter__(self) -> Stream:
        dev, tls = _stream_device(self), _streams()
        tls.stack[dev].append(self)
        tls.devices.append(dev)  # CuPy records the device, to pop the right stream at exit
        tls.current[dev] = self
        return self

    def __exit__(self, *exc) -> None:
        tls = _streams()
        dev = tls.devices.pop()
        tls.stack[dev].pop()
        tls.current[dev] = tls.stack[dev][-1] if tls.stack[dev] else Stream.null

    def __repr__(self) -> str:
        return f"<Stream {self.ptr} (device {self.device_id})>"

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: (version 0, the handle)."""
        return (0, self.ptr)

    @classmethod
    def from_external(cls, obj) -> Stream:
        """CuPy 14's ``Stream.from_external(obj)``: a Stream over the stream that ``obj`` names by
        the CUDA stream protocol (``obj.__cuda_stream__()``, (0, handle)), with CuPy's refusals.
        Here it shares the whole state of the emulated stream of that handle (1, legacy, and 2,
        per-thread, name the null stream), so that work queued through either is one queue. As
        CuPy's, its device_id is -1 (unknown: the current device is used) and it holds ``obj``."""
        try:
            version, ptr = obj.__cuda_stream__()
        except AttributeError as e:
            raise TypeError(
                f"Object of type {type(obj).__name__} does not implement the CUDA stream protocol "
                "(__cuda_stream__ method)"
            ) from e
        except (TypeError, ValueError) as e:
            raise TypeError("__cuda_stream__() must return a 2-tuple of (version, stream_ptr)") from e
        if not isinstance(version, int) or not isinstance(ptr, int):
            raise TypeError(
                f"__cuda_stream__() must return (int, int), got ({type(version).__name__}, {type(ptr).__name__})"
            )
        if version != 0:
            raise TypeError(f"__cuda_stream__() returned unsupported version {version}, only version 0 is supported")
        stream = cls.__new__(cls)
        stream.__dict__ = _by_handle(ptr).__dict__  # (one state: its queue, capture, last ring kernel)
        _external_views.add(stream)
        stream._foreign_stream_ref = obj
        return stream

    @property
    def device_id(self) -> int:
        """The device current when it was made; -1 for the null stream (every device's) and for a
        stream of Stream.from_external."""
        return -1 if self in _external_views else self._device_id

    @property
    def done(self) -> bool:
        """cudaStreamQuery: runs what can run, never blocks (False while a ring kernel ahead runs)."""
        _unsafe_call()
        with _lock:
            m = self._mark()
            return m is None or self._advance(m) is True


_INVALIDATED = object()  # a capture's mark: an operation it could not hold was refused
_CAPTURE_GLOBAL, _CAPTURE_THREAD_LOCAL, _CAPTURE_RELAXED = 0, 1, 2  # cudaStreamCaptureMode


def _exchange_capture_mode(mode: int) -> int:
    """cudaThreadExchangeStreamCaptureMode: the calling thread's capture interaction mode set to
    ``mode`` (CUDA's default: global); the previous one returned."""
    before = getattr(_ctx, "capture_mode", _CAPTURE_GLOBAL)
    _ctx.capture_mode = int(mode)
    return before


def _hardware_device(stream) -> int:
    """The device a stream belongs to on the GPU (its queue's), whatever CuPy's ``device_id`` says
    (-1 for the null stream, an ExternalStream or Stream.from_external: the current device then
    only for the null stream, which is every device's)."""
    dev = stream.__dict__.get("_device_id", -1) if isinstance(stream, Stream) else stream._stream._device_id
    return _current_device() if dev == -1 else dev


def _unsafe_call() -> None:
    """A "potentially unsafe" call during stream capture (cudaMalloc, the example CUDA's
    cudaThreadExchangeStreamCaptureMode gives: CuPy's pool and Memory): refused with
    cudaErrorStreamCaptureUnsupported, invalidating the captures that prohibit it, when the calling
    thread's interaction mode is global and this thread captures in a mode other than relaxed or
    another thread captures in global mode, or thread-local and this thread captures in a mode other
    than relaxed. A relaxed thread is never refused."""
    mode = getattr(_ctx, "capture_mode", _CAPTURE_GLOBAL)
    if mode == _CAPTURE_RELAXED:
        return
    me = threading.get_ident()
    with _lock:
        capturing = [t for t in Stream._by_ptr.values() if t._capture is not None]
    mine = [t for t in capturing if t._capture_thread == me and t._capture_mode != _CAPTURE_RELAXED]
    theirs = [t for t in capturing if t._capture_thread != me and t._capture_mode == _CAPTURE_GLOBAL]
    prohibiting = mine + (theirs if mode == _CAPTURE_GLOBAL else [])
    if prohibiting:
        for t in prohibiting:
            t._capture.append(_INVALIDATED)
        raise CUDARuntimeError(900)  # cudaErrorStreamCaptureUnsupported


class Graph:
    """cupy.cuda.graph.Graph: ``launch(stream=None)`` queues every captured kernel again, in order,
    on ``stream`` (default: the current one), with the arguments they were captured with (a ring
    kernel as a new run of its blocks)."""

    def __init__(self, nodes: list) -> None:
        self._nodes = list(nodes)

    def launch(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else get_current_stream()
        for node in self._nodes:  # (a ring kernel: a new run of its blocks, with its checks)
            again = isinstance(node, _Running)
            stream._enqueue(_Running(node.blocks, node.body, node.done, node.check) if again else node)


_external_views: weakref.WeakSet = weakref.WeakSet()  # the Streams Stream.from_external made
Stream.null = Stream(null=True)


def _streams() -> types.SimpleNamespace:
    """CuPy's stream.pyx _ThreadLocal, per thread: per device the current stream (``use()`` and
    ``with`` set it) and the stack of ``with`` blocks (the null stream below them; leaving a block
    makes the stream under it current), and the devices of the blocks entered, to pop the right one."""
    tls = getattr(_ctx, "streams", None)
    if tls is None:
        tls = _ctx.streams = types.SimpleNamespace(
            current=collections.defaultdict(lambda: Stream.null), stack=collections.defaultdict(list), devices=[]
        )
    return tls


# ------------------------------------------------------------- progress of streams with ring kernels
_progress_thread: threading.Thread | None = None


def _start_progress() -> None:
    """The process's progress thread (a daemon), started with the first ring kernel queued."""
    global _progress_thread
    if _progress_thread is None:
        _progress_thread = threading.Thread(target=_progress_loop, name="emulated-gpu-streams", daemon=True)
        _progress_thread.start()


def _progress_loop() -> None:
    """Run every stream that holds a ring kernel up to its last one, as a GPU runs its streams
    without the host: never blocking on a ring kernel whose blocks still run (it looks again every
    _POLL seconds, with the lock released) nor on a hung stream (it leaves it). A failure of queued
    work (a kernel's) is kept as a sticky error for the next synchronizing call, as CUDA does."""
    with _lock:
        while True:
            polling = False
            for s in list(Stream._by_ptr.values()):
                last = s._last_eager
                if last is None:
                    continue
                try:
                    why = s._advance(last)
                except Exception as e:  # noqa: BLE001 - reported at the next synchronize
                    _violations.append(f"emulated CUDA: queued work failed on {s}: {type(e).__name__}: {e}")
                    why = "running"  # the failed op is gone: go on with the rest soon
                if why is True:
                    if s._last_eager is last:
                        s._last_eager = None
                elif why == "running":
                    polling = True
            _progress.wait(_POLL if polling else None)


def _reset_after_fork() -> None:
    """A forked child has no progress thread, and the lock may have been held by it."""
    global _lock, _progress, _progress_thread
    _lock = threading.RLock()
    _progress = threading.Condition(_lock)
    _progress_thread = None


os.register_at_fork(after_in_child=_reset_after_fork)


def _emulated_kernels_run() -> int:
    """Tests only: how many kernel launches this process has executed so far (not merely queued)."""
    return _kernels_run


def _stream_device(stream: Stream) -> int:
    """CuPy's stream.pyx check_stream_device_match, run by Stream.use() and ``with stream``."""
    cur = _current_device()
    dev = cur if stream.device_id == -1 else stream.device_id
    if dev != cur:
        raise RuntimeError(
            f"The device that the stream is created on ({dev}) does not match with the current device ({cur})"
        )
    return dev


def _by_handle(ptr: int) -> Stream:
    """The emulated stream with the handle ``ptr`` (1, legacy, and 2, per-thread, name the null
    stream); cudaErrorInvalidResourceHandle for a handle no stream has."""
    stream = Stream.null if ptr in (1, 2) else Stream._by_ptr.get(ptr)
    if stream is None:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: no emulated stream with handle {ptr:#x}")
    return stream


class ExternalStream:
    """``cupy.cuda.ExternalStream(ptr, device_id=-1)``: a stream made elsewhere (e.g. by PyTorch),
    known by its handle; a type of its own, as CuPy's (not a Stream), deprecated since CuPy 14 (a
    DeprecationWarning: Stream.from_external instead). Here its work goes to the emulated stream
    with that handle (1, legacy, and 2, per-thread, name the null stream), so that work queued
    through either is one queue: every attribute but ``device_id`` is that stream's. ``device_id``:
    the device given, or -1 (unknown, as CuPy's), checked by ``with`` and ``use()``."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        warnings.warn(
            "ExternalStream is deprecated. Use Stream.from_external() instead to interoperate with external "
            "streams that implement the CUDA stream protocol.",
            DeprecationWarning,
            stacklevel=2,
        )
        object.__setattr__(self, "_stream", _by_handle(int(ptr)))
        object.__setattr__(self, "device_id", int(device_id))

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._stream, name, value)

    use, __enter__, __exit__ = Stream.use, Stream.__enter__, Stream.__exit__

    def __repr__(self) -> str:
        return f"<ExternalStream {self.ptr} (device {self.device_id})>"


def _stall(stream: Stream) -> None:
    """Tests only: from now on nothing queued on ``stream`` completes (as if a kernel hung):
    event queries stay False, and ``synchronize()`` never returns."""
    with _lock:
        stream._queue.append(_Stall())


def get_current_stream(device_id: int = -1) -> Stream:
    """The current stream of the device ``device_id`` (default: the current device)."""
    return _streams().current[_current_device() if device_id == -1 else int(device_id)]


def _host_copy_wait(stream: Stream | None = None) -> None:
    """Before a copy to or from the host: the copy's stream (default: the current one) is waited
    for, as CuPy's synchronous copy does (cudaMemcpyAsync on that stream, then its synchronize), and
    nothing else: work queued on other streams that it is not ordered after (by an event, or the
    legacy null stream's rule) may still be pending, as on a GPU, where it may not have run yet.
    Held by a running ring kernel, it blocks until its blocks return; a hung stream is left queued."""
    stream = stream if stream is not None else get_current_stream()
    stream._refuse_in_capture()  # (its synchronize: refused in a capture, invalidating it)
    _unsafe_call()
    m = _Marker()  # the copy queued on its stream: after what that stream is ordered after
    stream._enqueue(m)
    stream._host_wait(m, stall_hangs=False)


def _flush_device(device: int) -> None:
    """cudaDeviceSynchronize on ``device``: its streams and the null stream (blocking while a ring
    kernel's blocks run in one of them; a hung stream is left queued)."""
    with _lock:
        marks = [(s, s._mark()) for s in list(Stream._by_ptr.values()) if s.device_id in (device, -1)]
    for s, m in marks:
        if m is not None:
            s._host_wait(m, stall_hangs=False)


class Event:
    """``device_id``: the device current when it was made (cudaEventCreate's). Recording it on a
    stream of another device fails with cudaErrorInvalidResourceHandle: "cudaEventRecord() will fail
    if the input event and input stream are associated to different devices" (CUDA C++ Programming
    Guide, Stream and Event Behavior); waiting for it from another device's stream is allowed."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self._stream = None
        self._marker = None
        _make_context_current()  # (cudaEventCreateWithFlags, a runtime call: the context is made current)
        self.device_id = _current_device()

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else get_current_stream()
        if _hardware_device(stream) != self.device_id:
            raise CUDARuntimeError(400)
        marker = _Marker()
        stream._enqueue(marker)
        self._stream, self._marker = stream, marker

    @property
    def done(self) -> bool:
        """cudaEventQuery: runs what can run, never blocks."""
        _unsafe_call()
        if self._stream is not None:
            with _lock:
                self._stream._advance(self._marker)
            return self._marker.ran
        return True

    def synchronize(self) -> None:
        """cudaEventSynchronize: blocks while a ring kernel runs ahead of the work before it; never returns
        on a hung stream."""
        _unsafe_call()
        if self._stream is not None:
            self._stream._host_wait(self._marker)


class Device:
    """cupy/cuda/device.pyx's Device. As there, the constructor does not check the ordinal (an invalid
    one fails at use(), ``with``, pci_bus_id, ... with cudaErrorInvalidDevice); ``with Device(i)``
    makes i current and restores the thread's previous device at exit (a per-thread stack)."""

    def __init__(self, device: int | None = None) -> None:
        self.id = _current_device() if device is None else int(device)

    def __int__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and self.id == other.id

    __hash__ = None  # (CuPy's Device compares but is not hashable)

    def use(self) -> Device:
        _set_device(self.id)  # cudaSetDevice initialises the primary context (CUDA 12+)
        return self

    @property
    def pci_bus_id(self) -> str:
        """Device i: "0000:<i>:00.0" (device 0's is the same in every process: ranks on device 0 share
        one GPU, the shared-GPU test)."""
        return _deviceGetPCIBusId(self.id)

    @property
    def compute_capability(self) -> str:
        _check_device(self.id)
        return "90"

    def synchronize(self) -> None:
        _unsafe_call()
        _flush_device(_check_device(self.id))

    def __enter__(self) -> Device:
        prev = _current_device()
        stack = _ctx.__dict__.setdefault("device_stack", [])
        stack.append(prev)
        if self.id != prev:  # (CuPy's: no cudaSetDevice, so no context made current, when it is current)
            _set_device(self.id)
        return self

    def __exit__(self, *exc) -> None:
        _set_device(_ctx.device_stack.pop())


# -------------------------------------------------------------------------------------- ndarray
class _Flags:
    c_contiguous = True
    f_contiguous = True
    writeable = True


class ndarray:
    """A C-contiguous array in emulated device memory (1-D views, slices with step 1, reshape)."""

    def __init__(self, shape, dtype=float, memptr: MemoryPointer | None = None) -> None:
        self.shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.data = memptr if memptr is not None else MemoryPointer(_pool_alloc(self.nbytes), 0)
        self.base = None
        self.flags = _Flags()

    itemsize = property(lambda self: self.dtype.itemsize)
    ndim = property(lambda self: len(self.shape))

    @property
    def device(self) -> Device:
        return Device(self.data.device_id)

    @property
    def strides(self) -> tuple[int, ...]:
        out, step = [], self.dtype.itemsize
        for dim in reversed(self.shape):
            out.append(step)
            step *= max(dim, 1)
        return tuple(reversed(out))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": [("", self.dtype.str)],
            "data": (self.data.ptr, False),
            "version": 3,
            "strides": None,
        }

    def _np(self) -> np.ndarray:
        """A numpy view of the memory (host code only; kernels go through the harness)."""
        if self.nbytes == 0:
            return np.empty(self.shape, self.dtype)
        _region(self.data.ptr, self.nbytes)
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.data.ptr)
        return np.frombuffer(raw, np.uint8).view(self.dtype).reshape(self.shape)

    def _view(self, offset_bytes: int, shape, dtype=None) -> ndarray:
        v = ndarray(shape, dtype or self.dtype, MemoryPointer(self.data.mem, self.data.offset + offset_bytes))
        v.base = self if self.base is None else self.base
        return v

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if key is Ellipsis or key == slice(None):
            return self._view(0, self.shape)
        if isinstance(key, slice) and self.ndim == 1:
            start, stop, step = key.indices(self.size)
            if step != 1:
                raise NotImplementedError("emulated cupy: slices with a step")
            stop = max(stop, start)
            return self._view(start * self.itemsize, (stop - start,))
        raise NotImplementedError(f"emulated cupy: index {key!r}")

    def __setitem__(self, key, value) -> None:
        target = self[key]
        if isinstance(value, ndarray):
            src = value

            def op() -> None:
                target._np()[...] = src._np()
        else:
            val = np.asarray(value)

            def op() -> None:
                target._np()[...] = val

        get_current_stream()._enqueue(op)

    def reshape(self, *shape) -> ndarray:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
        shape = tuple((self.size // known if known else 0) if s == -1 else int(s) for s in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {shape}")
        return self._view(0, shape)

    def ravel(self) -> ndarray:
        return self.reshape(-1)

    def view(self, dtype) -> ndarray:
        dtype = np.dtype(dtype)
        if self.nbytes % dtype.itemsize:
            raise ValueError("emulated cupy: view with a dtype that does not divide the size")
        return self._view(0, (self.nbytes // dtype.itemsize,), dtype)

    def _unary(self, fn, dtype=None) -> ndarray:
        out = ndarray(self.shape, dtype or self.dtype)
        src = self
        get_current_stream()._enqueue(lambda: out._np().__setitem__(Ellipsis, fn(src._np())))
        return out

    def astype(self, dtype) -> ndarray:
        return self._unary(lambda a: a.astype(dtype), np.dtype(dtype))

    def copy(self) -> ndarray:
        return self._unary(lambda a: a.copy())

    def fill(self, value) -> None:
        self[...] = value

    def __mul__(self, other):
        return self._unary(
            lambda a: a * other,
            np.result_type(self.dtype, np.asarray(other).dtype) if not isinstance(other, (int, float)) else self.dtype,
        )

    __rmul__ = __mul__

    def __add__(self, other):
        o = other._np if isinstance(other, ndarray) else (lambda: other)
        return self._unary(lambda a: a + o(), self.dtype)

    __radd__ = __add__

    def __eq__(self, other):
        o = other._np if isinstance(other, ndarray) else (lambda: other)
        return self._unary(lambda a: a == o(), np.dtype(bool))

    def __ne__(self, other):
        o = other._np if isinstance(other, ndarray) else (lambda: other)
        return self._unary(lambda a: a != o(), np.dtype(bool))

    __hash__ = None

    def _reduction(self, fn, dtype) -> ndarray:
        """CuPy's reductions: a 0-d array, computed on the current stream."""
        out, src = ndarray((), dtype), self
        get_current_stream()._enqueue(lambda: out._np().__setitem__(Ellipsis, fn(src._np())))
        return out

    def sum(self) -> ndarray:
        return self._reduction(np.sum, np.sum(np.zeros(0, self.dtype)).dtype)

    def all(self) -> ndarray:
        return self._reduction(np.all, np.dtype(bool))

    def __float__(self) -> float:  # (CuPy: a size-1 array, read back)
        return float(self.get())

    def __bool__(self) -> bool:  # (CuPy: a size-1 array, read back; else numpy's ValueError)
        return bool(self.get())

    def __int__(self) -> int:
        return int(self.get())

    def get(self, stream=None, out: np.ndarray | None = None) -> np.ndarray:
        _host_copy_wait(stream)
        _check_violations()
        if out is None:
            return self._np().copy()
        out[...] = self._np()  # CuPy's get(out=...): into a host array of the same shape
        return out

    def set(self, arr: np.ndarray) -> None:
        _host_copy_wait()
        self._np()[...] = arr

    def __repr__(self) -> str:
        return f"emulated_cupy.ndarray(shape={self.shape}, dtype={self.dtype}, ptr={self.data.ptr:#x})"


def asarray(a, dtype=None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None else a.astype(dtype)
    if hasattr(a, "__cuda_array_interface__"):
        cai = a.__cuda_array_interface__
        dt = np.dtype(cai["typestr"])
        n = int(np.prod(cai["shape"], dtype=np.int64))
        ptr = cai["data"][0]
        mem = UnownedMemory(ptr, n * dt.itemsize, a, _device_of(ptr) if ptr else _current_device())
        return ndarray(cai["shape"], dt, MemoryPointer(mem, 0))
    host = np.array(a, dtype=dtype, order="C")  # a private copy: the transfer is queued
    out = ndarray(host.shape, host.dtype)
    if host.size:  # cudaMemcpyAsync on the current stream, as CuPy's ndarray.set does
        get_current_stream()._enqueue(lambda: out._np().__setitem__(Ellipsis, host))
    return out


_DL_DTYPES = {
    (0, 8): np.int8,
    (0, 16): np.int16,
    (0, 32): np.int32,
    (0, 64): np.int64,
    (1, 8): np.uint8,
    (1, 16): np.uint16,
    (1, 32): np.uint32,
    (1, 64): np.uint64,
    (2, 16): np.float16,
    (2, 32): np.float32,
    (2, 64): np.float64,
}


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLPackOwner:
    """Calls a consumed DLManagedTensor's deleter when the last array over its memory goes."""

    def __init__(self, managed: int, deleter: int) -> None:
        self.managed, self.deleter = managed, deleter

    def __del__(self) -> None:
        if self.deleter:
            ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(self.deleter)(self.managed)


_CAPSULE_NAMES = {b"dltensor": b"used_dltensor", b"dltensor_versioned": b"used_dltensor_versioned"}


def from_dlpack(array, *, device=None, copy=None) -> ndarray:
    """CuPy 14's: with the tensor's device current (cudaSetDevice, the previous one restored after),
    the producer is given that device's current stream (the null stream as 1, cudaStreamLegacy) and
    asked for DLPack 1.0 first; bfloat16 comes as ml_dtypes.bfloat16. C-contiguous tensors only."""
    dev_type, dev_id = array.__dlpack_device__()
    if device is not None:
        raise NotImplementedError("from_dlpack() does not support device yet.")
    if dev_type not in (2, 13):
        raise TypeError(f"Unsupported array type: {dev_type}")
    prev = _current_device()
    try:
        _set_device(dev_id)
        stream = get_current_stream().ptr or 1
        try:
            capsule = array.__dlpack__(stream=stream, max_version=(1, 0), copy=copy)
        except TypeError:
            if copy is not None:
                raise
            capsule = array.__dlpack__(stream=stream)
    finally:
        _set_device(prev)
    capi = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)  # private: pythonapi's are shared
    is_valid, get_pointer, set_name = (
        capi((f, ctypes.pythonapi)) for f in ("PyCapsule_IsValid", "PyCapsule_GetPointer", "PyCapsule_SetName")
    )
    name = next((n for n in _CAPSULE_NAMES if is_valid(capsule, n)), None)
    if name is None:
        raise ValueError("A DLPack tensor object cannot be consumed multiple times")
    managed = get_pointer(capsule, name)
    if name == b"dltensor":  # DLManagedTensor: dl_tensor, manager_ctx, deleter
        t = _DLTensor.from_address(managed)
        deleter = ctypes.c_void_p.from_address(managed + ctypes.sizeof(_DLTensor) + 8).value
    else:  # DLManagedTensorVersioned: version, manager_ctx, deleter, flags, dl_tensor
        t = _DLTensor.from_address(managed + 32)
        deleter = ctypes.c_void_p.from_address(managed + 16).value
    set_name(capsule, _CAPSULE_NAMES[name])  # static bytes: they live as long as the module
    owner = _DLPackOwner(managed, deleter)
    if t.device_type not in (2, 13):
        raise RuntimeError(
            "CuPy is built against CUDA, different from the backend that backs the incoming DLPack tensor"
        )
    if (t.code, t.bits) == (4, 16):
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    elif (t.code, t.bits) in _DL_DTYPES:
        dtype = np.dtype(_DL_DTYPES[(t.code, t.bits)])
    else:
        raise TypeError(f"Unsupported dtype. dtype code: {t.code}")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        want = [int(np.prod(shape[i + 1 :], dtype=np.int64)) for i in range(t.ndim)]  # C order, in elements
        if any(t.strides[i] != want[i] for i in range(t.ndim) if shape[i] > 1):
            raise NotImplementedError("emulated cupy: from_dlpack of a non-C-contiguous tensor")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mem = UnownedMemory((t.data or 0) + t.byte_offset, nbytes, owner, t.device_id)  # CuPy: the DLPack device
    return ndarray(shape, dtype, MemoryPointer(mem, 0))


def asnumpy(a) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def empty(shape, dtype=float) -> ndarray:
    return ndarray(shape, dtype)


def empty_like(a: ndarray) -> ndarray:
    return ndarray(a.shape, a.dtype)


def zeros(shape, dtype=float) -> ndarray:
    return asarray(np.zeros(shape, dtype))


def ones(shape, dtype=float) -> ndarray:
    return asarray(np.ones(shape, dtype))


def full(shape, value, dtype=None) -> ndarray:
    return asarray(np.full(shape, value, dtype))


def arange(*args, dtype=None) -> ndarray:
    return asarray(np.arange(*args, dtype=dtype))


def copyto(dst: ndarray, src, casting: str = "same_kind", where=None) -> None:
    """CuPy's copyto: ``src`` (an array or a scalar) into ``dst`` under ``casting``, queued on the
    current stream; CuPy's refusal of a cast the rule forbids (TypeError, before anything is queued)."""
    from_dtype = src.dtype if isinstance(src, ndarray) else np.asarray(src).dtype
    if isinstance(src, ndarray) and not np.can_cast(from_dtype, dst.dtype, casting):
        raise TypeError(f"Cannot cast {from_dtype} to {dst.dtype} in {casting} casting mode")
    if where is not None:
        raise NotImplementedError("emulated cupy: copyto(where=...)")
    value = src._np if isinstance(src, ndarray) else (lambda: src)
    get_current_stream()._enqueue(lambda: np.copyto(dst._np(), value(), casting="unsafe"))


def multiply(x1: ndarray, x2, out: ndarray | None = None) -> ndarray:
    """CuPy's ufunc on device arrays (x2 an array or a scalar), queued on the current stream."""
    if out is None:
        out = ndarray(x1.shape, np.result_type(x1.dtype, x2.dtype if isinstance(x2, ndarray) else x2))
    other = x2._np if isinstance(x2, ndarray) else (lambda: x2)
    get_current_stream()._enqueue(lambda: np.multiply(x1._np(), other(), out=out._np()))
    return out


# ------------------------------------------------------------------------------------------ kernels
_DT = ["f16", "bf16", "f32", "f64", "i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64"]
_OPS = ["sum", "prod", "min", "max"]
_harness = None


def _lib():
    global _harness
    if _harness is None:
        path = os.environ.get("RINGCOMM_EMULATED_HARNESS")
        if not path:
            raise RuntimeError("emulated cupy: set RINGCOMM_EMULATED_HARNESS to the built tests/csrc_harness.cpp")
        lib = ctypes.CDLL(path)
        u64, vp = ctypes.c_uint64, ctypes.c_void_p
        lib.rc_host_reduce.argtypes = [ctypes.c_int, ctypes.c_int, vp, vp, vp, u64, ctypes.c_int, ctypes.c_double, u64]
        lib.rc_host_copy.argtypes = [vp, vp, u64, u64]
        lib.rc_host_adam.argtypes = [ctypes.c_int] * 3 + [vp] * 5 + [u64, vp, u64]
        lib.rc_host_reduce_acc.argtypes = [ctypes.c_int, ctypes.c_int, vp, vp, vp, u64, u64]
        lib.rc_host_reduce_acc_final.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            vp,
            vp,
            vp,
            u64,
            ctypes.c_int,
            ctypes.c_float,
            u64,
        ]
        lib.rc_host_widen.argtypes = [ctypes.c_int, vp, vp, u64, u64]
        lib.rc_host_misaligned.restype = u64
        i32 = ctypes.c_int
        lib.rc_ring_block.argtypes = [i32, i32, ctypes.c_uint, ctypes.c_uint, vp, i32, i32] + [vp] * 8
        lib.rc_ring_block.argtypes += [u64, u64, u64, i32, i32, u64, i32, ctypes.c_double]
        _harness = lib
    return _harness


_functions: dict[int, _Kernel] = {}  # CUfunction handles (RawKernel.kernel.ptr) -> their kernels


# A kernel's parameters, as cuLaunchKernel reads them: CuPy packs each argument by its own type (a
# numpy scalar by its dtype, a Python int as int64, a float as float64, a bool as 1 byte, an array or
# memory pointer as its 8-byte address: cupy/cuda/function.pyx's _pointer) and hands the driver a
# pointer to each; the driver reads as many bytes as the kernel's C parameter has, whatever the
# argument's size. So an int64 for an ``int`` gives its low half, a float64 for a ``float`` its
# low 4 bytes as a float (garbage), and an argument shorter than its parameter leaves the driver
# reading past it: refused here (on a GPU, undefined bytes). The C types come from the module's own
# source, so a change to a kernel's signature that a launch does not follow fails here.
_GLOBAL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^()]*\)\s*)?([\w#]+)\s*\(([^()]*)\)')
_C_PARAMS = {"unsigned long long": "<u8", "rc::u64": "<u8", "int": "<i4", "double": "<f8", "float": "<f4"}
_signatures: dict[tuple[str, str], list[tuple[str, str]]] = {}


def _signature(name: str, code: str) -> list[tuple[str, str]]:
    """``[(C type, numpy dtype of its bytes)]`` of kernel ``name``'s parameters in ``code`` (the
    definition whose name, up to its first ``##`` macro paste, is the longest prefix of ``name``)."""
    key = (name, code)
    if key not in _signatures:
        found = [(m[1], m[2]) for m in _GLOBAL.finditer(code.replace("\\\n", " "))]
        # (a name pasted by a macro, ``stem##OP##_##SUFFIX``, fits the names that begin with its stem)
        fits = [(d, p) for d, p in found if d == name or ("#" in d and name.startswith(d.split("#")[0]))]
        if not fits:
            raise RuntimeError(f"emulated cupy: no kernel {name!r} in the module's source")
        params = max(fits, key=lambda f: len(f[0].split("#")[0]))[1]
        sig = []
        for param in params.split(","):
            ctype = re.sub(r"\s+", " ", re.sub(r"\bconst\b", "", param.strip().rsplit(None, 1)[0])).strip()
            if "*" not in ctype and ctype not in _C_PARAMS:
                raise RuntimeError(f"emulated cupy: {name}: no rule for a kernel parameter of type {ctype!r}")
            sig.append((ctype, "<u8" if "*" in ctype else _C_PARAMS[ctype]))
        _signatures[key] = sig
    return _signatures[key]


def _kernel_params(name: str, code: str, args: tuple) -> list:
    """The values kernel ``name`` sees for ``args`` (ints and floats): see above."""
    sig = _signature(name, code)
    if len(args) != len(sig):
        raise RuntimeError(f"emulated CUDA: {name} takes {len(sig)} parameters, launched with {len(args)}")
    vals = []
    for i, (arg, (ctype, dtype)) in enumerate(zip(args, sig)):
        if arg is None:
            packed = bytes(8)
        elif isinstance(arg, ndarray):
            packed = np.uint64(arg.data.ptr).tobytes()
        elif isinstance(arg, MemoryPointer):
            packed = np.uint64(arg.ptr).tobytes()
        elif isinstance(arg, (np.generic, np.ndarray)) and np.size(arg) == 1:
            packed = np.asarray(arg).tobytes()
        elif type(arg) in (bool, int, float):  # (numpy_dtype_from_pyscalar: exactly these types)
            kind = {bool: bool, float: np.float64, int: np.uint64 if arg >= 2**63 else np.int64}[type(arg)]
            packed = np.asarray(arg, kind).tobytes()
        else:
            raise TypeError(f"emulated cupy: {name}: unsupported kernel argument {type(arg).__name__}")
        size = np.dtype(dtype).itemsize
        if len(packed) < size:
            raise RuntimeError(
                f"emulated CUDA: {name} parameter {i} ({ctype}) is {size} bytes, but its argument "
                f"({type(arg).__name__}) holds {len(packed)}: the driver would read past it"
            )
        vals.append(np.frombuffer(packed[:size], dtype)[0].item())
    return vals


class _Kernel:
    """CuPy's RawKernel, as RawModule.get_function returns it: ``.kernel`` its Function, whose
    ``ptr`` is the CUfunction the driver's queries take."""

    def __init__(self, name: str, module: RawModule) -> None:
        self.name, self.module = name, module
        self.kernel = types.SimpleNamespace(ptr=next(_ids))
        _functions[self.kernel.ptr] = self
        parts = name.split("_")
        if name == "ringcomm_copy":
            self.kind = "copy"
        elif name.startswith("ringcomm_reduce_") and parts[2] in _OPS and parts[3] in _DT:
            self.kind = "reduce"
        elif (
            name.startswith("ringcomm_reduce_acc_final_")
            and len(parts) == 6
            and parts[4] in _OPS
            and (parts[5] in _DT[:2])
        ):
            self.kind = "acc_final"  # csrc/accumulate.cu: ringcomm_reduce_acc_final_<op>_<f16|bf16>
        elif name.startswith("ringcomm_reduce_acc_") and len(parts) == 5 and parts[3] in _OPS and parts[4] in _DT[:2]:
            self.kind = "acc"  # ringcomm_reduce_acc_<op>_<f16|bf16>
        elif name.startswith("ringcomm_widen_") and len(parts) == 3 and parts[2] in _DT[:2]:
            self.kind = "widen"  # ringcomm_widen_<f16|bf16>
        elif name.startswith("ringcomm_ring_") and len(parts) == 4 and parts[2] in _OPS and parts[3] in _DT:
            self.kind = "ring"  # csrc/ring.cu: ringcomm_ring_<op>_<dtype>
        elif name.startswith("ringcomm_adam_"):
            self.kind = "adam"
        else:
            raise RuntimeError(f"emulated cupy: no kernel {name!r}")

    def __call__(self, grid, block, args, shared_mem: int = 0, stream: Stream | None = None) -> None:
        nthreads = int(np.prod(grid)) * int(np.prod(block))
        if int(np.prod(block)) != 512:
            raise RuntimeError(f"{self.name}: launched with {block} threads per block, the kernels need 512")
        _make_context_current()  # (CuPy's runtime._ensure_context before cuLaunchKernel)
        dev = _current_device()
        if dev not in self.module.loaded:  # (CuPy compiles and loads the module for this device first)
            self.module._load()
        stream = stream if stream is not None else get_current_stream()
        if _hardware_device(stream) != dev:
            # "A kernel launch will fail if it is issued to a stream that is not associated to the
            # current device" (CUDA C++ Programming Guide, Stream and Event Behavior): cuLaunchKernel
            # returns CUDA_ERROR_INVALID_HANDLE, which CuPy raises as CUDADriverError
            raise CUDADriverError(400)

        def touch(ptr: int, nbytes: int) -> None:  # every pointer: device memory this device may access
            _device_region(ptr, nbytes, dev, f"kernel {self.name}")

        vals = _kernel_params(self.name, self.module.code, args)
        parts = self.name.split("_")
        if self.kind == "ring":
            self._launch_ring(int(np.prod(grid)), vals, parts, touch, stream)
            return
        if self.kind == "reduce":
            dst, a, b, n, use_div, div = vals
            item = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}.get(parts[3]) or int(parts[3][1:]) // 8
            for p in (dst, a, b):
                touch(p, n * item)

            def run() -> None:
                rc = _lib().rc_host_reduce(
                    _DT.index(parts[3]), _OPS.index(parts[2]), dst, a, b, n, use_div, div, nthreads
                )
                assert rc == 0
        elif self.kind in ("acc", "acc_final", "widen"):
            dt = parts[-1]
            if self.kind == "widen":
                dst, a, n = vals
                spans = ((dst, 4), (a, 2))
            else:
                dst, a, b, n, *rest = vals
                spans = ((dst, 2 if self.kind == "acc_final" else 4), (a, 2), (b, 4))
            for p, item in spans:
                touch(p, n * item)
            op = _OPS.index(parts[-2]) if self.kind != "widen" else 0

            def run() -> None:
                if self.kind == "acc":
                    rc = _lib().rc_host_reduce_acc(_DT.index(dt), op, dst, a, b, n, nthreads)
                elif self.kind == "acc_final":
                    use_div, div = rest
                    rc = _lib().rc_host_reduce_acc_final(_DT.index(dt), op, dst, a, b, n, use_div, div, nthreads)
                else:
                    rc = _lib().rc_host_widen(_DT.index(dt), dst, a, n, nthreads)
                assert rc == 0
        elif self.kind == "copy":
            dst, src, nbytes = vals
            touch(dst, nbytes)
            touch(src, nbytes)

            def run() -> None:
                _lib().rc_host_copy(dst, src, nbytes, nthreads)
        else:
            p, g, m, v, out, n, *scalars = vals
            pd, gd, od = parts[2], parts[3], parts[4]
            sizes = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}
            for ptr, dt in ((p, pd), (g, gd), (m, pd), (v, pd)) + (((out, od),) if od != "none" else ()):
                touch(ptr, n * sizes[dt])
            s = np.array(scalars, np.float64)

            def run() -> None:
                rc = _lib().rc_host_adam(
                    _DT.index(pd),
                    _DT.index(gd),
                    -1 if od == "none" else _DT.index(od),
                    p,
                    g,
                    m,
                    v,
                    out,
                    n,
                    s.ctypes.data,
                    nthreads,
                )
                assert rc == 0

        def checked() -> None:
            global _kernels_run
            run()
            _kernels_run += 1
            bad = _lib().rc_host_misaligned()
            if bad:
                raise RuntimeError(f"emulated CUDA: {self.name} made {bad} misaligned vector accesses")

        checked.kernel = True  # (a node a CUDA graph may capture)
        stream._enqueue(checked)

    def _launch_ring(self, blocks: int, vals: list, parts: list[str], touch, stream: Stream) -> None:
        """csrc/ring.cu: every pointer checked (the control blocks over their FIFOs, ``own`` over the
        chunk the table uses it for, the error record in pinned host memory), then queued to run all
        its blocks at once (_Running)."""
        table, nsteps, nchunks, work, src, acc, own, mine, left, right, err, sig, count, timeout = vals[:14]
        place, slots, slot_bytes, use_div, div = vals[14:]
        item = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}.get(parts[3]) or int(parts[3][1:]) // 8
        touch(table, (8 * nsteps + 3 * nchunks) * 8 if nsteps >= 0 else (3 * nchunks + 1) * 8)  # (-1: one-shot)
        touch(work, count * item)
        touch(src, count * item)
        if acc:
            touch(acc, count * 4)
        from ringcomm.executor import fifo_offset  # (csrc/ring.cu's layout)

        ctl = fifo_offset(blocks) + blocks * slots * slot_bytes
        for p in (mine, left, right):
            touch(p, ctl)
        if not any(b.ptr <= err and err + 16 * 8 <= b.ptr + len(b) for b in list(_pinned.values())):
            raise RuntimeError(f"emulated CUDA: {self.name}: the error record {err:#x} is not pinned host memory")
        dt, op = _DT.index(parts[3]), _OPS.index(parts[2])

        def own_chunks() -> None:
            """``own`` over every chunk the table sends from, reduces into or copies from it (read when
            the kernel starts: the table was copied in on the stream before it)."""
            t = np.ctypeslib.as_array(
                ctypes.cast(table, ctypes.POINTER(ctypes.c_longlong)), (8 * nsteps + 3 * nchunks,)
            )
            rows, bounds, copies = (
                t[: 8 * nsteps].reshape(-1, 8),
                t[8 * nsteps : 8 * nsteps + 2 * nchunks],
                t[-nchunks:],
            )
            chunks = {int(r[0]) for r in rows if r[1] == 3} | {int(r[2]) for r in rows if r[7] == 1}
            for c in chunks | {c for c in range(nchunks) if copies[c] == 2}:
                if bounds[2 * c + 1] > bounds[2 * c]:
                    touch(own, int(bounds[2 * c + 1] - bounds[2 * c]) * item)

        def body(block: int) -> None:
            rc = _lib().rc_ring_block(
                dt, op, block, blocks, table, nsteps, nchunks, work, src, acc, own, mine, left, right, err, sig,
                count, timeout, place, slots, slot_bytes, use_div, div,
            )  # fmt: skip
            assert rc == 0

        def done() -> None:
            global _kernels_run
            _kernels_run += 1
            bad = _lib().rc_host_misaligned()
            if bad:
                raise RuntimeError(f"emulated CUDA: {self.name} made {bad} misaligned vector accesses")

        stream._enqueue(_Running(blocks, body, done, own_chunks if nsteps > 0 else None))


class RawModule:
    """CuPy's RawModule: compiled, and loaded into the current device's context, for each device it
    is used on (CuPy's _get_raw_module is memoized per device): by get_function for the calling
    thread's current device (0 in a new thread until it sets one), and again by a launch on another.
    ``loaded``: those devices (what a test of a warm-up looks at)."""

    def __init__(self, code: str | None = None, path: str | None = None, options=(), **kw) -> None:
        if 'extern "C"' not in (code or ""):
            raise RuntimeError('emulated cupy: RawModule without extern "C" kernels')
        self.code = code
        self.loaded: set[int] = set()

    def _load(self) -> None:
        # RINGCOMM_EMULATED_NO_NVRTC=1: a machine with only a driver, where CuPy cannot load NVRTC
        # (the error CuPy 14 raises then)
        if os.environ.get("RINGCOMM_EMULATED_NO_NVRTC", "") == "1":
            raise RuntimeError(
                "CuPy failed to load libnvrtc.so.13: OSError: libnvrtc.so.13: cannot open shared object file: "
                "No such file or directory"
            )
        _make_context_current()  # (CuPy's runtime._ensure_context before cuModuleLoadData)
        self.loaded.add(_current_device())

    def get_function(self, name: str) -> _Kernel:
        self._load()  # CuPy compiles and loads on the first get_function
        return _Kernel(name, self)  # the names come from macros in the source; _Kernel checks their form


# ------------------------------------------------------------------------------------- cuda.runtime
# CuPy's signatures (cupy_backends/cuda/api/runtime.pyx); the errors are the CUDA runtime's


def _deviceCanAccessPeer(device: int, peerDevice: int) -> int:
    """cudaDeviceCanAccessPeer: 1 or 0 (RINGCOMM_EMULATED_PEER_ACCESS); 0 for device == peerDevice;
    cudaErrorInvalidDevice for an invalid ordinal."""
    return int(_can_access(_check_device(device), _check_device(peerDevice)))


def _deviceEnablePeerAccess(peerDevice: int) -> None:
    """cudaDeviceEnablePeerAccess(peerDevice, 0) from the current device: cudaErrorInvalidDevice when
    cudaDeviceCanAccessPeer says it cannot (so also for the current device itself),
    cudaErrorPeerAccessAlreadyEnabled when it is enabled already (CUDA Runtime API, Peer Device
    Memory Access)."""
    peer, cur = _check_device(peerDevice), _current_device()
    if not _can_access(cur, peer):
        raise CUDARuntimeError(101)
    if (cur, peer) in _peer_enabled:
        raise CUDARuntimeError(704)
    _make_context_current()
    _peer_enabled.add((cur, peer))


def _deviceDisablePeerAccess(peerDevice: int) -> None:
    """cudaDeviceDisablePeerAccess: cudaErrorPeerAccessNotEnabled when it was not enabled."""
    peer, cur = _check_device(peerDevice), _current_device()
    if (cur, peer) not in _peer_enabled:
        raise CUDARuntimeError(705)
    _peer_enabled.discard((cur, peer))


def _deviceGetPCIBusId(device: int) -> str:
    """CuPy's runtime.deviceGetPCIBusId(int device) -> str (cudaDeviceGetPCIBusId)."""
    return _pci_bus_id(_check_device(device))


def _deviceGetByPCIBusId(pci_bus_id: str) -> int:
    """CuPy's runtime.deviceGetByPCIBusId(str) -> int: cudaErrorInvalidDevice for an unknown bus id."""
    for dev in range(_device_count()):
        if _pci_bus_id(dev).lower() == str(pci_bus_id).strip().lower():
            return dev
    raise CUDARuntimeError(101)


def _deviceGetAttribute(attrib: int, device: int) -> int:
    device = _check_device(device)
    return {16: _SM_COUNT, 75: 9, 76: 0, 133: int(_MPS)}.get(int(attrib), 0)  # SMs, compute capability 9.0, MPS


def _getDeviceProperties(device: int) -> dict:
    device = _check_device(device)
    return {
        "name": b"Emulated GPU (CPU stand-in)",
        "multiProcessorCount": _SM_COUNT,
        "major": 9,
        "minor": 0,
        "totalGlobalMem": 1 << 34,
        "pciBusID": device,
        "pciDeviceID": 0,
        "pciDomainID": 0,
    }


_opened: dict[bytes, int] = {}


def _ipcGetMemHandle(ptr: int) -> bytes:
    a = _regions.get(int(ptr))
    if a is None or a.imported:
        raise CUDARuntimeError("cudaErrorInvalidValue: not the base of an allocation of this process")
    if not a.ipc:
        raise CUDARuntimeError("cudaErrorInvalidValue: allocation not exportable")
    handle = f"{os.getpid()}:{a.device}:{a.size}:{a.name}".encode()  # the exporter's device too
    if len(handle) > 64:
        raise CUDARuntimeError("emulated handle too long")
    return handle.ljust(64, b"\0")


def _ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
    """cudaIpcOpenMemHandle on the current device (CuPy's default flags: cudaIpcMemLazyEnablePeerAccess).
    Memory of another device maps only if the current device can access it: else
    cudaErrorPeerAccessUnsupported ("peer access is not supported between these two devices", what
    cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess) returns between devices without P2P, as
    reported in NVIDIA/TensorRT-LLM#1498). Without the lazy flag, peer access must have been enabled
    (cudaDeviceEnablePeerAccess): else cudaErrorPeerAccessNotEnabled (the emulation's choice: CUDA's
    documentation names no error for it)."""
    pid, exporter, size, name = handle.rstrip(b"\0").decode().split(":", 3)
    if int(flags) not in (0, cudaIpcMemLazyEnablePeerAccess):
        raise CUDARuntimeError(1)
    if int(pid) == os.getpid():
        raise CUDARuntimeError("cudaErrorDeviceUninitialized: a process cannot open its own IPC handle")
    if handle in _opened:
        raise CUDARuntimeError("cudaErrorAlreadyMapped: handle already opened in this process")
    dev, exporter = _current_device(), int(exporter)
    if exporter != dev:
        if not (0 <= exporter < _device_count() and _can_access(dev, exporter)):
            raise CUDARuntimeError(217)
        if not int(flags) & cudaIpcMemLazyEnablePeerAccess and (dev, exporter) not in _peer_enabled:
            raise CUDARuntimeError(705)
    _make_context_current()
    a = _Allocation(int(size), name=name, imported=True, exporter_device=exporter)
    _opened[handle] = a.ptr
    marker = _open_markers[handle] = f"{name}.open-{os.getpid()}"  # seen by the exporter's cudaFree
    open(marker, "wb").close()
    return a.ptr


def _ipcCloseMemHandle(ptr: int) -> None:
    for h, p in list(_opened.items()):
        if p == ptr:
            del _opened[h]
            _regions.pop(ptr, None)
            try:
                os.unlink(_open_markers.pop(h))
            except (KeyError, OSError):
                pass
            return
    raise CUDARuntimeError("cudaErrorInvalidValue: not an opened IPC mapping")


_open_markers: dict[bytes, str] = {}
cudaIpcMemLazyEnablePeerAccess = 1


def _memcpyAsync(dst: int, src: int, size: int, kind: int, stream_ptr: int) -> None:
    """cudaMemcpyAsync. Unlike a kernel, a copy may use a stream of another device and memory of any
    device ("A memory copy will succeed even if it is issued to a stream that is not associated to
    the current device", CUDA C++ Programming Guide, Stream and Event Behavior; with unified
    addressing CUDA copies between devices without peer access, through the host): not refused."""
    _make_context_current()
    if kind == 2:  # device to host
        _region(src, size)
        assert not _is_device(dst), "memcpyDeviceToHost into device memory"
    elif kind == 1:
        _region(dst, size)
        assert not _is_device(src), "memcpyHostToDevice from device memory"
    else:
        _region(dst, size)
        _region(src, size)
    Stream._by_ptr[int(stream_ptr)]._enqueue(lambda: ctypes.memmove(dst, src, size))


runtime = types.SimpleNamespace(
    streamCaptureModeGlobal=_CAPTURE_GLOBAL,
    streamCaptureModeThreadLocal=_CAPTURE_THREAD_LOCAL,
    streamCaptureModeRelaxed=_CAPTURE_RELAXED,
    getDevice=_current_device,
    setDevice=_set_device,
    getDeviceCount=_device_count,
    deviceCanAccessPeer=_deviceCanAccessPeer,
    deviceEnablePeerAccess=_deviceEnablePeerAccess,
    deviceDisablePeerAccess=_deviceDisablePeerAccess,
    deviceGetPCIBusId=_deviceGetPCIBusId,
    deviceGetByPCIBusId=_deviceGetByPCIBusId,
    cudaDevAttrMultiProcessorCount=16,
    deviceGetAttribute=_deviceGetAttribute,
    memcpyAsync=_memcpyAsync,
    memcpyDeviceToHost=2,
    memcpyHostToDevice=1,
    memcpyDeviceToDevice=3,
    ipcGetMemHandle=_ipcGetMemHandle,
    ipcOpenMemHandle=_ipcOpenMemHandle,
    ipcCloseMemHandle=_ipcCloseMemHandle,
    cudaIpcMemLazyEnablePeerAccess=cudaIpcMemLazyEnablePeerAccess,
    CUDARuntimeError=CUDARuntimeError,
    deviceSynchronize=lambda: _flush_device(_current_device()),
    # versions encoded as CUDA does (1000 * major + 10 * minor); the properties ringcomm.bench prints
    runtimeGetVersion=lambda: 13000,
    driverGetVersion=lambda: 13000,
    getDeviceProperties=_getDeviceProperties,
)


def _occupancyMaxActiveBlocksPerMultiprocessor(func: int, blockSize: int, dynamicSMemSize: int) -> int:
    """cuOccupancyMaxActiveBlocksPerMultiprocessor of a kernel (its CUfunction handle): 2 blocks of
    512 threads per SM, as ptxas reports for sm_90 (at most 64 registers a thread in csrc's copy,
    reduce, accumulate and Adam kernels);
    CUDA_ERROR_INVALID_HANDLE for a handle that is no kernel's."""
    _make_context_current()
    if func not in _functions:
        raise CUDADriverError(400)
    return 2 if blockSize <= 512 else 1


driver = types.SimpleNamespace(
    occupancyMaxActiveBlocksPerMultiprocessor=_occupancyMaxActiveBlocksPerMultiprocessor,
    CUDADriverError=CUDADriverError,
)


cuda = types.SimpleNamespace(
    graph=types.SimpleNamespace(Graph=Graph),
    Stream=Stream,
    ExternalStream=ExternalStream,
    Event=Event,
    Device=Device,
    get_current_stream=get_current_stream,
    Memory=Memory,
    MemoryPointer=MemoryPointer,
    UnownedMemory=UnownedMemory,
    alloc_pinned_memory=alloc_pinned_memory,
    MemoryPool=MemoryPool,
    runtime=runtime,
    driver=driver,
    is_available=lambda: True,
)


def _install_nccl() -> None:
    """``cupy.cuda.nccl`` (tests/emulated/cupy/_nccl.py): importable as CuPy's is, both as
    ``importlib.import_module("cupy.cuda.nccl")`` and ``from cupy.cuda import nccl``."""
    import sys

    from . import _nccl

    cuda.nccl = _nccl
    sys.modules.setdefault(__name__ + ".cuda", cuda)
    sys.modules[__name__ + ".cuda.nccl"] = _nccl


_install_nccl()
