"""The implementations a row compares: ringcomm itself and the baselines (MPI, NCCL).

Each implementation turns a :class:`~ringcomm.bench.data.Case` and the shared buffers into a
:class:`Prepared` call (or says why it cannot run that case: the row shows N/A). All of them use
the same buffers, filled with the same data, so their results are checked the same way.

In-place follows nccl-tests: all_reduce, broadcast, reduce work in one buffer; reduce_scatter
reduces the full buffer and leaves the rank's shard in it (ringcomm and NCCL at the rank's offset,
MPI_IN_PLACE at the start, as the MPI standard says); all_gather gathers into the full buffer whose
own shard already holds the rank's input.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from ..devices import HostDevice
from ..engine import Context
from ..ops import ReduceOp, bfloat16
from ..transports.base import wait
from .data import COMBINE, Case


class Buffers:
    """Named raw buffers reused by every row of a sweep (grown to the largest size, never shrunk),
    so that rows do not pay for fresh memory. ``xp`` is numpy or cupy.

    Like ``Communicator._scratch_array``, but these are the *user's* arrays of the benchmark (the
    inputs and outputs every implementation is handed, the host data and MPI mirrors): they must
    not be the communicator's scratch, which its collectives use internally (a reduce_scatter
    works in it, so a user buffer there would alias the collective's own work space)."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self._raw: dict[str, Any] = {}

    def get(self, name: str, count: int, dtype: np.dtype) -> Any:
        """A ``count``-element array of ``dtype`` over buffer ``name`` (contents undefined)."""
        dtype = np.dtype(dtype)
        need = count * dtype.itemsize
        raw = self._raw.get(name)
        if raw is None or raw.size < need:
            self._raw.pop(name, None)
            raw = self._raw[name] = self.xp.empty(max(need, 1), np.uint8)
        return raw[:need].view(dtype)

    def release(self) -> None:
        """Drop every buffer."""
        self._raw.clear()


@dataclasses.dataclass
class Arrays:
    """The two arrays of a row: ``send`` (the out-of-place input) and ``recv`` (the out-of-place
    output). The in-place buffer is the full-size one of the two: :meth:`full`."""

    send: Any
    recv: Any

    @classmethod
    def of(cls, case: Case, bufs: Buffers) -> Arrays:
        lo, hi = case.shard
        n_in = hi - lo if case.collective == "all_gather" else case.count
        n_out = hi - lo if case.collective == "reduce_scatter" else case.count
        return cls(bufs.get("send", n_in, case.dtype), bufs.get("recv", n_out, case.dtype))

    def full(self, case: Case) -> Any:
        """The in-place buffer (``count`` elements)."""
        return self.send if case.collective == "reduce_scatter" else self.recv

    def input(self, case: Case, inplace: bool) -> Any:
        """Where this rank's input goes (:meth:`Case.input_range` elements)."""
        if not inplace:
            return self.send
        lo, hi = case.shard
        return self.recv[lo:hi] if case.collective == "all_gather" else self.full(case)

    def poisoned(self, case: Case, inplace: bool) -> Any | None:
        """What is poisoned before a checked run (before the input is loaded): the output, or for an
        in-place all_gather the whole buffer; None when the input covers the output."""
        if not inplace:
            return self.recv
        return self.recv if case.collective == "all_gather" else None


@dataclasses.dataclass
class Prepared:
    """One ready call: ``run()`` starts the collective (asynchronously on GPUs), ``sync()`` waits
    for it, ``result`` is the array the check reads afterwards."""

    run: Callable[[], Any]
    result: Any
    sync: Callable[[], None]


def _no_sync() -> None:
    pass


def result_view(case: Case, arrays: Arrays, inplace: bool) -> Any:
    """Where ringcomm and NCCL leave this rank's result (for reduce off the root: the input, which
    must be unchanged)."""
    lo, hi = case.shard
    if case.collective == "reduce_scatter":
        return arrays.send[lo:hi] if inplace else arrays.recv
    if case.collective == "reduce" and case.rank != case.root and not inplace:
        return arrays.send
    return arrays.recv


