"""The device executor: a whole ring collective in one kernel launch (csrc/ring.cu).

Chosen by ``RINGCOMM_TRANSPORT=kernel`` for rings whose every edge joins GPUs that can map each
other's memory (CUDA IPC: one node; several ranks on one GPU need MPS, so that every rank's blocks
run at once). The host checks the call, looks up the call's step table (ringcomm.schedule's steps,
bound by engine.bind: which buffer each step reads; cached in device memory) and launches one
kernel on the call's stream; it returns without waiting. The kernel runs every step: channel c of
rank r pushes its pieces into a FIFO in its right neighbour's memory and takes its left
neighbour's out of its own, the two hazards of a ring step (DESIGN.md) being counters that only
grow (ready: written by the left; freed: written by the right), stored with release and loaded
with acquire at system scope.

Memory per communicator and device: one dedicated allocation (cudaMalloc, not a pool block, so no
pool trim can free it under a neighbour's mapping), exported and mapped by the other ranks once,
at set-up: a control block of 128-byte lines (counters, the epoch, the abort word, the one-shot
counters), the FIFOs, ``CHANNELS x SLOTS x SLOT_BYTES`` (2 MiB by default), and the one-shot inbox
(2 x N x RINGCOMM_ONESHOT_BYTES); and 128 bytes of pinned host memory for the error record.

Failures never hang and never trap: every wait inside the kernel has the communicator's deadline;
on expiry (or a neighbour's call that differs: each call's first piece is a header with the call
number, collective, dtype, op, root and count) the kernel records what it waited for in the error
record, marks both neighbours aborted (they stop at once, naming the origin) and returns. The host
raises the error (:class:`ringcomm.TimeoutError`, :class:`ringcomm.AbortError`,
:class:`ringcomm.MismatchError`) at the next call, ``check_errors()`` or ``close()``.

With accumulate="float32" on a half type the partial sums live in a float32 scratch (the engine's
ACC) and travel in float32, as the engine's loop has them.

CUDA graphs: a call made while its stream captures is captured as its one kernel node (its step
table, made on a stream of its own when the kind of call is new, kept while the executor lives);
every replay runs the collective again (the epoch is in device memory; a call's scratch is the
graph's own: Communicator._scratch_array). A capture may not depend on work outside it, so captured
calls are not ordered after the eager ones on other streams: the caller orders the graph's stream
with them, as for NCCL.

Small all-reduces (up to RINGCOMM_ONESHOT_BYTES, on rings of up to ONESHOT_MAX_RANKS) run one-shot
in the same kernel (nsteps = -1): every rank pushes its buffer into every other rank's inbox and
folds the N copies in ringcomm.schedule.fold_order, the ring's bits in one exchange instead of
2(N-1) steps (csrc/ring.cu's oneshot_block). So every rank maps every other rank's allocation.

Co-residency: every rank's blocks must run at once, or the ring waits on blocks that cannot start.
At set-up (transports.select) :func:`kernel_fit` keeps the kernel only where each GPU has room for
one block per SM of every ring kernel it runs (at most half its SMs per rank) and where ranks that
share a GPU share it through MPS (without MPS their kernels take turns instead of running at once);
then the executor runs a probe kernel (an empty all-reduce: every channel of every rank exchanges
its header with both neighbours) under a short deadline. Where either fails, the ring keeps the
host-driven ipc path and says why (a warning, the DEBUG log, the bench header).
"""

from __future__ import annotations

import atexit
import logging
import sys
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from .arrays import on_stream
from .config import env
from .devices.cuda import _OP_NAME, BLOCK, SUFFIX, capture_relaxed, kernel, pointer
from .engine import Context, bind
from .errors import AbortError, MismatchError, NotCoResident, TimeoutError
from .ops import AVG, FLOAT_DTYPES, OPS, ReduceOp
from .schedule import Bounds, Step
from .transports.base import abandon, wait, wait_until
from .transports.ipc import _words

log = logging.getLogger("ringcomm")

