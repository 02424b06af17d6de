"""Recognising user arrays: numpy on the host; CuPy, ``__cuda_array_interface__`` or DLPack on GPUs.

Every accepted array is viewed without a copy: a PyTorch CUDA tensor becomes a CuPy array over the
same memory, a CPU DLPack tensor a numpy array over the same memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_DLPACK_CPU, _DLPACK_CUDA = 1, 2


def classify(x: Any, name: str) -> tuple[str, Any]:
    """Return ("host", numpy array) or ("cuda", CuPy array) viewing the same memory as ``x``."""
    if isinstance(x, np.ndarray):
        return "host", x
    if _has_cuda_array_interface(x):
        return "cuda", _cupy(name).asarray(x)
    if hasattr(x, "__dlpack_device__"):
        device_type = x.__dlpack_device__()[0]
        if device_type == _DLPACK_CPU:
            return "host", np.from_dlpack(x)
        if device_type == _DLPACK_CUDA:
            return "cuda", _cupy(name).from_dlpack(x)
    raise TypeError(
        f"{name}: expected a numpy array, a CuPy array, or an object with __cuda_array_interface__ or "
        f"DLPack (e.g. a PyTorch tensor); got {type(x).__module__}.{type(x).__qualname__}"
    )


def _has_cuda_array_interface(x: Any) -> bool:
    """Whether ``x`` describes itself by __cuda_array_interface__. A property that raises (PyTorch
    does for dtypes the interface cannot name, e.g. bfloat16) counts as no: DLPack is tried next."""
    try:
        return hasattr(x, "__cuda_array_interface__")
    except Exception:  # noqa: BLE001 - any error from the property means "not through this interface"
        return False


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
    """The [first, last) byte addresses of the (contiguous) array ``a``."""
    ptr = a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr
    return ptr, ptr + a.nbytes


def relation(a: Any, b: Any) -> str:
    """How the memory of two contiguous arrays relates: "apart", "same" (start and length) or "overlap"."""
    if a.nbytes == 0 or b.nbytes == 0:
        return "apart"
    share = np.may_share_memory if isinstance(a, np.ndarray) else _cupy("array").may_share_memory
    if not share(a, b):  # a bounds test, exact for contiguous arrays, and cheaper than span()
        return "apart"
    return "same" if span(a) == span(b) else "overlap"


def _cupy(name: str) -> Any:
    try:
        import cupy
    except ImportError as e:
        raise TypeError(f"{name}: a GPU array needs CuPy; install ringcomm with the 'cuda' extra") from e
    return cupy