class RingcommImpl:
    """ringcomm's collectives through the public Communicator API."""

    name = "ringcomm"

    def __init__(self, comm: Any, stream: Any = None, accumulate: str | None = None) -> None:
        self.comm = comm
        self.stream = stream  # a CuPy stream on GPU runs, None on the host
        self.accumulate = accumulate  # ringcomm's accumulate= for all_reduce, reduce_scatter, reduce

    def describe(self, array: Any, dtypes: Sequence[np.dtype]) -> str:
        """One header line: what this implementation is and how it moves data."""
        acc = f", float16/bfloat16 partial sums in {self.accumulate}" if self.accumulate else ""
        return f"ringcomm {_version()}: ring collectives, transport {self.comm.transport_name(array)}{acc}"

    def prepare(self, case: Case, arrays: Arrays, inplace: bool) -> Prepared | str:
        comm, op, root, c = self.comm, case.op, case.root, case.collective
        kw = {} if self.stream is None else {"stream": self.stream}
        red = dict(kw, accumulate=self.accumulate) if self.accumulate else kw  # the reducing collectives
        # the keywords bound once (a call with **{} costs 0.1 us, which MPI's calls do not pay)
        all_reduce, reduce_scatter, reduce = (
            partial(f, **red) if red else f for f in (comm.all_reduce, comm.reduce_scatter, comm.reduce)
        )
        all_gather, broadcast = (partial(f, **kw) if kw else f for f in (comm.all_gather, comm.broadcast))
        s, r = arrays.send, arrays.recv
        lo, hi = case.shard
        if c == "broadcast" and not inplace:
            return "ringcomm's broadcast is in place only"
        calls: dict[tuple[str, bool], Callable[[], Any]] = {
            ("all_reduce", False): lambda: all_reduce(s, op, out=r),
            ("all_reduce", True): lambda: all_reduce(r, op),
            ("reduce_scatter", False): lambda: reduce_scatter(s, op, out=r),
            ("reduce_scatter", True): lambda: reduce_scatter(s, op, out=s[lo:hi]),
            ("all_gather", False): lambda: all_gather(s, out=r),
            ("all_gather", True): lambda: all_gather(r[lo:hi], out=r),
            ("broadcast", True): lambda: broadcast(r, root),
            ("reduce", False): lambda: reduce(s, op, root, out=r),
            ("reduce", True): lambda: reduce(r, op, root),
        }
        sync = stream_sync(comm, self.stream) if self.stream is not None else _no_sync
        return Prepared(calls[c, inplace], result_view(case, arrays, inplace), sync)


# ---------------------------------------------------------------------------------------------- MPI

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,
    ReduceOp.PROD: MPI.PROD,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
}


_MPI_TYPES = {
    "int8": "INT8_T",
    "uint8": "UINT8_T",
    "int16": "INT16_T",
    "uint16": "UINT16_T",
    "int32": "INT32_T",
    "uint32": "UINT32_T",
    "int64": "INT64_T",
    "uint64": "UINT64_T",
    "float16": "FLOAT16_T",
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "bfloat16": "BFLOAT16_T",
}


def mpi_datatype(dtype: np.dtype) -> Any:
    """The named MPI datatype for ``dtype``, or None when the MPI library has none (MPICH 5 has no
    bfloat16; MPI before 5.0 may lack FLOAT16_T)."""
    name = _MPI_TYPES.get(np.dtype(dtype).name)
    t = getattr(MPI, name, MPI.DATATYPE_NULL) if name else MPI.DATATYPE_NULL
    return None if t == MPI.DATATYPE_NULL else t


