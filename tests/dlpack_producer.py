"""A small DLPack producer for tests (no torch needed): exports memory as a DLManagedTensor capsule.

:class:`Producer` describes any memory (a numpy buffer, or emulated device memory) with any DLPack
dtype code, shape, strides (in elements), byte offset, device and read-only flag, in the legacy
("dltensor") or the versioned ("dltensor_versioned", DLPack 1.0) layout, as the consumer asks.
It implements the Python side of the spec as PyTorch does: ``__dlpack__(*, stream, max_version,
dl_device, copy)`` and ``__dlpack_device__()``. It counts the deleter calls (``deleted``) so a test
sees that a consumer takes ownership (renames the capsule to "used_dltensor[_versioned]") and
calls the deleter exactly once, when its array goes, and that an unconsumed capsule is freed once
(``exported`` == ``deleted`` once everything is gone and :meth:`Producer.drop_capsules` was called).

The structures are spelled here from dlpack.h, independently of ringcomm.arrays; the producer is
checked against numpy.from_dlpack (and torch.from_dlpack where torch is installed).
"""

from __future__ import annotations

import atexit
import ctypes
import weakref
from typing import Any

import numpy as np

KDL_CPU, KDL_CUDA = 1, 2
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 0, 1, 2, 4
READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# private prototypes (ctypes.pythonapi.<name> is one object shared with other modules)
_api = ctypes.pythonapi
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api)
)
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*)(PyObject *capsule)
_NAMES = (b"dltensor", b"dltensor_versioned")  # module constants: capsules keep the char*
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))

#: address of every DLManagedTensor(Versioned) exported -> (struct, shape/strides arrays, producer).
#: Kept for the process's life (tests export few), so that a second deleter call is seen, not a crash.
_exported: dict[int, tuple] = {}
_producers: weakref.WeakSet = weakref.WeakSet()


# (globals bound as defaults: these may run while the interpreter tears the module down)
@DELETER
def _deleter(managed: int, _exported: dict = _exported) -> None:
    producer = _exported[managed][2]
    producer.deleted += 1  # a test asserts exactly one call per export


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule: int, _names=_NAMES, _is_valid=_is_valid, _get_pointer=_get_pointer) -> None:
    """The producer's capsule destructor (as the spec has it): free the tensor unless consumed."""
    for name in _names:
        if _is_valid(capsule, name):
            _deleter(_get_pointer(capsule, name))
            return


_DESTRUCTOR_ADDRESS = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


class Producer:
    """A DLPack view of ``base``'s memory (or of ``ptr`` when given), without a copy.

    ``code``/``bits``: the DLPack dtype (default: from ``base.dtype``); ``shape`` and ``strides``
    (elements; None: C-contiguous, exported as NULL) default to ``base``'s; ``byte_offset`` is
    exported as such (the data pointer stays ``base``'s start); ``versioned``: None follows the
    consumer's ``max_version``, False/True force the layout.
    """

    def __init__(
        self,
        base: Any,
        *,
        code: int | None = None,
        bits: int | None = None,
        shape: tuple | None = None,
        strides: tuple | None = None,
        byte_offset: int = 0,
        device: tuple[int, int] = (KDL_CPU, 0),
        readonly: bool = False,
        versioned: bool | None = None,
        ptr: int | None = None,
        on_export: Any = None,
    ) -> None:
        self.base = base
        dtype = np.dtype(base.dtype)
        self.code = code if code is not None else {"i": KDL_INT, "u": KDL_UINT, "f": KDL_FLOAT}[dtype.kind]
        self.bits = bits if bits is not None else dtype.itemsize * 8
        self.shape = tuple(shape if shape is not None else base.shape)
        self.strides = strides
        self.byte_offset, self.device, self.readonly, self.versioned = byte_offset, device, readonly, versioned
        self.ptr = ptr if ptr is not None else base.__array_interface__["data"][0]
        self.on_export = on_export  # called with the stream= argument (fake producers' stream exchange)
        self.exported = self.deleted = 0
        self.calls: list[dict] = []
        self.capsules: list[Any] = []
        _producers.add(self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(
        self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None
    ) -> Any:
        self.calls.append({"stream": stream, "max_version": max_version, "dl_device": dl_device, "copy": copy})
        if self.on_export is not None:
            self.on_export(stream)
        versioned = self.versioned if self.versioned is not None else (max_version is not None and max_version[0] >= 1)
        ndim = len(self.shape)
        dims = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        steps = (ctypes.c_int64 * max(ndim, 1))(*(self.strides or ()))
        m = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        t = m.dl_tensor
        t.data = self.ptr
        t.device = DLDevice(*self.device)
        t.ndim = ndim
        t.dtype = DLDataType(self.code, self.bits, 1)
        t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(steps, ctypes.POINTER(ctypes.c_int64)) if self.strides is not None else None
        t.byte_offset = self.byte_offset
        m.deleter = _deleter
        if versioned:
            m.version = DLPackVersion(1, 0)
            m.flags = READ_ONLY if self.readonly else 0
        elif self.readonly:
            raise BufferError("a read-only tensor cannot be exported as a legacy (DLPack < 1.0) capsule")
        address = ctypes.addressof(m)
        _exported[address] = (m, (dims, steps), self)
        self.exported += 1
        capsule = _capsule_new(address, _NAMES[versioned], _DESTRUCTOR_ADDRESS)
        self.capsules.append(capsule)
        return capsule

    def drop_capsules(self) -> None:
        """Let go of the exported capsules: each unconsumed one is then freed by its destructor.

        The producer holds them until then because its destructor is Python code (a ctypes
        callback), which cannot run while an exception is pending, and numpy.from_dlpack drops a
        capsule it refuses just after setting its exception (a C producer's destructor, PyTorch's,
        does not mind); holding the capsule keeps the consumer's own error intact.
        """
        self.capsules.clear()


@atexit.register
def _drop_all() -> None:
    for p in list(_producers):
        p.drop_capsules()