#: blocks (channels) per rank, at most; each has its own FIFO and counters
CHANNELS = 8
#: FIFO slots per channel, and bytes per slot (a piece of a chunk)
SLOTS = 4
SLOT_BYTES = 64 << 10
#: csrc/ring.cu's error record: its u64 words (RC_RING_ERR_WORDS), and the failure kinds it records
#: beside a timeout (RC_RING_ABORTED, RC_RING_MISMATCH)
ERR_WORDS = 16
ABORTED, MISMATCH = 2, 3
#: kinds of call (collective, count, dtype, op, root, in place) whose step table and launch
#: arguments are kept
CALLS = 64
COLLECTIVE_CODES = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4, "reduce": 5}
_CODE_NAMES = {v: k for k, v in COLLECTIVE_CODES.items()}
#: seconds the set-up's probe kernel waits for the neighbours' blocks (at most the communicator's timeout)
PROBE_SECONDS = 5.0
#: one-shot all-reduces (csrc/ring.cu, nsteps = -1): at most this many ranks (RC_ONESHOT_MAX_RANKS), and
#: by default up to this many bytes (RINGCOMM_ONESHOT_BYTES; 0: never): each rank's inbox holds 2 x N x it
ONESHOT_MAX_RANKS = 8
ONESHOT_BYTES = 64 << 10