class MpiImpl:
    """mpi4py's own collectives on a private duplicate of ringcomm's communicator.

    Host arrays are passed directly. GPU arrays are passed directly when the MPI is CUDA-aware,
    otherwise staged: each call copies device -> host, runs MPI on host mirrors, copies back (the
    copies are inside the timed call). ``avg`` is MPI_SUM then a local division (MPI has no average).
    Types the MPI library has no datatype for (bfloat16 in MPICH) use a commutative MPI user
    operation written with numpy, on 16-bit words.
    """

    name = "mpi"

    def __init__(self, comm: Any, device: str, cuda_aware: bool) -> None:
        # MPI_Comm_idup under the communicator's deadline, as Communicator() duplicates its own:
        # a peer that never creates its MpiImpl raises ringcomm.TimeoutError here instead of hanging.
        setup = Context("MpiImpl()", comm, HostDevice(), np.dtype(np.uint8), None)
        dup, request = comm.mpi.Idup()
        wait([request], setup, None, comm.left, "duplicating the MPI communicator for the MPI baseline")
        self.mpi = dup
        self.comm = comm
        self.size = comm.size
        self.device = device
        self.staged = device != "host" and not cuda_aware
        self.cuda_aware = cuda_aware
        self._user_ops: dict[tuple[ReduceOp, np.dtype], MPI.Op] = {}
        self._mirrors = Buffers(np)

    def describe(self, array: Any, dtypes: Sequence[np.dtype]) -> str:
        """One header line, including the types that need an MPI user op."""
        where = (
            "host buffers"
            if self.device == "host"
            else (
                "device buffers (CUDA-aware MPI)"
                if self.cuda_aware
                else "host copies of the device buffers (MPI is not CUDA-aware; the copies are timed)"
            )
        )
        missing = [str(np.dtype(d)) for d in dtypes if mpi_datatype(d) is None]
        extra = (
            (
                f"; {', '.join(missing)} reductions via a commutative MPI user op written with numpy "
                f"(this MPI has no {', '.join(missing)} datatype)"
            )
            if missing
            else ""
        )
        return (
            f"mpi4py {_mpi4py_version()} collectives (Allreduce, Reduce_scatter_block/Reduce_scatter, "
            f"Allgather/Allgatherv, Bcast, Reduce) on {where}; avg = MPI_SUM then divide{extra}"
        )

    def close(self) -> None:
        for op in self._user_ops.values():
            op.Free()
        self._user_ops.clear()
        self._mirrors.release()
        if self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    def _types(self, case: Case) -> tuple[Any, Any, Callable[[Any], Any]]:
        """(MPI datatype, MPI op, view) for the case; ``view`` turns an array into what MPI gets."""
        dt = mpi_datatype(case.dtype)
        op = _MPI_OPS[case.op] if case.op is not None else MPI.SUM
        if dt is not None:
            return dt, op, lambda a: a
        size = case.dtype.itemsize
        word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
        dt = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}[size]
        if case.op is not None:
            op = self._user_op(case.op, case.dtype)
        return dt, op, lambda a: a.view(word)

    def _user_op(self, op: ReduceOp, dtype: np.dtype) -> MPI.Op:
        key = (op, dtype)
        if key not in self._user_ops:
            ufunc = COMBINE[op]

            def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                a = np.frombuffer(inbuf, dtype)
                b = np.frombuffer(inoutbuf, dtype)
                ufunc(a, b, out=b)

            self._user_ops[key] = MPI.Op.Create(combine, commute=True)
        return self._user_ops[key]

    def prepare(self, case: Case, arrays: Arrays, inplace: bool) -> Prepared | str:
        c, n, root, rank = case.collective, self.size, case.root, case.rank
        if c == "broadcast" and not inplace:
            return "MPI_Bcast is in place only"
        dt, op, view = self._types(case)
        avg = case.op is ReduceOp.AVG
        if self.staged:
            s = self._mirrors.get("send", arrays.send.size, case.dtype)
            r = self._mirrors.get("recv", arrays.recv.size, case.dtype)
        else:
            s, r = arrays.send, arrays.recv
        lo, hi = case.shard
        counts = [b - a for a, b in case.bounds]
        uniform = len(set(counts)) == 1
        S, R = [view(s), dt], [view(r), dt]
        comm = self.mpi
        everything = slice(None)
        # down: the (buffer, slice) inputs a staged call copies to the host first; up: the output it
        # copies back; result: the device/host array the check reads.
        if c == "all_reduce":

            def call() -> None:
                comm.Allreduce(MPI.IN_PLACE if inplace else S, R, op)
                if avg:
                    np.divide(r, n, out=r)

            down, up, result = ("recv" if inplace else "send", everything), ("recv", everything), arrays.recv
        elif c == "reduce_scatter":
            out = s[: hi - lo] if inplace else r
            send, recv = (MPI.IN_PLACE, S) if inplace else (S, R)

            def call() -> None:
                if uniform:
                    comm.Reduce_scatter_block(send, recv, op)
                else:
                    comm.Reduce_scatter(send, recv, counts, op)
                if avg:
                    np.divide(out, n, out=out)

            down = ("send", everything)
            up = ("send", slice(0, hi - lo)) if inplace else ("recv", everything)
            result = arrays.send[: hi - lo] if inplace else arrays.recv
        elif c == "all_gather":
            target = R if uniform else [view(r), (counts, [a for a, _ in case.bounds]), dt]
            gather = comm.Allgather if uniform else comm.Allgatherv

            def call() -> None:
                gather(MPI.IN_PLACE if inplace else S, target)

            down = ("recv", slice(lo, hi)) if inplace else ("send", everything)
            up, result = ("recv", everything), arrays.recv
        elif c == "broadcast":

            def call() -> None:
                comm.Bcast(R, root)

            down, up, result = ("recv", everything), ("recv", everything), arrays.recv
        elif c == "reduce":
            is_root = rank == root
            if inplace:
                send, recv = (MPI.IN_PLACE, R) if is_root else (R, None)
            else:
                send, recv = S, (R if is_root else None)

            def call() -> None:
                comm.Reduce(send, recv, op, root)
                if avg and is_root:
                    np.divide(r, n, out=r)

            down = ("recv" if inplace else "send", everything)
            up = ("recv", everything) if is_root else None
            result = arrays.recv if (inplace or is_root) else arrays.send
        else:
            raise ValueError(c)

        if not self.staged:
            return Prepared(call, result, _no_sync if self.device == "host" else stream_sync(self.comm))
        pairs = {"send": (arrays.send, s), "recv": (arrays.recv, r)}
        return Prepared(_staged(call, pairs, down, up), result, stream_sync(self.comm))


