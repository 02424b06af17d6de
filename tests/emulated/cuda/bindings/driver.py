"""A CPU stand-in for the part of ``cuda.bindings.driver`` (NVIDIA's cuda-bindings) that ringcomm
calls, answered from the emulated device memory of tests/emulated/cupy. For tests only.

Same call shapes as cuda-bindings: every function returns a tuple whose first item is a
:class:`CUresult`, then the output parameters (``err, base, size = cuMemGetAddressRange(ptr)``).
As on a GPU, a call from a thread with no current CUDA context (no allocation, cudaSetDevice or
``with cupy.cuda.Device(...)`` on that thread yet) returns CUDA_ERROR_INVALID_CONTEXT.
``RINGCOMM_EMULATED_DRIVER_FAIL=<function name>[,...]``: those functions return
CUDA_ERROR_INVALID_VALUE, to test how callers handle a failing driver.
With several emulated devices (RINGCOMM_EMULATED_DEVICES), pointer queries answer for memory of any
device from any current context (unified addressing), and CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL is the
device the memory belongs to.

Stream memory operations (cuda-bindings 13.x: ``cuStreamWaitValue32(stream, addr, value, unsigned int
flags)``, and cuStreamWaitValue64, cuStreamWriteValue32/64, each returning ``(CUresult,)``): queued on
the emulated stream with that handle (0, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: the null stream),
they act on shared memory, so a neighbour's write through an IPC mapping releases a wait (see the
stream notes in tests/emulated/cupy/__init__.py). As cuda-bindings, ``stream`` and ``addr`` may be
CUstream / CUdeviceptr or plain ints (None is 0), ``value`` and ``flags`` must fit their unsigned C
types (else OverflowError). Refused like the driver (its documented returns are CUDA_SUCCESS,
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED):

- an address that is not memory this process can use from the stream's device (an allocation of it
  or an IPC mapping opened in it, of that device or of one it enabled peer access to, or pinned host
  memory), or not aligned to the operation's size (4 or 8 bytes): CUDA_ERROR_INVALID_VALUE (for
  memory of a device without peer access CUDA documents no error: this is the emulation's choice);
- a wait condition other than GEQ, EQ, AND, NOR, or flags other than CUstreamWriteValue_flags:
  CUDA_ERROR_INVALID_VALUE; CU_STREAM_WAIT_VALUE_FLUSH: CUDA_ERROR_NOT_SUPPORTED (the emulated
  device reads 0 for CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, as x86 systems do);
  CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER: CUDA_ERROR_NOT_SUPPORTED ("not supported in the v2 API",
  and since CUDA 12 cuStreamWriteValue32 is cuStreamWriteValue32_v2);
- a handle that is no stream of this process: CUDA_ERROR_INVALID_HANDLE;
- RINGCOMM_EMULATED_NO_STREAM_MEM_OPS=1 (a platform without them): all four return
  CUDA_ERROR_NOT_SUPPORTED and the capability attributes read 0.

Capability attributes (cuDeviceGetAttribute): the V2 API (the only one cuda.h declares since CUDA 12)
is available by default on all platforms and has no attribute of its own for 32-bit operations;
CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS (122) and
CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR (123) read 1. The *_V1 attributes (92, 93, 94:
the legacy API, enabled only by the nvidia module parameter NVreg_EnableStreamMemOPs=1) read 0.
cuda-bindings 12.x/13.x has no *_V2 names (CUDA 11.7/11.8 spelled 122 and 123 so).
"""

from __future__ import annotations

import enum
import operator
import os

import cupy


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUdevice_attribute(enum.IntEnum):  # noqa: N801 - cuda.h's spelling; the members the emulation answers
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
    CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92
    CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1 = 93
    CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1 = 94
    CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES = 98
    CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122
    CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR = 123
    CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED = 125


class CUstreamWaitValue_flags(enum.IntEnum):  # noqa: N801
    CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (int32_t)(*addr - value) >= 0, cyclic (int64_t for 64 bits)
    CU_STREAM_WAIT_VALUE_EQ = 0x1  # *addr == value
    CU_STREAM_WAIT_VALUE_AND = 0x2  # (*addr & value) != 0
    CU_STREAM_WAIT_VALUE_NOR = 0x3  # ~(*addr | value) != 0
    CU_STREAM_WAIT_VALUE_FLUSH = 1 << 30  # then flush remote writes (CAN_FLUSH_REMOTE_WRITES)


class CUstreamWriteValue_flags(enum.IntEnum):  # noqa: N801
    CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
    CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER = 0x1  # "not supported in the v2 API"


