"""What the benchmark reports about where it runs: versions, devices, nodes, shared GPUs.

Everything that needs other ranks goes through ringcomm's own collectives (which have deadlines).
CuPy is imported lazily and only when asked for, so all of this works without it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
import socket
import sys
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
            # (CuPy imports the module without its API when libnccl.so.2 cannot be loaded)
            return None, (
                "CuPy could not load libnccl.so.2: pip install nvidia-nccl-cu13 (nvidia-nccl-cu12 for CUDA 12), "
                "or name one with --nccl-lib or RINGCOMM_NCCL_LIB"
            )
        nccl.get_version()
    except Exception as e:
        return None, f"NCCL not available through CuPy ({type(e).__name__}: {e})"
    return nccl, ""


def nccl_version(nccl: Any) -> str:
    """NCCL's runtime version as "2.23.4" (codes >= 2.9 are major*10000 + minor*100 + patch)."""
    return version_string(int(nccl.get_version()))


def version_string(code: int) -> str:
    """An NCCL version code (ncclGetVersion's) as "2.23.4"."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


# ------------------------------------------------------------------------- the NCCL the user names
#: the environment variable that names the NCCL library the bench loads (--nccl-lib wins over it)
NCCL_LIB_ENV = "RINGCOMM_NCCL_LIB"
#: the modules through which CuPy binds to NCCL: once one is imported, CuPy's NCCL is fixed for the process
CUPY_NCCL_MODULES = ("cupy.cuda.nccl", "cupy_backends.cuda.libs.nccl")


class NcclLibraryError(Exception):
    """The NCCL library the user named cannot be used: missing, not loadable, not NCCL, or not the
    NCCL that ``cupy.cuda.nccl`` reports."""


@dataclasses.dataclass(frozen=True)
class NcclLibrary:
    """An NCCL library named by ``--nccl-lib`` or RINGCOMM_NCCL_LIB, loaded into this process.

    ``path`` is absolute, ``named_by`` says where it was named, ``code`` is what its own
    ``ncclGetVersion`` returned, and ``late`` is true when CuPy's NCCL bindings were already imported
    when it was loaded (they bind to the ``libnccl.so.2`` loaded first, so they then keep theirs)."""

    path: str
    named_by: str
    code: int
    late: bool = False

    @property
    def version(self) -> str:
        return version_string(self.code)

    def mismatch(self, nccl: Any) -> str:
        """Why ``nccl`` (``cupy.cuda.nccl``) is not using this library: "" when it reports the same
        version as the library's own ``ncclGetVersion``."""
        try:
            theirs = int(nccl.get_version())
        except Exception as e:  # noqa: BLE001 - CuPy's NcclError and friends
            return f"cupy.cuda.nccl.get_version() failed ({type(e).__name__}: {e})"
        if theirs == self.code:
            return ""
        why = (
            "they were imported before it was loaded"
            if self.late
            else "they bind to the first library loaded whose SONAME is libnccl.so.2: see this one's with readelf -d"
        )
        return (
            f"{self.named_by} {self.path} is NCCL {self.version} (its ncclGetVersion), but cupy.cuda.nccl reports "
            f"NCCL {version_string(theirs)}: CuPy's NCCL bindings use another library ({why}); no NCCL row runs "
            "on an NCCL other than the one named"
        )


def nccl_library_named(option: str | None) -> tuple[str, str] | None:
    """(path, where it was named) of the NCCL library to load: ``--nccl-lib``'s value when given
    (it wins), else RINGCOMM_NCCL_LIB when set and not blank; None for CuPy's own NCCL. ValueError
    for an empty ``--nccl-lib``."""
    if option is not None:
        if not option.strip():
            raise ValueError("--nccl-lib needs the path of an NCCL library (libnccl.so.2)")
        return option, "--nccl-lib"
    value = os.environ.get(NCCL_LIB_ENV, "").strip()
    return (value, NCCL_LIB_ENV) if value else None


def load_nccl_library(path: str, named_by: str) -> NcclLibrary:
    """Load the NCCL library at ``path`` with RTLD_GLOBAL and read its version (``ncclGetVersion``).

    Call it before ``cupy.cuda.nccl`` is first imported: CuPy's bindings then bind to it, as to the
    first ``libnccl.so.2`` loaded. Local to this process (no MPI, no CUDA: ``ncclGetVersion``
    initialises nothing). :class:`NcclLibraryError`, naming the path, when the file is missing,
    cannot be loaded, exports no ``ncclGetVersion``, or that call fails."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise NcclLibraryError(f"{named_by} {path}: no such file")
    if not os.path.isfile(full):
        raise NcclLibraryError(f"{named_by} {path}: not a file")
    late = any(name in sys.modules for name in CUPY_NCCL_MODULES)
    try:
        lib = ctypes.CDLL(full, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise NcclLibraryError(f"{named_by} {full}: cannot be loaded ({e})") from None
    try:
        get_version = lib.ncclGetVersion
    except AttributeError:
        raise NcclLibraryError(f"{named_by} {full}: not an NCCL library (it exports no ncclGetVersion)") from None
    get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
    get_version.restype = ctypes.c_int
    code = ctypes.c_int(0)
    status = get_version(ctypes.byref(code))
    if status != 0 or code.value <= 0:
        raise NcclLibraryError(
            f"{named_by} {full}: ncclGetVersion failed (ncclResult_t {status}, version {code.value})"
        )
    return NcclLibrary(full, named_by, code.value, late)


def mapped_nccl_paths() -> list[str]:
    """The NCCL libraries mapped into this process (files named libnccl*.so*, from /proc/self/maps,
    in address order); empty where there is no /proc."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths: list[str] = []
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) == 6:
            path = fields[5].strip()
            name = os.path.basename(path)
            if name.startswith("libnccl") and ".so" in name and path not in paths:
                paths.append(path)
    return paths


def nccl_library_line(named: NcclLibrary | None, nccl: Any, unused: str = "") -> str | None:
    """The header's line on which NCCL library the NCCL rows use (None when no NCCL is involved):
    the one named and its version, checked against ``nccl`` (cupy.cuda.nccl, or None when NCCL does
    not run: ``unused`` says why), or CuPy's own with the path it was mapped from."""
    if named is not None:
        text = f"{named.path} ({named.named_by}), ncclGetVersion {named.version}"
        if nccl is None:
            return f"{text}; not used ({unused or 'NCCL does not run'})"
        others = [p for p in mapped_nccl_paths() if os.path.realpath(p) != os.path.realpath(named.path)]
        also = f"; also mapped: {', '.join(others)}" if others else ""
        return f"{text}; cupy.cuda.nccl uses it (reports {nccl_version(nccl)}){also}"
    if nccl is None:
        return None
    where = mapped_nccl_paths()
    own = f"CuPy's own ({', '.join(where)})" if where else "CuPy's own"
    return f"{own}, {nccl_version(nccl)} (--nccl-lib PATH or {NCCL_LIB_ENV}=PATH loads another)"


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