def _staged(
    call: Callable[[], None],
    pairs: dict[str, tuple[Any, np.ndarray]],
    down: tuple[str, slice],
    up: tuple[str, slice] | None,
) -> Callable[[], None]:
    """``call`` on host mirrors, between the device -> host copy of ``down`` and the host -> device
    copy of ``up`` (``pairs`` maps a buffer name to its (device array, host mirror))."""
    dev_in, host_in = (a[down[1]] for a in pairs[down[0]])
    dev_out, host_out = (a[up[1]] for a in pairs[up[0]]) if up is not None else (None, None)

    def run() -> None:
        dev_in.get(out=host_in)
        call()
        if dev_out is not None:
            dev_out.set(host_out)

    return run


def stream_sync(comm: Any, stream: Any = None) -> Callable[[], None]:
    """A function that waits for the work queued on ``stream`` (default: CuPy's current stream at
    the time of the wait: loads, poison, staged copies), so that what reads the arrays next, from
    another stream or through MPI, sees it. It polls an event under the communicator's deadline
    (like every ringcomm wait): a hung kernel is a ringcomm.TimeoutError, not a hang."""
    from ..transports.base import wait_until

    ctx = Context("ringcomm-bench", comm, HostDevice(), np.dtype(np.uint8), None)
    events: list = []  # made at the first wait (CuPy is imported only where it runs)

    def sync() -> None:
        import cupy

        if not events:
            events.append(cupy.cuda.Event(block=False, disable_timing=True))
        event = events[0]
        event.record(stream if stream is not None else cupy.cuda.get_current_stream())
        wait_until(lambda: event.done, ctx, None, comm.rank, "this rank's GPU work (benchmark synchronisation)")

    return sync


# --------------------------------------------------------------------------------------------- NCCL

_NCCL_TYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}

#: NCCL_UNIQUE_ID_BYTES
NCCL_ID_BYTES = 128
#: The forms ``cupy.cuda.nccl.get_unique_id()`` returns, as broadcast with the id: bytes (CuPy 14 and
#: later), or a tuple of 128 C ``char`` values (CuPy before 14), signed (x86) or unsigned (ARM).
ID_BYTES, ID_SIGNED, ID_UNSIGNED = 1, 2, 3
#: The first NCCL that lets several ranks share one GPU (with NCCL_MULTI_RANK_GPU_ENABLE=1); older
#: versions refuse such communicators ("Duplicate GPU detected", ncclInvalidUsage).
MULTI_RANK_GPU_MIN = (2, 30)