class CUpointer_attribute(enum.IntEnum):  # noqa: N801 - cuda.h's spelling
    CU_POINTER_ATTRIBUTE_CONTEXT = 1
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
    CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
    CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12


def _unsigned(value, bits: int, ctype: str) -> int:
    """Cython's conversion of a Python int to an unsigned C type: TypeError for a non-integer,
    OverflowError out of range (what cuda-bindings raises for such arguments)."""
    if isinstance(value, float):
        raise TypeError(f"an integer is required for {ctype}")
    v = operator.index(value)
    if v < 0:
        raise OverflowError(f"can't convert negative value to {ctype}")
    if v >> bits:
        raise OverflowError(f"value too large to convert to {ctype}")
    return v


class _Handle:
    """cuda-bindings' handle classes: ``T(init_value=0)`` of an integer, ``int()``/``__index__``
    give the value, equal to handles of the same class with the same value."""

    _bits = 64

    def __init__(self, init_value=0) -> None:
        self._value = _unsigned(init_value, self._bits, type(self).__name__)

    def __int__(self) -> int:
        return self._value

    __index__ = __int__

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def getPtr(self) -> int:  # noqa: N802 - cuda-bindings' spelling
        return self._value

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value:#x}>"


class CUdeviceptr(_Handle):
    """A device address (cuda-bindings' CUdeviceptr: ``int()`` gives the address)."""


class CUstream(_Handle):
    """A stream handle (cuda-bindings' CUstream: ``int()`` gives the handle, CuPy's ``Stream.ptr``)."""


class CUdevice(_Handle):
    """A device ordinal (cuda-bindings' CUdevice: a C int; CU_DEVICE_CPU is -1, CU_DEVICE_INVALID -2)."""

    def __init__(self, init_value=0) -> None:
        v = operator.index(init_value)
        if not -(1 << 31) <= v < (1 << 31):
            raise OverflowError("value too large to convert to int")
        self._value = v

    def __repr__(self) -> str:
        return f"<CUdevice {self._value}>"


#: stream handles the driver takes for the legacy and the per-thread default stream
CU_STREAM_LEGACY = 0x1
CU_STREAM_PER_THREAD = 0x2


def _arg(value, cls) -> int:
    """cuda-bindings' handling of a handle argument: None is 0, an instance of ``cls`` its value,
    anything else ``int(cls(value))``."""
    if value is None:
        return 0
    if isinstance(value, cls):
        return int(value)
    return int(cls(value))


def _failing(name: str) -> CUresult | None:
    if name in os.environ.get("RINGCOMM_EMULATED_DRIVER_FAIL", "").split(","):
        return CUresult.CUDA_ERROR_INVALID_VALUE
    return None


def _refused(name: str) -> CUresult | None:
    err = _failing(name)
    if err is not None:
        return err
    if not cupy._has_context():
        return CUresult.CUDA_ERROR_INVALID_CONTEXT
    return None


def cuMemGetAddressRange(dptr):  # noqa: N802
    err = _refused("cuMemGetAddressRange")
    if err is not None:
        return err, CUdeviceptr(0), 0
    try:
        a = cupy._region(int(dptr))
    except RuntimeError:
        return CUresult.CUDA_ERROR_NOT_FOUND, CUdeviceptr(0), 0
    return CUresult.CUDA_SUCCESS, CUdeviceptr(a.ptr), a.size


def cuPointerGetAttribute(attribute, ptr):  # noqa: N802
    err = _refused("cuPointerGetAttribute")
    if err is not None:
        return err, None
    try:
        a = cupy._region(int(ptr))
    except RuntimeError:
        return CUresult.CUDA_ERROR_INVALID_VALUE, None
    attr = CUpointer_attribute(int(attribute))
    if attr == CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID:
        return CUresult.CUDA_SUCCESS, a.buffer_id
    if attr == CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        return CUresult.CUDA_SUCCESS, bool(a.ipc and not a.imported)
    if attr == CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        # the device the memory belongs to: where it was allocated; for an IPC mapping, the device
        # it was opened on (its context's), which is also what NCCL's pointer check compares
        return CUresult.CUDA_SUCCESS, a.device
    return CUresult.CUDA_ERROR_INVALID_VALUE, None


def cuGetErrorName(error):  # noqa: N802
    try:
        return CUresult.CUDA_SUCCESS, CUresult(int(error)).name.encode()
    except ValueError:
        return CUresult.CUDA_ERROR_INVALID_VALUE, None


# --------------------------------------------------------------------------------- initialisation
def cuInit(Flags):  # noqa: N802, N803
    if _unsigned(Flags, 32, "unsigned int"):
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    cupy._driver_initialized = True
    return (CUresult.CUDA_SUCCESS,)


