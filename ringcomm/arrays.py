"""Recognising user arrays: numpy on the host; CuPy, ``__cuda_array_interface__`` or DLPack on GPUs.

Every accepted array is viewed without a copy: a PyTorch CUDA tensor becomes a CuPy array over the
same memory, a CPU DLPack tensor a numpy array over the same memory (bfloat16 included, as an
``ml_dtypes.bfloat16`` array, which ``numpy.from_dlpack`` cannot make).

Streams (GPU arrays): a collective runs on ``stream=`` when given; for a PyTorch CUDA tensor,
otherwise on PyTorch's current stream of the tensor's device (:func:`default_stream`); otherwise
on CuPy's current stream. A DLPack import is made on that same stream, so the producer orders its
pending work before it (the DLPack stream exchange) and no other stream waits. PyTorch CUDA
tensors are imported by DLPack for that reason: their ``__cuda_array_interface__`` (version 2)
names no stream to order by.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np
from mpi4py.MPI import buffer

from .ops import SUPPORTED_DTYPES, bfloat16

_address = buffer.frombuffer

#: DLPack devices imported as GPU arrays (on the collective's stream: the producer orders its work
#: before it): kDLCUDA, and kDLCUDAManaged, as CuPy's from_dlpack takes it
_DLPACK_GPU_DEVICES = (2, 13)
#: DLPack devices whose memory the host can read: kDLCPU, kDLCUDAHost, kDLROCMHost, kDLCUDAManaged
#: (the ones numpy.from_dlpack accepts)
_DLPACK_HOST_DEVICES = (1, 3, 11, 13)
_DL_BFLOAT = 4  # DLDataTypeCode kDLBfloat
_DLPACK_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY
_MAX_DIMS = 64  # numpy's NPY_MAXDIMS


def classify(x: Any, name: str, stream: Any = None) -> tuple[str, Any]:
    """Return ("host", numpy array) or ("cuda", CuPy array) viewing the same memory as ``x``.

    ``stream``: the CuPy stream the collective will run on (None: CuPy's current one); a GPU
    DLPack tensor is imported on it, so that the producer makes that stream wait for its work.
    """
    if isinstance(x, np.ndarray):
        return "host", x
    cp = sys.modules.get("cupy")
    if cp is not None and type(x) is cp.ndarray:  # (what cupy.asarray(x) returns: x itself)
        return "cuda", x
    if _is_torch_cuda(x):
        return "cuda", _cuda_from_dlpack(x, name, stream)
    if _has_cuda_array_interface(x):
        return "cuda", _cupy(name).asarray(x)
    if hasattr(x, "__dlpack_device__"):
        device_type = x.__dlpack_device__()[0]
        if device_type in _DLPACK_GPU_DEVICES:
            return "cuda", _cuda_from_dlpack(x, name, stream)
        if device_type in _DLPACK_HOST_DEVICES:  # (PyTorch's pinned CPU tensors: kDLCUDAHost)
            return "host", host_from_dlpack(x, name)
    raise TypeError(
        f"{name}: expected a numpy array, a CuPy array, or an object with __cuda_array_interface__ or "
        f"DLPack (e.g. a PyTorch tensor); got {type(x).__module__}.{type(x).__qualname__}"
    )


def default_stream(x: Any, stream: Any = None, name: str = "x") -> Any:
    """The CuPy stream a collective on ``x`` runs on, or None for CuPy's current stream.

    ``stream`` when given (a ``torch.cuda.Stream`` as a CuPy stream over it: :func:`_external`);
    else, for a PyTorch CUDA tensor, PyTorch's current stream on the tensor's device, so that the
    collective is ordered after the kernels PyTorch queued before the call and before those it
    queues after. PyTorch is looked for only where it is already imported (sys.modules).
    RuntimeError (before any communication) for a PyTorch stream of another GPU than the current one.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return stream
    if stream is None:
        if not _is_torch_cuda(x):
            return None
        stream = torch.cuda.current_stream(x.device)
    if isinstance(stream, torch.cuda.Stream):
        current = _cupy(name).cuda.runtime.getDevice()
        if stream.device_index != current:
            raise RuntimeError(
                f"{name}: the collective's stream is PyTorch's on GPU {stream.device_index}, but the current device "
                f"is GPU {current}: make GPU {stream.device_index} current (torch.cuda.set_device) or pass a "
                "stream of the current one"
            )
        return _external(stream, name)
    return stream


def _external(stream: Any, name: str) -> Any:
    """The CuPy stream over the ``torch.cuda.Stream`` ``stream`` of the current device
    (``cupy.cuda.Stream.from_external``, CuPy 14's way: ExternalStream is deprecated), one per
    handle and device, kept (at most EXTERNAL_STREAMS); it keeps the first such torch stream alive."""
    key = (stream.cuda_stream, stream.device_index)
    found = _external_streams.get(key)
    if found is None:
        if len(_external_streams) >= EXTERNAL_STREAMS:
            _external_streams.clear()
        found = _external_streams[key] = _cupy(name).cuda.Stream.from_external(_TorchStream(stream))
    return found


class _TorchStream:
    """A ``torch.cuda.Stream`` as the CUDA stream protocol names it (older PyTorch versions lack
    ``__cuda_stream__``), holding it."""

    __slots__ = ("stream",)

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.stream.cuda_stream)


