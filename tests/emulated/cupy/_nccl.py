"""``cupy.cuda.nccl`` for the CuPy stand-in: NCCL's collectives emulated with MPI, for tests only.

It mirrors the Python signatures of CuPy 14's ``cupy_backends/cuda/libs/nccl.pyx`` (and its enums in
``nccl.pxd``), so that code written against it (ringcomm.bench's NCCL baseline) runs here as it
would against the real one:

- ``get_unique_id()`` returns ``bytes`` (128 of them). CuPy before 14 returned a tuple of 128
  ``char`` values (signed on x86); CuPy 14 returns bytes ("Changed in version 14.0").
- ``NcclCommunicator(int ndev, bytes commId, int rank, config=None)``: a commId that is not
  ``bytes`` is a TypeError, as Cython raises for a typed ``bytes`` argument ("Argument 'commId' has
  incorrect type (expected bytes, got tuple)"); one whose length is not NCCL_UNIQUE_ID_BYTES (128)
  a ValueError (the wording is ours). Creation is collective over the ``ndev`` ranks that pass the
  same id, as ncclCommInitRank is; the id names a rendezvous in /dev/shm, then the ranks make an MPI
  communicator of their own (``MPI_Comm_create_group``: only they take part).
- The GPU check of ncclCommInitRank: several ranks on one GPU (here: on one host with the same
  current device, whose PCI bus id they share) are refused with ncclInvalidUsage ("Duplicate GPU detected" in
  NCCL's WARN log) before NCCL 2.30, and from 2.30 unless NCCL_MULTI_RANK_GPU_ENABLE=1.
- ``get_version()`` / ``get_build_version()``: NCCL's version code (major*10000 + minor*100 + patch),
  2.30.7 unless RINGCOMM_EMULATED_NCCL_VERSION says otherwise ("2.27.7" or "22707").
- ``NcclCommunicator`` methods: allReduce, reduce, broadcast, bcast, reduceScatter, allGather, send,
  recv, destroy, abort, device_id, rank_id, size, check_async_error, and the ``comm`` property;
  ``groupStart``/``groupEnd`` defer the calls made between them to ``groupEnd``. Errors are
  :class:`NcclError` with CuPy's message form ("NCCL_ERROR_INVALID_ARGUMENT: invalid argument (...)").

How a collective runs: it is queued on the given stream (the emulated streams are lazy: the work runs
when something waits for the stream, as a kernel on a GPU completes some time before a wait returns),
and when it runs, it gathers every rank's input bytes with MPI and reduces them locally in rank order
with numpy, on numpy views of the emulated device memory (whose "device pointers" are host addresses
of shared memory). Every pointer is checked to lie in emulated device memory. All ranks compute the
same result, bit for bit. RINGCOMM_EMULATED_NCCL_CORRUPT=<n> (tests only) makes every collective
write a wrong value into the first n elements it writes, so that a caller's result check is tested.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import sys
import time
import zlib

import numpy as np

from . import Stream, _current_device, _region

available = True

NCCL_UNIQUE_ID_BYTES = 128

# cupy_backends/cuda/libs/nccl.pxd
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9

#: the NCCL version from which NCCL_MULTI_RANK_GPU_ENABLE lets several ranks share one GPU
MULTI_RANK_GPU_MIN = (2, 30)
_DEFAULT_VERSION = "2.30.7"
_RENDEZVOUS_TIMEOUT = 60.0


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_DTYPES = {
    NCCL_INT8: np.int8,
    NCCL_UINT8: np.uint8,
    NCCL_INT32: np.int32,
    NCCL_UINT32: np.uint32,
    NCCL_INT64: np.int64,
    NCCL_UINT64: np.uint64,
    NCCL_FLOAT16: np.float16,
    NCCL_FLOAT32: np.float32,
    NCCL_FLOAT64: np.float64,
    NCCL_BFLOAT16: None,
}
_UFUNCS = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum, NCCL_AVG: np.add}

# ncclResult_t, CuPy's names for them (ERROR2) and ncclGetErrorString's text
ncclSuccess, ncclUnhandledCudaError, ncclSystemError, ncclInternalError = 0, 1, 2, 3
ncclInvalidArgument, ncclInvalidUsage, ncclRemoteError = 4, 5, 6
_NAMES = {
    0: "NCCL_ERROR_SUCCESS",
    1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
    2: "NCCL_ERROR_SYSTEM_ERROR",
    3: "NCCL_ERROR_INTERNAL_ERROR",
    4: "NCCL_ERROR_INVALID_ARGUMENT",
    5: "NCCL_ERROR_INVALID_USAGE",
    6: "NCCL_ERROR_REMOTE_ERROR",
}
_STRINGS = {
    0: "no error",
    1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
    3: "internal error - please report this issue to the NCCL developers",
    4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
    5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
    6: "remote process exited or there was a network error",
}


class NcclError(RuntimeError):
    """CuPy's NcclError: ``status`` is the ncclResult_t; str() is "NAME: ncclGetErrorString"."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"{_NAMES.get(status, 'NCCL_ERROR_UNKNOWN')}: {_STRINGS.get(status, 'unknown result code')}")

    def __reduce__(self):
        return (type(self), (self.status,))