def unique_id_bytes(uid: Any) -> tuple[bytes, int]:
    """(the 128 bytes, the form) of what ``nccl.get_unique_id()`` returned: ``bytes`` (CuPy 14+) or a
    tuple of 128 ``char`` values (CuPy < 14; negative where ``char`` is signed). ValueError otherwise."""
    if isinstance(uid, (bytes, bytearray, memoryview)):
        raw, form = bytes(uid), ID_BYTES
    else:
        values = [int(v) for v in uid]
        if any(not -128 <= v <= 255 for v in values):
            raise ValueError("ncclGetUniqueId gave values outside a C char's range")
        raw = bytes(v & 0xFF for v in values)
        form = ID_SIGNED if any(v < 0 for v in values) else ID_UNSIGNED
    if len(raw) != NCCL_ID_BYTES:
        raise ValueError(f"ncclGetUniqueId gave {len(raw)} bytes; an ncclUniqueId has {NCCL_ID_BYTES}")
    return raw, form


def unique_id_for(raw: bytes, form: int) -> bytes | tuple[int, ...]:
    """The id in the form this CuPy's ``NcclCommunicator(ndev, commId, rank)`` takes: the form its
    ``get_unique_id()`` gave (CuPy 14 checks for bytes of length 128; older CuPy wants the tuple)."""
    if form == ID_BYTES:
        return bytes(raw)
    if form == ID_SIGNED:
        return tuple(b - 256 if b > 127 else b for b in raw)
    return tuple(raw)


def _version_tuple(version: str) -> tuple[int, int]:
    return tuple(int(x) for x in version.split(".")[:2])  # type: ignore[return-value]