def kernel_fit(records: Any) -> tuple[int, str]:
    """The channels (blocks) of every rank's ring kernel, the same on every rank, from the ranks'
    transports.PeerRecord (in rank order); or 0 and why the ranks' blocks could not all be resident
    at once: ranks sharing a GPU without MPS (their contexts take turns on it), or a GPU with fewer
    SMs than one block per SM for each of its ranks' channels (a rank alone on a GPU takes at most
    half of its SMs)."""
    by_gpu: dict[tuple[int, int], list[int]] = {}
    for rank, record in enumerate(records):
        by_gpu.setdefault((record.node, record.gpu), []).append(rank)
    channels = CHANNELS
    for (node, gpu), ranks in by_gpu.items():
        where = f"GPU {_bus(gpu)} of node {node}"
        if len(ranks) > 1 and not all(records[r].mps for r in ranks):
            without = [r for r in ranks if not records[r].mps]
            return 0, (
                f"ranks {', '.join(map(str, ranks))} share {where}, rank(s) {', '.join(map(str, without))} not "
                "under MPS, so their kernels would take turns instead of running at once: start MPS "
                "(nvidia-cuda-mps-control -d) before the job"
            )
        sms = min(records[r].sms for r in ranks)
        channels = min(channels, sms // max(2, len(ranks)))
        if channels < 1:
            return 0, (
                f"{where} has {sms} SMs: too few for one block per SM of {len(ranks)} rank(s)' ring kernels "
                "(at most half of a GPU's SMs per rank)"
            )
    return channels, ""


def all_reach(records: Any) -> bool:
    """Whether every rank's GPU can map every other rank's memory (one node; the same GPU, or peer
    access), as a one-shot call needs; a kernel ring needs it only of its edges."""
    return all(
        a.node == b.node and (a.gpu == b.gpu or b.gpu in a.peers) for a in records for b in records if a is not b
    )


def _bus(gpu: int) -> str:
    """A bus id from transports.bus_id back in CUDA's form "dddd:bb:dd.f"."""
    return f"{gpu >> 24:04x}:{gpu >> 16 & 0xFF:02x}:{gpu >> 8 & 0xFF:02x}.{gpu & 0xFF:x}"


#: every executor's allocation until its close(): a communicator dropped without close() may still be
#: mapped by its neighbours, and CUDA leaves freeing such memory undefined (kept for the process's life)
_mapped_by_peers: list = []
#: the executors set up and not yet closed (for _report_at_exit)
_open: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _report_at_exit() -> None:
    """At the interpreter's exit: a failure that a ring kernel recorded after its call returned, and
    that no later call, check_errors() or close() raised (the program ended after the call without
    any of them), is said on stderr, since that call's result is undefined. (A kernel still running
    at exit is not waited for.)"""
    for ex in list(_open):
        error = None if ex.comm._aborted else ex.failure()
        if error is not None:
            sys.stderr.write(
                f"ringcomm: rank {ex.comm.rank}: a ring kernel failed after its call returned, and nothing raised "
                f"it before the exit (its result is undefined): {type(error).__name__}: {error}\n"
            )


def fifo_offset(channels: int) -> int:
    """csrc/ring.cu's RC_RING_FIFO_OFFSET: the control block's bytes, rounded up to 4096."""
    return -(-(3 * channels + 1 + 2 * channels * ONESHOT_MAX_RANKS) * 128 // 4096) * 4096


def region_bytes(channels: int, ranks: int, oneshot: int) -> int:
    """Bytes of one rank's dedicated allocation: the control block, the FIFOs, and the one-shot inbox
    (2 halves x ``ranks`` senders x ``oneshot`` bytes, where one-shot calls run)."""
    inbox = 2 * ranks * oneshot if ranks <= ONESHOT_MAX_RANKS else 0
    return fifo_offset(channels) + channels * SLOTS * SLOT_BYTES + inbox


def step_table(
    steps: tuple[Step, ...],
    bounds: Bounds,
    in_place: bool,
    result_chunks: Any,
    wide: bool = False,
    own: tuple[int, str] | None = None,
) -> np.ndarray:
    """The int64 table csrc/ring.cu runs (see its header): per step (send chunk, send from, recv
    chunk, reduce, final, local from, widen from, into), engine.bind's for these steps; then every
    chunk's (lo, hi); then per chunk 1 where it must be copied from src at the end (a result chunk
    that no step wrote). ``wide``: accumulate="float32" (partial sums in ACC, sent in float32).
    ``own``: None, or (chunk, way) where that chunk lies in a buffer of its own (csrc/ring.cu's
    ``own``), so that no copy is queued around the kernel: "in", an all-gather's shard (every send of
    the chunk reads it there, and it is copied from there into work at the end: 3 and 2); "out", a
    reduce-scatter's result (the step that receives the chunk, its last reduction, writes it there: into 1)."""
    bound, written = bind(steps, len(bounds), in_place, wide)
    if own is not None:  # (an all-gather's shard is never a float32 partial sum; the result is the final reduction)
        chunk, way = own
        assert way == "out" or (way == "in" and not wide), own
        assert way == "in" or all(st.final for st in steps if st.recv == chunk), own
    rows = [
        (
            -1 if st.send is None else st.send,
            0 if send_from is None else send_from,
            -1 if st.recv is None else st.recv,
            int(st.reduce),
            int(st.final),
            0 if local_from is None else local_from,
            -1 if widen_from is None else widen_from,
            int(own is not None and own[1] == "out" and st.recv == own[0]),
        )
        for st, (send_from, widen_from, local_from) in zip(steps, bound)
    ]
    copies = [0] * len(bounds)
    for c in result_chunks:
        copies[c] = int(not written[c])
    if own is not None and own[1] == "in":
        rows = [(row[0], 3, *row[2:]) if row[0] == own[0] else row for row in rows]
        copies[own[0]] = 2
    return np.array([v for row in rows for v in row] + [v for b in bounds for v in b] + copies, np.int64)


class RingExecutor:
    """One communicator's executor on one device: its dedicated allocation, the neighbours'
    mappings of theirs, the error record, the step tables. Made collectively (exchanges the IPC
    handles and runs the probe), at set-up; raises :class:`NotCoResident` (on every rank) where the
    probe fails, its resources freed."""

    def __init__(self, comm: Any, channels: int, mesh: bool) -> None:
        import cupy

        self.comm, self.cupy = comm, cupy
        rt = cupy.cuda.runtime
        self.device_id = int(rt.getDevice())
        self.channels = channels  # (kernel_fit's: the same on every rank)
        #: all-reduces up to this many bytes run one-shot (RINGCOMM_ONESHOT_BYTES, in 256-byte units; 0: none;
        #: none either over ONESHOT_MAX_RANKS ranks, or where some rank cannot map another's memory: ``mesh``)
        self.oneshot = -(-max(0, env("RINGCOMM_ONESHOT_BYTES", int, ONESHOT_BYTES)) // 256) * 256
        if comm.size > ONESHOT_MAX_RANKS or not mesh:
            self.oneshot = 0
        self.nbytes = region_bytes(self.channels, comm.size, self.oneshot)
        self.memory = cupy.cuda.Memory(self.nbytes)  # cudaMalloc: dedicated, exportable
        _mapped_by_peers.append(self.memory)  # (freed by close() alone, once the neighbours unmapped it)
        whole = cupy.ndarray((self.nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(self.memory, 0))
        whole.fill(0)
        cupy.cuda.Device(self.device_id).synchronize()
        self._pinned = cupy.cuda.alloc_pinned_memory(ERR_WORDS * 8)
        self.err = np.frombuffer(self._pinned, np.uint64, ERR_WORDS)
        self.err[:] = 0
        self.err_ptr = int(self.err.ctypes.data)
        handle = rt.ipcGetMemHandle(self.memory.ptr)
        setup = Context("the ring executor's set-up", comm, comm._host, np.dtype(np.uint8), None)
        words = np.append(_words(handle), self.oneshot)
        table = comm._allgather_ints(setup, words, "exchanging the ring executor's memory handles")
        if len({int(row[-1]) for row in table}) > 1:  # (every rank writes into the others' inboxes)
            values = ", ".join(f"rank {r}: {int(row[-1])}" for r, row in enumerate(table))
            raise MismatchError(f"the ranks disagree on RINGCOMM_ONESHOT_BYTES ({values})")
        # the other ranks' allocations, mapped here, by ring place (this rank's own at its place): the
        # neighbours' (a ring kernel writes into them), every rank's where one-shot calls run (0: unmapped)
        self._opened: list[int] = []
        self.peers = []
        near = {comm.left, comm.right}
        for rank in comm.ring:
            if rank == comm.rank:
                self.peers.append(self.memory.ptr)
            elif rank not in near and not self.oneshot:
                self.peers.append(0)
            else:
                handle = table[rank][:-1].tobytes()
                self._opened.append(int(rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)))
                self.peers.append(self._opened[-1])
        self.left_ptr, self.right_ptr = self.peers[comm.position - 1], self.peers[(comm.position + 1) % comm.size]
        probe = kernel("ring.cu", "ringcomm_ring_sum_u8")  # (compiled before the ranks meet: no skew)
        # every rank's control block is zero before any kernel writes into a neighbour's
        wait([comm.mpi.Ibarrier()], setup, None, comm.left, "the ring executor's set-up")
        #: per kind of call (steps, bounds, in place, dtype, op, root): (steps, kernel, arguments
        #: before and after the buffers', bytes sent, the step table in device memory)
        self.calls: OrderedDict[tuple, tuple] = OrderedDict()
        self.captured: dict[int, Any] = {}  # step tables launched in a CUDA graph capture (kept while this lives)
        self.setup: Any = None  # a stream of its own: the probe's, and the copies of step tables made in a capture
        self.last: Any = None  # the end of the last kernel (devices.cuda.LastUse): where the next call begins
        log.debug(
            "ring executor on rank %d/%d: device %d, %d channels x %d slots x %d B (%d B of device memory)",
            comm.rank,
            comm.size,
            self.device_id,
            self.channels,
            SLOTS,
            SLOT_BYTES,
            self.nbytes,
        )
        self._probe(probe, setup)
        _open.add(self)

    def _probe(self, k: Any, setup: Any) -> None:
        """Run an empty all-reduce (each channel's header to the right, the left's checked) under a
        deadline of PROBE_SECONDS at most, and agree with every rank whether all ran at once: a
        block that cannot become resident leaves its neighbours waiting until the deadline. Raises
        NotCoResident on every rank where any failed (after closing this executor)."""
        comm, cupy = self.comm, self.cupy
        seconds = min(comm.timeout, PROBE_SECONDS)
        self.setup = cupy.cuda.Stream(non_blocking=True)
        with on_stream(self.setup):
            table = cupy.zeros(1, cupy.int64)  # no step, no chunk: the header alone
        at = np.uint64(table.data.ptr)
        sig = signature("all_reduce", np.dtype(np.uint8), ReduceOp.SUM, -1)
        start = time.perf_counter()
        args = (at, np.int32(0), np.int32(0), at, at, np.uint64(0), np.uint64(0), *self._ring_args(sig, 0, seconds))
        args += (np.int32(0), np.float64(1))
        k((self.channels,), (BLOCK,), args, stream=self.setup)
        done = cupy.cuda.Event()
        done.record(self.setup)
        wait_until(lambda: done.done, setup, None, comm.left, "the ring kernel's probe")
        elapsed = time.perf_counter() - start
        failure = self.failure()
        rows = comm._allgather_ints(
            setup, np.array([failure is None, int(elapsed * 1e6)], np.int64), "agreeing on the ring kernel's probe"
        )
        failed = [r for r in range(comm.size) if not rows[r][0]]
        if not failed:
            log.debug(
                "ring kernel probe on rank %d/%d: every rank's %d blocks ran at once (%d us here, %d us at most)",
                comm.rank,
                comm.size,
                self.channels,
                rows[comm.rank][1],
                max(int(row[1]) for row in rows),
            )
            return
        if failure is not None:
            log.debug("ring kernel probe on rank %d/%d: %s", comm.rank, comm.size, failure)
        self.err[:] = 0
        self.close()
        raise NotCoResident(
            f"the probe kernel's blocks did not all run at once: rank(s) {', '.join(map(str, failed))} waited "
            f"{seconds:g} s for a neighbour's (another job holding the GPU's SMs, or ranks sharing a GPU "
            "without MPS)"
        )

    def _ring_args(self, sig: int, count: int, seconds: float) -> tuple:
        """csrc/ring.cu's arguments after the buffers': the memory, the call's header, the deadline."""
        comm = self.comm
        return (
            np.uint64(self.memory.ptr),
            np.uint64(self.left_ptr),
            np.uint64(self.right_ptr),
            np.uint64(self.err_ptr),
            np.uint64(sig),
            np.uint64(count),
            np.uint64(int(seconds * 1e9)),
            np.int32(comm.position),
            np.int32(SLOTS),
            np.uint64(SLOT_BYTES),
        )

    def summary(self) -> str:
        """What the bench header says of this executor: its blocks and the one-shot's crossover."""
        what = f"{self.channels} block(s) per rank, each a FIFO of {SLOTS} x {SLOT_BYTES >> 10} KiB; "
        if not self.oneshot:
            return what + "all-reduces by the ring's steps (no one-shot: RINGCOMM_ONESHOT_BYTES=0, or over 8 ranks)"
        return what + (
            f"all-reduces up to {self.oneshot} B one-shot (every rank's buffer to every other rank, folded in the "
            "ring's order; RINGCOMM_ONESHOT_BYTES), larger ones by the ring's steps"
        )

    def run(
        self,
        ctx: Any,
        steps: tuple[Step, ...],
        bounds: Bounds,
        work: Any,
        src: Any,
        result_chunks: Any = (),
        own: tuple | None = None,
    ) -> int:
        """Queue the call on ``ctx.device``'s stream as one kernel; return the payload bytes sent.
        ``own``: None, or (array, way): this rank's chunk in that array, :func:`step_table`'s ``own``."""
        way = None if own is None else own[1]
        key = self.key(ctx, steps, bounds, work is src, result_chunks, way)
        call = self.calls.get(key)
        if call is None or call[0] is not steps:
            with capture_relaxed(ctx.device.stream):  # (its allocation, copy, kernel load, event queries)
                call = self._prepare(key, ctx, steps, bounds, work is src, result_chunks, way)
        acc, mine = ctx.acc, None if own is None else own[0]
        at = (pointer(work), pointer(src), 0 if acc is None else pointer(acc), 0 if mine is None else pointer(mine))
        return self.launch(key, call, ctx.device, *at)

    def key(
        self,
        ctx: Any,
        steps: tuple[Step, ...],
        bounds: Bounds,
        in_place: bool,
        result_chunks: Any,
        own: str | None = None,
    ) -> tuple:
        """What a kind of call's launch is kept by (:attr:`calls`): its steps, chunks, the way of this
        rank's own chunk (None, "in" or "out": :meth:`run`'s ``own``) and header."""
        header = (ctx.dtype, ctx.op, ctx.root, ctx.collective, ctx.wide)
        return (id(steps), bounds, in_place, tuple(result_chunks), own, *header, self.one_shot(ctx, bounds))

    def one_shot(self, ctx: Any, bounds: Bounds) -> bool:
        """Whether the call runs one-shot: an all-reduce of at most :attr:`oneshot` bytes (not
        accumulate="float32"); else the ring's steps."""
        count = bounds[-1][1] if bounds else 0
        small = 0 < self.oneshot and count * ctx.dtype.itemsize <= self.oneshot
        return small and ctx.collective == "all_reduce" and not ctx.wide

    def algorithm(self, ctx: Any, bounds: Bounds, ring: str) -> str:
        """The call's algorithm for the DEBUG log: "one-shot (one kernel)", or ``ring`` (the schedule's
        name) in one kernel."""
        return f"{'one-shot' if self.one_shot(ctx, bounds) else ring} (one kernel)"

    def launch(self, key: tuple, call: tuple, device: Any, work: int, src: int, acc: int = 0, own: int = 0) -> int:
        """Queue the kept ``call`` (:attr:`calls`'s ``key``) on ``device``'s stream with its buffers at
        these device addresses (0: none); return the payload bytes sent (run's work once it found
        the call; collectives' kernel lane calls it straight)."""
        self.calls.move_to_end(key)
        _, k, head, tail, sent, table = call
        stream = device.stream
        capturing = stream.is_capturing()
        # the calls of a communicator run one after another, as they were made, whatever their
        # streams (each kernel keeps the epoch for the next): after the last one's kernel. (Not
        # in a capture, which may not depend on work outside it: a graph's replays are ordered
        # by the stream they are launched on, the eager calls' order with them is the caller's.)
        if not capturing:
            device.after(self.last)
        args = (*head, np.uint64(work), np.uint64(src), np.uint64(acc), np.uint64(own), *tail)
        k((self.channels,), (BLOCK,), args, stream=stream)
        if capturing:
            self.captured[id(table)] = table  # (a graph may replay it for as long as the executor lives)
        else:
            self.last = device.record(self.last)
        return sent

    def _prepare(
        self,
        key: tuple,
        ctx: Any,
        steps: tuple[Step, ...],
        bounds: Bounds,
        in_place: bool,
        result_chunks: Any,
        own: str | None,
    ):
        """What every call like this one launches (kept by ``key``, at most CALLS): the step table
        in device memory (copied in on the call's stream), the kernel, its arguments but the
        buffers', and the payload bytes sent."""
        comm, dtype, op, device = self.comm, ctx.dtype, ctx.op, ctx.device
        one_shot = self.one_shot(ctx, bounds)
        if one_shot:  # (csrc/ring.cu: the chunks, every place's allocation as mapped here, the inbox row's bytes)
            host = np.array([v for b in bounds for v in b] + self.peers + [self.oneshot], np.int64)
        else:
            way = None if own is None else (comm.position, own)  # (this rank's chunk: its ring place)
            host = step_table(steps, bounds, in_place, result_chunks, ctx.wide, way)
        if device.stream.is_capturing():  # no copy may join a capture: on a stream of its own, waited for
            with on_stream(self.setup):
                table = self.cupy.asarray(host)
            self.setup.synchronize()
        else:
            with on_stream(device.stream):
                table = self.cupy.asarray(host)
        k = kernel("ring.cu", f"ringcomm_ring_{_OP_NAME[op] if op is not None else 'sum'}_{SUFFIX[dtype]}")
        head = (np.uint64(table.data.ptr), np.int32(-1 if one_shot else len(steps)), np.int32(len(bounds)))
        count = bounds[-1][1] if bounds else 0
        sig = signature(ctx.collective, dtype, op, ctx.root, ctx.wide, one_shot)
        tail = self._ring_args(sig, count, comm.timeout)
        tail += (np.int32(op is AVG and dtype in FLOAT_DTYPES), np.float64(comm.size))
        if one_shot:  # (to every other rank)
            sent = (comm.size - 1) * count * dtype.itemsize
        else:
            sent = sum(
                (bounds[st.send][1] - bounds[st.send][0]) * dtype.itemsize for st in steps if st.send is not None
            )
        call = self.calls[key] = (steps, k, head, tail, sent, table)
        if len(self.calls) > CALLS:  # its table kept until the kernels that may read it are done
            gone = self.calls.popitem(last=False)[1][-1]
            if id(gone) not in self.captured:
                device.retire(gone, self.last)
        return call

    def failure(self) -> BaseException | None:
        """The error a kernel recorded, as the exception to raise (None while there is none)."""
        if int(self.err[0]) != 2:
            return None
        e = [int(v) for v in self.err]
        kind, origin, call, step, peer_side, expected, observed, channel = e[1:9]
        comm = self.comm
        header = step == (1 << 64) - 1  # the call's first piece, before step 0
        step_no = 0 if header else step
        at = "the call's header, before step 0" if header else f"step {step}"
        peer = comm.left if peer_side == 0 else comm.right
        waited = "a piece from" if peer_side == 0 else "a free FIFO slot at"
        if 2 <= peer_side < 2 + 2 * ONESHOT_MAX_RANKS:  # (csrc/ring.cu's oneshot_block: 2 + 2q, 3 + 2q)
            at, peer = "the one-shot exchange", comm.ring[(peer_side - 2) // 2]
            waited = "the data of" if peer_side % 2 == 0 else "the end of the last one-shot call in its inbox at"
        collective = _CODE_NAMES.get(e[12] & 0xFF, "collective")
        if kind == MISMATCH:
            theirs = e[9:12]
            return MismatchError(
                f"{collective} (ring kernel call {call}, at step 0: the call's header from rank {comm.left}): "
                f"rank {comm.left} made {describe(theirs[1], theirs[2])} "
                f"as its call {theirs[0]}, rank {comm.rank} {describe(e[12], e[13])} as its call {call}; the ranks "
                "did not make the same call"
            )
        what = f"ring kernel call {call}, channel {channel}, at {at}: {waited} rank {peer}"
        what += f", counter {observed} of {expected}"
        if kind == ABORTED and origin - 1 != comm.position:
            origin_rank = comm.ring[origin - 1]
            return AbortError(
                collective, step_no, comm.rank, peer, origin_rank, f"a failure in the ring kernel ({what})"
            )
        return TimeoutError(collective, step_no, comm.rank, peer, comm.timeout, what)

    def close(self) -> None:
        """Wait for the kernels queued (each ends within the deadline; the wait has it too), close the
        neighbours' mappings, and free the allocation once both neighbours have closed theirs
        (collective). On an aborted communicator nothing waits (a neighbour may be gone): the
        mappings and the allocation stay for the process's life, as IPC's pins do."""
        _open.discard(self)
        comm, rt = self.comm, self.cupy.cuda.runtime
        if comm._aborted:
            self._opened.clear()
            return
        ctx = Context("closing the ring executor", comm, comm._host, np.dtype(np.uint8), None)
        if self.last is not None:  # (under the deadline too: a kernel that never started does not end)
            last = self.last.event
            try:
                wait_until(lambda: last.done, ctx, None, comm.left, "this rank's last ring kernel")
            except BaseException:
                self._opened.clear()  # the mappings and the allocation stay: the kernel may still run
                raise
        for ptr in self._opened:
            rt.ipcCloseMemHandle(ptr)
        self._opened.clear()
        try:
            wait([comm.mpi.Ibarrier()], ctx, None, comm.left, "every rank's ring executor closed")
        except BaseException:
            abandon(None, self.memory)  # a neighbour may still map it
            raise
        finally:
            _mapped_by_peers.remove(self.memory)
        self.memory = None


#: the header word's codes of ops and dtypes (1 + the place here; 0: no op)
_OPS = tuple(dict.fromkeys(OPS.values()))
_DTYPES = tuple(SUFFIX)


def signature(collective: str, dtype: np.dtype, op: Any, root: int, wide: bool = False, one_shot: bool = False) -> int:
    """The call's header word: collective, dtype, op, root, accumulate="float32" (``wide``: its
    partial sums travel in float32) and one-shot (ranks that chose differently, e.g. with different
    RINGCOMM_ONESHOT_BYTES, mismatch), which csrc/ring.cu compares."""
    return (
        COLLECTIVE_CODES[collective]
        | ((1 + _DTYPES.index(np.dtype(dtype))) << 8)
        | ((0 if op is None else 1 + _OPS.index(op)) << 16)
        | ((root + 1) << 24)
        | (int(wide) << 40)
        | (int(one_shot) << 41)
    )


def describe(sig: int, count: int) -> str:
    """A header word and count for people: "all_reduce of 1000 float32 (sum), root -1"."""
    code, dt, op, root = sig & 0xFF, (sig >> 8) & 0xFF, (sig >> 16) & 0xFF, ((sig >> 24) & 0xFFFF) - 1
    dtype = _DTYPES[dt - 1] if 0 < dt <= len(_DTYPES) else f"dtype #{dt}"
    what = f"{_CODE_NAMES.get(code, f'collective #{code}')} of {count} {dtype}"
    if op:
        what += f" ({_OPS[op - 1]}{', accumulate=float32' if sig >> 40 & 1 else ''})"
    what += " one-shot" if sig >> 41 & 1 else ""
    return what + (f", root {root}" if root >= 0 else "")