def _warn(text: str) -> None:
    """NCCL's WARN log line (printed when NCCL_DEBUG is WARN, INFO or TRACE)."""
    if os.environ.get("NCCL_DEBUG", "").upper() in ("WARN", "INFO", "TRACE"):
        sys.stderr.write(f"{socket.gethostname()}:{os.getpid()}:{os.getpid()} [0] emulated NCCL WARN {text}\n")
        sys.stderr.flush()


def _fail(status: int, why: str) -> None:
    _warn(why)
    raise NcclError(status)


# ------------------------------------------------------------------------------------ versions, id
def _version_tuple() -> tuple[int, int, int]:
    text = os.environ.get("RINGCOMM_EMULATED_NCCL_VERSION", "").strip() or _DEFAULT_VERSION
    if "." in text:
        major, minor, patch = (int(x) for x in (text.split(".") + ["0", "0"])[:3])
        return major, minor, patch
    code = int(text)
    return code // 10000, code // 100 % 100, code % 100


def get_build_version() -> int:
    """NCCL_VERSION_CODE CuPy was built with (the emulation: the same as the runtime's)."""
    return get_version()


def get_version() -> int:
    """The runtime version of NCCL as ncclGetVersion encodes it (major*10000 + minor*100 + patch)."""
    major, minor, patch = _version_tuple()
    return major * 10000 + minor * 100 + patch


def get_unique_id() -> bytes:
    """A fresh ncclUniqueId as 128 bytes (CuPy 14). Here it names a rendezvous: a magic, a random
    token and this host, zero-padded."""
    token = secrets.token_hex(12)
    raw = f"RCEMU-NCCL:{token}:{socket.gethostname()}".encode()[:NCCL_UNIQUE_ID_BYTES]
    return raw.ljust(NCCL_UNIQUE_ID_BYTES, b"\0")


# ------------------------------------------------------------------------------------ group calls
_group_depth = 0
_group_ops: list = []


def groupStart() -> None:
    global _group_depth
    _group_depth += 1


def groupEnd() -> None:
    """Queue the calls deferred since the matching groupStart, in the order they were made."""
    global _group_depth
    if _group_depth == 0:
        _fail(ncclInvalidUsage, "ncclGroupEnd: not in a group call")
    _group_depth -= 1
    if _group_depth == 0:
        ops, _group_ops[:] = list(_group_ops), []
        for stream, fn in ops:
            stream._enqueue(fn)


# -------------------------------------------------------------------------------- the communicator
_live: list = []