#: the most torch streams' CuPy streams kept (_external; past it they are dropped and made again)
EXTERNAL_STREAMS = 64
_external_streams: dict[tuple[int, int], Any] = {}


def _is_torch_cuda(x: Any) -> bool:
    """Whether ``x`` is a PyTorch CUDA tensor (without importing PyTorch: only if it is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.is_cuda


def torch_dtypes(torch: Any) -> dict[Any, np.dtype]:
    """PyTorch's dtypes that ringcomm has, each with its numpy dtype (bfloat16: ml_dtypes.bfloat16;
    uint16, uint32 and uint64 where this PyTorch has them, from 2.3 on)."""
    pairs = ((getattr(torch, d.name, None), d) for d in SUPPORTED_DTYPES)
    return {t: d for t, d in pairs if isinstance(t, torch.dtype)}


#: torch_dtypes of the PyTorch imported, made at the first tensor lane_buffer sees
_torch_numpy: dict[Any, np.dtype] = {}


def lane_buffer(x: Any) -> tuple[int, int, np.dtype, int] | None:
    """``(address, count, dtype, device)`` of a GPU array that a collective's kernel lane may take as it is:
    a C-contiguous CuPy array, or a contiguous PyTorch CUDA tensor (exactly ``torch.Tensor``) of a
    dtype ringcomm has that DLPack exports as it is (strided, not nested, without requires_grad:
    what torch's ``__dlpack__`` refuses).
    Any shape: the collectives act on the flat buffer. Else None (the full path classifies ``x``,
    with its messages)."""
    cp = sys.modules.get("cupy")
    if cp is not None and type(x) is cp.ndarray:
        return (x.data.ptr, x.size, x.dtype, x.data.device_id) if x.flags.c_contiguous else None
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or not x.is_cuda:
        return None
    if not _torch_numpy:
        _torch_numpy.update(torch_dtypes(torch))
    dtype = _torch_numpy.get(x.dtype)
    if dtype is None or x.requires_grad or x.layout is not torch.strided or x.is_nested or not x.is_contiguous():
        return None
    return x.data_ptr(), x.numel(), dtype, x.get_device()


def lane_stream(x: Any, stream: Any, device_id: int) -> Any:
    """The stream a kernel lane's call on ``x`` (an array lane_buffer takes) runs on, the one the
    full path picks (default_stream), where picking it imports nothing: for a CuPy array, ``stream``
    None (CuPy's current stream), a ``cupy.cuda.Stream`` or ``ExternalStream``, or a
    ``torch.cuda.Stream`` (``ExternalStream`` too) of GPU ``device_id``; for a PyTorch tensor (on GPU
    ``device_id``), PyTorch's current stream there, taken when ``stream`` is None or a PyTorch stream
    of that handle and device (torch's ``__dlpack__`` then orders nothing: it makes the consumer's
    stream wait only for a different stream, and for an ExternalStream over the current stream's
    handle, which it counts as different, waits on that same stream, a no-op). Else None: the full
    path imports ``x`` on its stream (or raises: a stream of another device)."""
    cp, torch = sys.modules["cupy"], sys.modules.get("torch")
    if type(x) is cp.ndarray:
        if stream is None:
            return cp.cuda.get_current_stream()
        if type(stream) is cp.cuda.Stream or type(stream) is cp.cuda.ExternalStream:
            return stream if stream.device_id in (-1, device_id) else None
        ours = torch is not None and isinstance(stream, torch.cuda.Stream) and stream.device_index == device_id
        return _external(stream, "stream") if ours else None
    current = torch.cuda.current_stream(device_id)
    if stream is not None and (
        not isinstance(stream, torch.cuda.Stream)
        or stream.cuda_stream != current.cuda_stream
        or stream.device_index != device_id
    ):
        return None
    return _external(current, "x")


class on_stream:  # noqa: N801 - used as a function
    """CuPy stream ``stream`` current inside the block, the caller's current stream again after it.

    Not ``with stream:``: leaving that block makes the stream of CuPy's enclosing ``with`` current,
    which is not the caller's when the caller made one current by ``Stream.use()``."""

    __slots__ = ("stream", "before")

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        self.before = sys.modules["cupy"].cuda.get_current_stream()
        self.stream.use()

    def __exit__(self, *exc: object) -> None:
        self.before.use()


def _cuda_from_dlpack(x: Any, name: str, stream: Any) -> Any:
    """``cupy.from_dlpack(x)`` with ``stream`` as CuPy's current stream: CuPy passes it to
    ``x.__dlpack__(stream=...)``, and the producer makes it wait for the producer's pending work."""
    cp = _cupy(name)
    if stream is None:
        return cp.from_dlpack(x)
    with on_stream(stream):
        return cp.from_dlpack(x)


def _has_cuda_array_interface(x: Any) -> bool:
    """Whether ``x`` describes itself by __cuda_array_interface__. A property that raises (PyTorch's
    does for a tensor that requires grad) counts as no: DLPack is tried next."""
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:  # noqa: BLE001 - any error from the property means "not through this interface"
        return False


# ------------------------------------------------------------------------------ DLPack on the host
class _DLTensor(ctypes.Structure):
    """dlpack.h's DLTensor, its DLDevice and DLDataType members spelled out in place."""

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


class _VersionedHead(ctypes.Structure):
    """The head of DLManagedTensorVersioned (DLPack >= 1.0); its DLTensor follows."""

    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
    ]


#: DLManagedTensor (DLPack < 1.0) is a DLTensor, then manager_ctx, then deleter
_LEGACY_DELETER_AT = ctypes.sizeof(_DLTensor) + ctypes.sizeof(ctypes.c_void_p)

# The capsule keeps the char* it is renamed to: these names must live as long as the module.
_NAME, _USED = b"dltensor", b"used_dltensor"
_NAME_V, _USED_V = b"dltensor_versioned", b"used_dltensor_versioned"
# Private prototypes: ctypes.pythonapi.<name> is one object shared by every module, whose
# argtypes another module may set otherwise.
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_capsule_rename = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", ctypes.pythonapi)
)
#: ``void deleter(DLManagedTensor*)``, called with the GIL held (as numpy and CuPy call it); one
#: callable per deleter address (producers have one or two)
_DELETER = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)
_deleters: dict[int, Any] = {}


