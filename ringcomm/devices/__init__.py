"""Devices reduce and copy bytes: ``host`` (numpy) and ``cuda`` (ringcomm's kernels from csrc/).

Both implement the same small protocol, used by the engine:
``reduce(dst, a, b, op, div=1)``, ``copy(dst, src)``, ``empty(count, dtype)``, ``synchronize()``.
"""

from __future__ import annotations

from typing import Any

from .host import HostDevice


def get(kind: str, stream: Any = None):
    """A device for arrays of ``kind`` ("host" or "cuda"; ``stream`` applies to cuda only).

    The Communicator keeps one HostDevice for host arrays; a CudaDevice is made per call for its stream.
    """
    if kind == "host":
        return HostDevice()
    if kind == "cuda":
        from .cuda import CudaDevice

        return CudaDevice(stream)
    raise ValueError(f"unknown device kind {kind!r}; accepted: host, cuda")


__all__ = ["HostDevice", "get"]