@atexit.register
def _cleanup() -> None:
    """Communicators left at exit are aborted (their queued work dropped: the peers may be gone)."""
    for comm in list(_live):
        try:
            comm.abort()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _rendezvous_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class NcclCommunicator:
    """ncclCommInitRank for one rank (see the module docstring)."""

    def __init__(self, ndev: int, commId: bytes, rank: int, config=None) -> None:
        self._mpi = None
        self._streams: set = set()
        if not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"commId must be {NCCL_UNIQUE_ID_BYTES} bytes long (the ncclUniqueId), got {len(commId)}")
        ndev, rank = int(ndev), int(rank)
        self._device = _current_device()  # ncclCommInitRank binds the communicator to the current device
        if ndev < 1 or not 0 <= rank < ndev:
            _fail(ncclInvalidArgument, f"ncclCommInitRank: rank {rank} is not in [0, {ndev})")
        text = commId.rstrip(b"\0")
        if not text.startswith(b"RCEMU-NCCL:"):
            _fail(ncclInvalidArgument, "ncclCommInitRank: this ncclUniqueId was not made by ncclGetUniqueId")
        token = text.split(b":")[1].decode()
        peers = self._exchange(token, ndev, rank)
        me = peers[rank]
        for r, p in enumerate(peers):
            if r != rank and p["host"] == me["host"] and p["bus_id"] == me["bus_id"]:
                self._check_shared_gpu(rank, r, me["bus_id"])
                break
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        group = world.Get_group().Incl([p["world_rank"] for p in peers])
        self._mpi = world.Create_group(group, zlib.crc32(token.encode()) & 0x7FFF)
        group.Free()
        self._mpi.Barrier()  # every rank has read the rendezvous files: remove this rank's
        try:
            os.unlink(self._file(token, rank))
        except OSError:
            pass
        self._rank, self._size = rank, ndev
        _live.append(self)

    @staticmethod
    def _file(token: str, rank: int) -> str:
        return os.path.join(_rendezvous_dir(), f"ringcomm-emu-nccl-{token}.{rank}")

    def _exchange(self, token: str, ndev: int, rank: int) -> list[dict]:
        """NCCL's bootstrap all-gather of peer information, through files named by the id."""
        from mpi4py import MPI

        import cupy

        info = {
            "world_rank": MPI.COMM_WORLD.Get_rank(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "bus_id": cupy.cuda.Device().pci_bus_id,
        }
        path = self._file(token, rank)
        if os.path.exists(path):
            _fail(ncclInvalidUsage, f"ncclCommInitRank: rank {rank} joined this communicator twice")
        with open(path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)
        peers: list[dict | None] = [None] * ndev
        deadline = time.monotonic() + _RENDEZVOUS_TIMEOUT
        while True:
            for r in range(ndev):
                if peers[r] is None:
                    try:
                        with open(self._file(token, r)) as f:
                            peers[r] = json.load(f)
                    except (OSError, ValueError):
                        pass
            if all(p is not None for p in peers):
                return peers  # type: ignore[return-value]
            if time.monotonic() > deadline:
                os.unlink(path)
                missing = [r for r, p in enumerate(peers) if p is None]
                _fail(ncclSystemError, f"bootstrap: ranks {missing} never joined within {_RENDEZVOUS_TIMEOUT:g} s")
            time.sleep(0.002)

    def _check_shared_gpu(self, rank: int, other: int, bus_id: str) -> None:
        """NCCL's refusal of several ranks on one GPU: always before 2.30, without
        NCCL_MULTI_RANK_GPU_ENABLE=1 from 2.30 on."""
        version = _version_tuple()
        if version[:2] < MULTI_RANK_GPU_MIN:
            _fail(
                ncclInvalidUsage, f"Duplicate GPU detected : rank {rank} and rank {other} both on CUDA device {bus_id}"
            )
        if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "0").strip() != "1":
            _fail(
                ncclInvalidUsage,
                f"Multiple ranks use the same GPU ({bus_id}): rank {rank} and rank {other}; set "
                "NCCL_MULTI_RANK_GPU_ENABLE=1 to allow it",
            )

    # -------------------------------------------------------------------------------- management
    @property
    def comm(self) -> int:
        return id(self._mpi) if self._mpi is not None else 0

    def destroy(self) -> None:
        """ncclCommDestroy: the work queued so far completes first."""
        if self._mpi is None:
            return
        for stream in list(self._streams):
            stream._flush()
        self._free()

    def abort(self) -> None:
        """ncclCommAbort: queued work of this communicator is dropped (it raises if it runs)."""
        if self._mpi is not None:
            self._free()

    def _free(self) -> None:
        from mpi4py import MPI

        mpi, self._mpi = self._mpi, None
        if self in _live:
            _live.remove(self)
        if not MPI.Is_finalized():
            mpi.Free()

    def __del__(self) -> None:
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _alive(self):
        if self._mpi is None:
            _fail(ncclInvalidArgument, "the communicator was destroyed")
        return self._mpi

    def device_id(self) -> int:
        """ncclCommCuDevice: the device that was current at ncclCommInitRank."""
        self._alive()
        return self._device

    def rank_id(self) -> int:
        self._alive()
        return self._rank

    def size(self) -> int:
        self._alive()
        return self._size

    def check_async_error(self) -> None:
        self._alive()

    # ------------------------------------------------------------------------------- collectives
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        dt, ufunc = self._dtype(datatype), self._op(op, datatype)
        src, dst = self._view(sendbuf, count, dt), self._view(recvbuf, count, dt)

        def run() -> None:
            dst[...] = _corrupted(self._reduce(self._gather(src), ufunc, op, dt))

        self._queue(stream, run)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        dt, ufunc = self._dtype(datatype), self._op(op, datatype)
        self._root(root)
        src = self._view(sendbuf, count, dt)
        dst = self._view(recvbuf, count, dt) if self._rank == root else None

        def run() -> None:
            out = self._reduce(self._gather(src), ufunc, op, dt)
            if dst is not None:
                dst[...] = _corrupted(out)

        self._queue(stream, run)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        dt = self._dtype(datatype)
        self._root(root)
        src = self._view(sendbuff, count, dt) if self._rank == root else None
        dst = self._view(recvbuff, count, dt)

        def run() -> None:
            data = np.array(src) if src is not None else np.empty(count, dt)
            self._mpi.Bcast(data.view(np.uint8), root)
            dst[...] = _corrupted(data)

        self._queue(stream, run)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int) -> None:
        dt, ufunc = self._dtype(datatype), self._op(op, datatype)
        n = self._size
        src, dst = self._view(sendbuf, recvcount * n, dt), self._view(recvbuf, recvcount, dt)
        lo = self._rank * recvcount

        def run() -> None:
            out = self._reduce(self._gather(src), ufunc, op, dt)
            dst[...] = _corrupted(out[lo : lo + recvcount])

        self._queue(stream, run)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        dt = self._dtype(datatype)
        src, dst = self._view(sendbuf, count, dt), self._view(recvbuf, count * self._size, dt)

        def run() -> None:
            dst[...] = _corrupted(self._gather(src).reshape(-1))

        self._queue(stream, run)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        dt = self._dtype(datatype)
        self._root(peer)
        src = self._view(sendbuf, count, dt)
        self._queue(stream, lambda: self._mpi.Send(np.ascontiguousarray(src).view(np.uint8), peer, 77))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        dt = self._dtype(datatype)
        self._root(peer)
        dst = self._view(recvbuf, count, dt)
        self._queue(stream, lambda: self._mpi.Recv(dst.view(np.uint8), peer, 77))

    # ----------------------------------------------------------------------------------- helpers
    def _dtype(self, datatype: int) -> np.dtype:
        self._alive()
        if datatype not in _DTYPES:
            _fail(ncclInvalidArgument, f"invalid type {datatype}")
        if datatype == NCCL_BFLOAT16:
            if _version_tuple()[:2] < (2, 10):
                _fail(ncclInvalidArgument, "bfloat16 needs NCCL 2.10")
            return _bfloat16()
        return np.dtype(_DTYPES[datatype])

    def _op(self, op: int, datatype: int):
        if op not in _UFUNCS:
            _fail(ncclInvalidArgument, f"invalid reduction operation {op}")
        if op == NCCL_AVG and _version_tuple()[:2] < (2, 10):
            _fail(ncclInvalidArgument, "ncclAvg needs NCCL 2.10")
        return _UFUNCS[op]

    def _root(self, root: int) -> None:
        if not 0 <= int(root) < self._size:
            _fail(ncclInvalidArgument, f"invalid root/peer {root} (nranks {self._size})")

    def _view(self, ptr: int, count: int, dt: np.dtype) -> np.ndarray:
        """A numpy view of ``count`` elements of emulated device memory at ``ptr``, which must be
        memory of the communicator's device (NCCL's CudaPtrCheck, src/misc/argcheck.cc)."""
        import ctypes

        nbytes = int(count) * dt.itemsize
        if nbytes == 0:
            return np.empty(0, dt)
        try:
            a = _region(int(ptr), nbytes)
        except RuntimeError as e:
            _fail(ncclInvalidArgument, f"{e} (NCCL needs device memory)")
        if a.device != self._device:
            _fail(
                ncclInvalidArgument,
                f"buffer {int(ptr):#x} allocated on device {a.device} mismatchs with NCCL device {self._device}",
            )
        raw = (ctypes.c_uint8 * nbytes).from_address(int(ptr))
        return np.frombuffer(raw, np.uint8).view(dt)

    def _queue(self, stream: int, fn) -> None:
        """Queue ``fn`` on the stream whose handle is ``stream`` (or defer it to groupEnd)."""
        target = Stream._by_ptr.get(int(stream))
        if target is None:
            _fail(ncclInvalidArgument, f"stream {stream:#x} is not a stream of this process")
        self._streams.add(target)

        def op() -> None:
            if self._mpi is None:
                _fail(ncclInvalidUsage, "the communicator was aborted or destroyed with this call still queued")
            fn()

        if _group_depth:
            _group_ops.append((target, op))
        else:
            target._enqueue(op)

    def _gather(self, src: np.ndarray) -> np.ndarray:
        """Every rank's ``src``, in rank order: an (nranks, count) array."""
        out = np.empty((self._size, src.size), src.dtype)
        if src.nbytes:
            self._mpi.Allgather(np.ascontiguousarray(src).view(np.uint8), out.view(np.uint8))
        return out

    def _reduce(self, rows: np.ndarray, ufunc, op: int, dt: np.dtype) -> np.ndarray:
        """Reduce the gathered rows in rank order (AVG: the sum divided by nranks, as ncclAvg)."""
        acc = rows[0].copy()
        for row in rows[1:]:
            ufunc(acc, row, out=acc)
        if op == NCCL_AVG:
            if np.issubdtype(dt, np.integer):
                acc //= self._size
            else:
                acc = (acc.astype(np.float64) / self._size).astype(dt)
        return acc


def _corrupted(out: np.ndarray) -> np.ndarray:
    """``out``, or with RINGCOMM_EMULATED_NCCL_CORRUPT=<n> a copy whose first n elements are wrong."""
    k = min(int(os.environ.get("RINGCOMM_EMULATED_NCCL_CORRUPT", "0") or 0), out.size)
    if k <= 0:
        return out
    out = out.copy()
    head = out[:k]
    if np.issubdtype(out.dtype, np.integer):
        head[...] = ~head  # always a different value
    else:
        head[...] = np.nan  # equal to nothing
    return out