class _Owner:
    """Owns one consumed DLManagedTensor(Versioned): its memory is described to numpy by
    ``__array_interface__``, and its deleter runs once, when the last array over it goes."""

    def __init__(self, managed: int, deleter: Any, interface: dict) -> None:
        self._managed, self._deleter = managed, deleter
        self.__array_interface__ = interface

    def __del__(self) -> None:
        if self._deleter is not None:
            self._deleter(self._managed)


def host_from_dlpack(x: Any, name: str = "x") -> np.ndarray:
    """``numpy.from_dlpack(x)``, and bfloat16 (kDLBfloat, 16 bits) too, as ``ml_dtypes.bfloat16``.

    No copy: the result views the producer's memory and keeps it alive. numpy reads every dtype
    it knows; a tensor it refuses is exported again and read here, by numpy's rules: DLPack 1.0
    asked for first (its read-only flag gives a read-only array), the legacy capsule otherwise;
    strides in elements (NULL: C-contiguous); the data at ``data + byte_offset``; the capsule
    renamed "used_dltensor[_versioned]" and the deleter called when the array goes. PyTorch's
    bfloat16 tensors go there at once. Other dtypes numpy cannot view: TypeError.
    """
    refused = None
    if not _is_torch_bfloat16(x):
        try:
            return np.from_dlpack(x)
        except (RuntimeError, BufferError) as e:  # numpy's "Unsupported dtype in DLTensor." and the like
            refused = e
    try:
        capsule = x.__dlpack__(dl_device=None, copy=None, max_version=(1, 0))
    except TypeError:  # a producer older than DLPack 1.0 (numpy.from_dlpack retries alike)
        capsule = x.__dlpack__()
    kind = _capsule_name(capsule) if type(capsule).__name__ == "PyCapsule" else None
    if kind == _NAME_V:
        ptr = _capsule_pointer(capsule, _NAME_V)
        head = _VersionedHead.from_address(ptr)
        if head.major > 1:
            raise BufferError(f"{name}: the DLPack tensor has version {head.major}.{head.minor}; ringcomm reads 1.x")
        t = _DLTensor.from_address(ptr + ctypes.sizeof(_VersionedHead))
        deleter, readonly, used = head.deleter, bool(head.flags & _DLPACK_READ_ONLY), _USED_V
    elif kind == _NAME:
        ptr = _capsule_pointer(capsule, _NAME)
        t = _DLTensor.from_address(ptr)
        deleter, readonly, used = ctypes.c_void_p.from_address(ptr + _LEGACY_DELETER_AT).value, False, _USED
    else:
        raise TypeError(f"{name}: __dlpack__() returned {capsule!r}, not an unused DLPack capsule")
    if (t.code, t.bits, t.lanes) != (_DL_BFLOAT, 16, 1):
        accepted = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        why = f"numpy.from_dlpack: {refused}; " if refused is not None else ""
        raise TypeError(
            f"{name}: numpy cannot view this DLPack tensor ({why}DLPack dtype code {t.code}, {t.bits} bits, "
            f"{t.lanes} lanes); accepted dtypes: {accepted}"
        ) from refused
    if t.device_type not in _DLPACK_HOST_DEVICES:
        raise TypeError(f"{name}: the DLPack tensor is on device type {t.device_type}, not in host memory")
    ndim = t.ndim
    if not 0 <= ndim <= _MAX_DIMS:
        raise TypeError(f"{name}: the DLPack tensor has {ndim} dimensions; at most {_MAX_DIMS} are accepted")
    shape = tuple(t.shape[:ndim])
    strides = tuple(s * 2 for s in t.strides[:ndim]) if t.strides else None
    data = (t.data or 0) + t.byte_offset
    call = None
    if deleter:
        call = _deleters.get(deleter)
        if call is None:
            call = _deleters[deleter] = _DELETER(deleter)
    if _capsule_rename(capsule, used) != 0:  # from here on, the owner calls the deleter
        raise BufferError(f"{name}: could not mark the DLPack capsule as used")
    owner = _Owner(
        ptr, call, {"version": 3, "shape": shape, "typestr": "<u2", "data": (data, readonly), "strides": strides}
    )
    return np.asarray(owner).view(bfloat16)  # the bits viewed in place; the array's base holds the owner