def cuDriverGetVersion():  # noqa: N802
    """(CUDA_SUCCESS, the driver's version as 1000 * major + 10 * minor): 13000, as the runtime says."""
    return CUresult.CUDA_SUCCESS, int(cupy.cuda.runtime.driverGetVersion())


def _no_mem_ops() -> bool:
    return os.environ.get("RINGCOMM_EMULATED_NO_STREAM_MEM_OPS", "") == "1"


def cuDeviceGetAttribute(attrib, dev):  # noqa: N802
    """(CUresult, value): needs an initialised driver (not a current context), as cuDeviceGetAttribute."""
    if attrib is None:
        raise TypeError("Argument 'attrib' must not be None")
    pdev = _arg(dev, CUdevice)
    err = _failing("cuDeviceGetAttribute")
    if err is not None:
        return err, None
    if not cupy._driver_initialized:
        return CUresult.CUDA_ERROR_NOT_INITIALIZED, None
    if not 0 <= pdev < cupy._device_count():
        return CUresult.CUDA_ERROR_INVALID_DEVICE, None
    try:
        a = CUdevice_attribute(int(attrib))
    except ValueError:
        return CUresult.CUDA_ERROR_INVALID_VALUE, None
    A = CUdevice_attribute  # noqa: N806
    mem_ops = 0 if _no_mem_ops() else 1
    values = {
        A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: 1024,
        A.CU_DEVICE_ATTRIBUTE_WARP_SIZE: 32,
        A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: cupy._SM_COUNT,
        A.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: pdev,
        A.CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: 0,
        A.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: 1,
        A.CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: 0,
        A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
        A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: 1,
        # the legacy (V1) memory operations: off unless the nvidia module is loaded with
        # NVreg_EnableStreamMemOPs=1; the V2 ones (cuStreamWaitValue32 since CUDA 12) are always there
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1: 0,
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1: 0,
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1: 0,
        A.CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES: 0,
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: mem_ops,
        A.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR: mem_ops,
        A.CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED: 1,
    }
    return CUresult.CUDA_SUCCESS, values[a]


# ------------------------------------------------------------------------ stream memory operations
_WAIT_CONDITIONS = (0x0, 0x1, 0x2, 0x3)  # GEQ, EQ, AND, NOR


def _stream_mem_op(name: str, stream, addr, value, flags, bits: int, wait: bool):
    pflags = _unsigned(flags, 32, "unsigned int")  # cuda-bindings: ``unsigned int flags``
    pvalue = 0 if value is None else _unsigned(value, bits, f"cuuint{bits}_t")
    paddr = _arg(addr, CUdeviceptr)
    pstream = _arg(stream, CUstream)
    err = _refused(name)
    if err is not None:
        return (err,)
    if _no_mem_ops():
        return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)
    s = cupy.Stream.null if pstream in (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) else cupy.Stream._by_ptr.get(pstream)
    if s is None:
        return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    if wait:
        cond = pflags & ~CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_FLUSH
        if cond not in _WAIT_CONDITIONS:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if pflags & CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_FLUSH:
            return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)  # CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES is 0
    elif pflags == CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER:
        return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)  # "This flag is not supported in the v2 API"
    elif pflags != CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    nbytes = bits // 8
    if paddr % nbytes:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    device = cupy._current_device() if s.device_id == -1 else s.device_id
    memory = cupy._memop_memory(paddr, nbytes, device)
    if memory is None:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    item = cupy._ValueWait(paddr, pvalue, cond, bits, memory) if wait else cupy._ValueWrite(paddr, pvalue, bits, memory)
    s._enqueue(item)
    return (CUresult.CUDA_SUCCESS,)


def cuStreamWaitValue32(stream, addr, value, flags):  # noqa: N802
    """Queue a wait on ``stream`` until the 32-bit value at ``addr`` satisfies ``flags``
    (CUstreamWaitValue_flags): ``(CUresult,)``."""
    return _stream_mem_op("cuStreamWaitValue32", stream, addr, value, flags, 32, True)


def cuStreamWaitValue64(stream, addr, value, flags):  # noqa: N802
    return _stream_mem_op("cuStreamWaitValue64", stream, addr, value, flags, 64, True)


def cuStreamWriteValue32(stream, addr, value, flags):  # noqa: N802
    """Queue a 32-bit store of ``value`` at ``addr`` on ``stream`` (flags: CUstreamWriteValue_flags):
    ``(CUresult,)``."""
    return _stream_mem_op("cuStreamWriteValue32", stream, addr, value, flags, 32, False)


def cuStreamWriteValue64(stream, addr, value, flags):  # noqa: N802
    return _stream_mem_op("cuStreamWriteValue64", stream, addr, value, flags, 64, False)
