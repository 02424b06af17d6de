"""What the benchmark reports about where it runs: versions, devices, nodes, shared GPUs.

Everything that needs other ranks goes through ringcomm's own collectives (which have deadlines).
CuPy is imported lazily and only when asked for, so all of this works without it.
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import Any

import numpy as np
from mpi4py import MPI

from ..records import exchange


def gather_strings(comm: Any, text: str) -> list[str]:
    """Every rank's ``text`` (UTF-8, cut to :data:`ringcomm.records.TEXT_BYTES` bytes), in rank order.

    Collective over ``comm`` (a ringcomm Communicator): :func:`ringcomm.records.exchange`, through
    its all_gather, so it has its deadline.
    """
    return [msg for _, msg in exchange(comm, (), text)]


def all_true(comm: Any, flag: bool) -> bool:
    """Whether ``flag`` is true on every rank (collective, through ringcomm's all_reduce)."""
    return bool(comm.all_reduce(np.array([1 if flag else 0], np.int64), "min")[0])


def cupy_module() -> tuple[Any, str]:
    """(cupy, "") when CuPy imports and sees a GPU, else (None, the reason)."""
    try:
        cupy = importlib.import_module("cupy")
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        return None, f"CuPy not available ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return None, f"CuPy sees no GPU ({type(e).__name__}: {e})"
    if n < 1:
        return None, "CuPy sees no GPU"
    return cupy, ""


def gpu_dtype_ok(cupy: Any, dtype: np.dtype) -> bool:
    """Whether CuPy can hold arrays of ``dtype`` (bfloat16 needs a CuPy that knows it)."""
    try:
        cupy.empty(16, np.uint8).view(np.dtype(dtype))
    except Exception:
        return False
    return True


def nccl_module() -> tuple[Any, str]:
    """(cupy.cuda.nccl, "") when CuPy's NCCL bindings load, else (None, the reason)."""
    cupy, why = cupy_module()
    if cupy is None:
        return None, why
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
        if not getattr(nccl, "available", True):
            return None, "CuPy was built without NCCL"
        nccl.get_version()
    except Exception as e:
        return None, f"NCCL not available through CuPy ({type(e).__name__}: {e})"
    return nccl, ""


def nccl_version(nccl: Any) -> str:
    """NCCL's runtime version as "2.23.4" (codes >= 2.9 are major*10000 + minor*100 + patch)."""
    code = int(nccl.get_version())
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def mpi_library() -> str:
    """The first line of ``MPI_Get_library_version``, squeezed."""
    text = MPI.Get_library_version().strip().splitlines()
    return " ".join(text[0].split()) if text else "unknown"


def versions(cupy: Any = None, nccl: Any = None) -> dict[str, str]:
    """Library versions for the header and the JSON file."""
    import mpi4py

    import ringcomm

    out = {
        "ringcomm": ringcomm.__version__,
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "MPI": mpi_library(),
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
    }
    try:
        import ml_dtypes

        out["ml_dtypes"] = ml_dtypes.__version__
    except ImportError:
        pass
    if cupy is not None:
        out["CuPy"] = cupy.__version__
        try:
            v = cupy.cuda.runtime.runtimeGetVersion()
            out["CUDA runtime"] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:
            pass
    if nccl is not None:
        out["NCCL"] = nccl_version(nccl)
    return out


def describe_rank(comm: Any, device: str, cupy: Any = None) -> str:
    """nccl-tests' "Using devices" line for this rank."""
    host = socket.gethostname()
    if device == "host":
        return f"Rank {comm.rank:3d} Pid {os.getpid():7d} on {host:>12} device host (numpy)"
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return f"Rank {comm.rank:3d} Pid {os.getpid():7d} on {host:>12} device {dev.id:2d} [{dev.pci_bus_id}] {name}"


def node_layout(comm: Any) -> tuple[int, int]:
    """(number of nodes, largest number of ranks on one node), from MPI's shared-memory split."""
    leaders = comm.all_reduce(np.array([1 if comm.node_comm.rank == 0 else 0], np.int64), "sum")
    most = comm.all_reduce(np.array([comm.node_comm.size], np.int64), "max")
    return int(leaders[0]), int(most[0])


def select_gpu(comm: Any, cupy: Any) -> int:
    """Make GPU (node-local rank mod GPU count) current, as nccl-tests does; return its id."""
    dev = comm.node_comm.rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    return dev


def ranks_per_gpu(comm: Any, cupy: Any) -> int:
    """The most ranks that use one GPU (same host and PCI bus id); 1 when every rank has its own.
    Collective over ``comm``."""
    me = f"{socket.gethostname()}/{cupy.cuda.Device().pci_bus_id}"
    ids = gather_strings(comm, me)
    return max(ids.count(i) for i in ids)


def shared_gpu(comm: Any, cupy: Any) -> bool:
    """Whether some GPU is used by more than one rank (same host and PCI bus id)."""
    return ranks_per_gpu(comm, cupy) > 1


def mps_status() -> str | None:
    """Where this host's MPS control daemon listens ("control pipe in /tmp/nvidia-mps"), or None when
    none runs (CUDA clients then time-slice a shared GPU). Cheap: looks for the daemon's pipe in
    CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps); it does not start one."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if os.path.exists(os.path.join(pipe, "control")):
        return f"control pipe in {pipe}"
    return None