def _is_torch_bfloat16(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.dtype is torch.bfloat16


# ------------------------------------------------------------------------------------ array checks
def flat(a: Any, name: str) -> Any:
    """The 1-D view of a C-contiguous array; TypeError (saying how to fix it) when it is not contiguous."""
    if not a.flags.c_contiguous:
        raise TypeError(
            f"{name}: the array of shape {a.shape} with strides {a.strides} is not C-contiguous; "
            "collectives act on the flat buffer: pass a contiguous array (e.g. numpy.ascontiguousarray(x))"
        )
    return a if a.ndim == 1 else a.reshape(-1)


def writable(a: Any, name: str) -> None:
    """TypeError when ``a`` (numpy) is read-only; device arrays are always writable."""
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise TypeError(f"{name}: the array is read-only but this collective writes into it")


def span(a: Any) -> tuple[int, int]:
    """The [first, last) byte addresses of the (contiguous) array ``a``.

    A numpy array's address is read through MPI's buffer view (mpi4py takes the buffer protocol
    in C: 0.1 us, where ``__array_interface__`` builds a dict in 0.8)."""
    ptr = _address(a, readonly=True).address if isinstance(a, np.ndarray) else a.data.ptr
    return ptr, ptr + a.nbytes


def relation(a: Any, b: Any) -> str:
    """How the memory of two contiguous arrays relates: "apart", "same" (start and length) or "overlap"."""
    if a.nbytes == 0 or b.nbytes == 0:
        return "apart"
    at, bt = span(a), span(b)
    if at[1] <= bt[0] or bt[1] <= at[0]:
        return "apart"
    return "same" if at == bt else "overlap"


def _cupy(name: str) -> Any:
    try:
        import cupy
    except ImportError as e:
        raise TypeError(f"{name}: a GPU array needs CuPy; install ringcomm with the 'cuda' extra") from e
    return cupy
