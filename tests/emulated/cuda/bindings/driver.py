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
"""

from __future__ import annotations

import enum
import operator
import os

import cupy


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_FOUND = 500


class CUpointer_attribute(enum.IntEnum):  # noqa: N801 - cuda.h's spelling
    CU_POINTER_ATTRIBUTE_CONTEXT = 1
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
    CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
    CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12


class CUstreamCaptureMode(enum.IntEnum):
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
    CU_STREAM_CAPTURE_MODE_RELAXED = 2


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


def cuThreadExchangeStreamCaptureMode(mode):  # noqa: N802
    """The calling thread's stream capture interaction mode set to ``mode``; the previous one
    returned (a thread setting, no context needed)."""
    err = _failing("cuThreadExchangeStreamCaptureMode")
    if err is not None:
        return err, CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    return CUresult.CUDA_SUCCESS, CUstreamCaptureMode(cupy._exchange_capture_mode(CUstreamCaptureMode(int(mode))))