class NcclImpl:
    """NCCL through CuPy's ``cupy.cuda.nccl`` on the same device buffers and stream as ringcomm.

    ``mark`` ("*" or "") follows the name in the table when ranks share a GPU, and ``footnote``
    (a header line, or None) says what that means for its times."""

    name = "nccl"

    def __init__(self, nccl: Any, ncomm: Any, stream: Any, version: str, comm: Any) -> None:
        self.nccl, self.ncomm, self.stream, self.version = nccl, ncomm, stream, version
        self.sync = stream_sync(comm, stream)
        self._v = _version_tuple(version)
        self.mark, self.footnote = "", None

    @classmethod
    def create(
        cls, comm: Any, cupy: Any, nccl: Any, stream: Any, ranks_per_gpu: int = 1, mps: str | None = None
    ) -> tuple[NcclImpl | None, str]:
        """Set NCCL up on every rank, or on none: (impl, "") or (None, why NCCL could not run).

        Collective over ``comm``. ``ranks_per_gpu``: the most ranks that share one GPU; when more than
        one, NCCL_MULTI_RANK_GPU_ENABLE=1 is set first unless already set (NCCL 2.30+ refuses such
        communicators otherwise, older NCCL always), and the impl is marked (``mps``: how the ranks
        share the GPU through MPS, None when they time-slice it). The reason names NCCL's version, the
        rank and NCCL's own error. The unique id goes to the other ranks as its 128 bytes, and is
        handed to ``NcclCommunicator`` in the form this CuPy's ``get_unique_id`` returned.
        """
        from .env import gather_strings, nccl_version

        version = nccl_version(nccl)
        shared = ranks_per_gpu > 1
        if shared:
            os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        msg = np.zeros(2 + NCCL_ID_BYTES, np.uint8)  # ok, form, the id
        why = ""
        if comm.rank == 0:
            try:
                raw, form = unique_id_bytes(nccl.get_unique_id())
                msg[0], msg[1], msg[2:] = 1, form, np.frombuffer(raw, np.uint8)
            except Exception as e:
                why = f"ncclGetUniqueId failed on rank 0 ({type(e).__name__}: {e})"
        comm.broadcast(msg, 0)
        if not msg[0]:
            return None, f"NCCL {version}: {why or 'ncclGetUniqueId failed on rank 0'}"
        ncomm = None
        try:
            ncomm = nccl.NcclCommunicator(comm.size, unique_id_for(msg[2:].tobytes(), int(msg[1])), comm.rank)
        except Exception as e:
            why = f"ncclCommInitRank failed on rank {comm.rank} ({type(e).__name__}: {e})"
        whys = [w for w in gather_strings(comm, why) if w]  # every rank's reason, so rank 0 can say it
        if whys:
            if ncomm is not None:
                ncomm.destroy()
            return None, f"NCCL {version}: {whys[0]}{cls._shared_gpu_hint(version, ranks_per_gpu)}"
        impl = cls(nccl, ncomm, stream, version, comm)
        if shared:
            impl.mark = "*"
            if mps:
                impl.footnote = (
                    f"nccl*: {ranks_per_gpu} ranks share one GPU through MPS ({mps}); its times are "
                    "not those of separate GPUs"
                )
            else:
                impl.footnote = (
                    f"nccl*: {ranks_per_gpu} ranks time-slice one GPU without MPS; NCCL's kernels "
                    "spin, so its times are not those of separate GPUs"
                )
        return impl, ""

    @staticmethod
    def _shared_gpu_hint(version: str, ranks_per_gpu: int) -> str:
        """Why NCCL may have refused: several ranks on one GPU."""
        if ranks_per_gpu < 2:
            return ""
        need = ".".join(map(str, MULTI_RANK_GPU_MIN))
        if _version_tuple(version) < MULTI_RANK_GPU_MIN:
            return (
                f"; {ranks_per_gpu} ranks share a GPU here, which NCCL before {need} refuses "
                f"(NCCL_MULTI_RANK_GPU_ENABLE needs NCCL {need} or later)"
            )
        setting = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE")
        if setting != "1":
            return f"; {ranks_per_gpu} ranks share a GPU here, and NCCL_MULTI_RANK_GPU_ENABLE={setting} (1 allows it)"
        return f"; {ranks_per_gpu} ranks share a GPU here (NCCL_MULTI_RANK_GPU_ENABLE=1)"

    def describe(self, array: Any, dtypes: Sequence[np.dtype]) -> str:
        """One header line."""
        return f"NCCL {self.version} through cupy.cuda.nccl (same buffers and stream as ringcomm)"

    def close(self) -> None:
        if self.ncomm is not None:
            self.ncomm.destroy()
            self.ncomm = None

    def prepare(self, case: Case, arrays: Arrays, inplace: bool) -> Prepared | str:
        dname = "bfloat16" if case.dtype == bfloat16 else case.dtype.name
        if dname not in _NCCL_TYPES:
            return f"NCCL has no {dname} type"
        if (case.op is ReduceOp.AVG or dname == "bfloat16") and self._v < (2, 10):
            return f"NCCL {self.version} has no {'avg' if case.op is ReduceOp.AVG else 'bfloat16'} (needs 2.10)"
        dt = _NCCL_TYPES[dname]
        op = _NCCL_OPS[case.op] if case.op is not None else 0
        counts = {b - a for a, b in case.bounds}
        if len(counts) > 1:
            return "NCCL needs equal shards"
        c, nc, st = case.collective, self.ncomm, self.stream.ptr
        lo, hi = case.shard
        item = case.dtype.itemsize
        s, r = arrays.send.data.ptr, arrays.recv.data.ptr
        if c == "all_reduce":
            src = r if inplace else s
            run = lambda: nc.allReduce(src, r, case.count, dt, op, st)  # noqa: E731
        elif c == "reduce_scatter":
            dst = s + lo * item if inplace else r
            run = lambda: nc.reduceScatter(s, dst, hi - lo, dt, op, st)  # noqa: E731
        elif c == "all_gather":
            src = r + lo * item if inplace else s
            run = lambda: nc.allGather(src, r, hi - lo, dt, st)  # noqa: E731
        elif c == "broadcast":
            src = r if inplace else s
            run = lambda: nc.broadcast(src, r, case.count, dt, case.root, st)  # noqa: E731
        elif c == "reduce":
            src = r if inplace else s
            run = lambda: nc.reduce(src, r, case.count, dt, op, case.root, st)  # noqa: E731
        else:
            raise ValueError(c)
        return Prepared(run, result_view(case, arrays, inplace), self.sync)


def _version() -> str:
    import ringcomm

    return ringcomm.__version__


def _mpi4py_version() -> str:
    import mpi4py

    return mpi4py.__version__
