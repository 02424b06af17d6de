"""ipc-stream: CUDA IPC with the ring's step handshake on the GPU's streams, not on the host.

Like ``ipc`` (transports/ipc.py, whose set-up it shares: buffers exported and mapped once per call
over MPI, a reply from the right, a fallback to staging per edge), but no step waits on the host and
no step sends an MPI message: the call queues all its steps and returns, and the result is ready
when the stream reaches it, as NCCL's calls are.

The handshake (DESIGN.md's two hazards), with CUDA stream memory operations (``cuStreamWaitValue32``
and ``cuStreamWriteValue32``, CUDA driver API, through NVIDIA's cuda-bindings): every sending half
owns a small flag buffer (cudaMalloc, exported beside its buffers, mapped by the right) with two
32-bit counters, READY (written by the sender) and DONE (written by the right). Both ends count the
chunks of the edge alike (the n-th non-empty chunk sent is the n-th received):

- read-after-write: after the kernels that produced its n-th chunk, the sender writes READY = n;
  the right's step that reads it first waits for READY >= n.
- write-after-read: after its kernel that read chunk n, the right writes DONE = n into the
  sender's flags; before the sender's stream overwrites anything it announced (a step's kernel that
  writes its buffer, a copy into its scratch, and every later use of the buffers once the call
  returns: the call's end) it waits for DONE >= the last n announced.

Every write goes on the communicator's signal stream, after an event of the caller's stream (the
work it signals): calls may come on different streams, and an edge's counter must grow in the
order of the calls. Where each chunk lies (buffer, offset, length) is known at the start of the call
(``engine.bind``): the sender sends the whole table with its handles, and the right checks every
size against its own schedule on the host before it queues anything. (The left's call may then
already be queued: its stream waits until its watchdog releases it; its next call sees the abort.)
``Communicator.close()`` first waits, on the host and within the timeout, until every queued wait and
counter write has completed, and only then closes the mappings. Counters compare cyclically (CU_STREAM_WAIT_VALUE_GEQ is
``(int32_t)(*addr - value) >= 0``), so they never need resetting.

No kernel spins: a wait lives in a stream's front end, not on an SM, so ranks may share one GPU
without MPS. CUDA's driver API warns that these operations can deadlock when misused: the order they
create is invisible to CUDA's scheduler, so "CUDA tasks that are (even indirectly) ordered by these
APIs should also have that order expressed with CUDA-visible dependencies such as events". So every
wait is queued on a stream of the communicator's own (:class:`Handshake`), an event is recorded
after it, and the caller's stream waits on that event: the kernels that depend on a wait are
ordered by an event CUDA knows, and the caller's stream itself never holds a value wait (other
work queued on it by the user is not stuck behind the memory operation in the stream's hardware
queue). Streams of one process are aliased onto CUDA_DEVICE_MAX_CONNECTIONS hardware work queues
(8 by default, fewer per client under MPS), round robin as they are made; work on streams of one
work queue runs in the order it was queued, so a wait delays unrelated streams of its work queue,
never the writes it waits for (those are on the neighbour's streams, in another process; this
process's own writes are queued in the ring's order, before the waits that depend on them). The
one write queued out of that order is the watchdog's release (below), and it takes effect only if
its stream's work queue holds nothing that waits for the stuck wait: not the wait stream (the
release stream is made right after it, so they share a work queue only when there is one:
CUDA_DEVICE_MAX_CONNECTIONS=1, warned about), but a caller's stream (which waits on the wait
stream's events) may share it. With few work queues (MPS) a release may then not take effect: the
TimeoutError is still raised and close() still returns within its timeout, but the caller's stream
stays held (counters in host memory, which the watchdog could store to, would lift this). Contexts
of several processes on one GPU are time-sliced: a context whose streams all wait yields the GPU.

Deadlines: a stuck peer cannot be seen by a host wait, so a watchdog thread (one per communicator,
:class:`Handshake`) follows an event recorded after every wait. When the oldest pending wait has not
completed within the communicator's timeout (counted from when it was queued or, if later, from the
completion of the wait before it), it releases every pending wait (writes the values they wait for
into the flags, from a stream of its own), and records a :class:`ringcomm.TimeoutError` naming the
collective, step and peer. The communicator is then aborted: the next call, or
``Communicator.check_errors()``, raises it. The results of that call and of the calls queued after
it are undefined (their kernels ran on whatever the buffers held); the streams are not hung.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import MismatchError, TimeoutError
from .ipc import ACC, FLAGS, SCRATCH, SLOTS, SRC, WORK, IpcRecv, IpcSend, _words

log = logging.getLogger("ringcomm")

#: bytes of a sending half's flag buffer, and the byte offsets of its two counters in it
FLAG_BYTES = 256
READY, DONE = 0, 4
_MASK = 0xFFFFFFFF
_ENGINE_SLOT = {0: SRC, 1: WORK, 2: ACC}  # engine.SRC/WORK/ACC -> the descriptor's slot


class StreamOps:
    """cuStreamWaitValue32 / cuStreamWriteValue32 through cuda-bindings (``cuda.bindings.driver``)."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self.cu = driver
        self.GEQ = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self.DEFAULT = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT

    def _check(self, call: str, result: Any) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            ok, name = self.cu.cuGetErrorName(err)
            raise RuntimeError(f"{call} returned {name.decode() if int(ok) == 0 and name else int(err)}")

    def wait(self, stream: Any, addr: int, value: int) -> None:
        """Queue on ``stream``: wait until the counter at ``addr`` reaches ``value`` (cyclically)."""
        self._check(
            "cuStreamWaitValue32",
            self.cu.cuStreamWaitValue32(
                self.cu.CUstream(stream.ptr), self.cu.CUdeviceptr(addr), value & _MASK, self.GEQ
            ),
        )

    def write(self, stream: Any, addr: int, value: int) -> None:
        """Queue on ``stream``: write ``value`` at ``addr`` once the work queued before it completed."""
        self._check(
            "cuStreamWriteValue32",
            self.cu.cuStreamWriteValue32(
                self.cu.CUstream(stream.ptr), self.cu.CUdeviceptr(addr), value & _MASK, self.DEFAULT
            ),
        )


_support: dict[int, str] = {}


def unsupported(device_id: int) -> str:
    """Why this process's device ``device_id`` cannot run ipc-stream ("" when it can).

    CUDA's V2 stream memory operations are available by default on every platform since CUDA 11.7
    (the V1 ones needed the NVreg_EnableStreamMemOPs driver parameter and said so in
    CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS); so the answer is a probe: a write and a wait on a
    word of device memory, on a stream of its own. Cached per device.
    """
    if device_id in _support:
        return _support[device_id]
    why = ""
    try:
        import cupy

        ops = StreamOps()
        with cupy.cuda.Device(device_id):
            word = cupy.zeros(1, np.uint32)
            stream = cupy.cuda.Stream(non_blocking=True)
            cupy.cuda.get_current_stream().synchronize()
            ops.write(stream, word.data.ptr, 1)
            ops.wait(stream, word.data.ptr, 1)
            stream.synchronize()
            if int(word.get()[0]) != 1:
                why = "a stream's write of a counter did not land"
    except Exception as e:  # noqa: BLE001 - any failure: not usable here
        why = f"CUDA stream memory operations are not usable on device {device_id}: {e}"
    _support[device_id] = why
    return why


class _Wait:
    __slots__ = ("event", "collective", "call", "step", "peer", "addr", "value", "queued", "what")

    def __init__(self, event: Any, ctx: Any, step: int | None, peer: int, addr: int, value: int, what: str) -> None:
        self.event, self.collective, self.call, self.step, self.peer = event, ctx.collective, ctx.call, step, peer
        self.addr, self.value, self.queued, self.what = addr, value, time.monotonic(), what


class Handshake:
    """A communicator's waits on the GPU: its own wait stream, the events from it to the callers'
    streams, and the watchdog thread that follows them (see the module doc)."""

    def __init__(self, comm: Any, device_id: int) -> None:
        import cupy

        self.comm, self.device_id, self.ops = comm, device_id, StreamOps()
        with cupy.cuda.Device(device_id):  # the release stream right after the wait stream (module doc)
            self.wait_stream = cupy.cuda.Stream(non_blocking=True)
            self._release_stream = cupy.cuda.Stream(non_blocking=True)
            self.signal_stream = cupy.cuda.Stream(non_blocking=True)
            self._signalled = cupy.cuda.Event(block=False, disable_timing=True)
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1":
            warnings.warn(
                "ringcomm ipc-stream: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of this process on "
                "one work queue: a stuck neighbour's TimeoutError is still raised, but the watchdog cannot "
                "release this rank's streams (they stay held)",
                RuntimeWarning,
                stacklevel=2,
            )
        self._cupy = cupy
        self._pending: collections.deque[_Wait] = collections.deque()
        self._free: list = []  # completed events, to reuse
        self._lock = threading.Lock()
        self._since: float | None = None  # when the watchdog last saw a wait complete
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"ringcomm-watchdog-{comm.rank}", daemon=True)
        self._thread.start()

    def wait(self, ctx: Any, caller: Any, addr: int, value: int, step: int | None, peer: int, what: str) -> None:
        """Order ``caller``'s later work after the counter at ``addr`` reaches ``value``, through
        the wait stream and an event (never a value wait on the caller's stream itself)."""
        with self._lock:
            event = self._free.pop() if self._free else None
        if event is None:
            with self._cupy.cuda.Device(self.device_id):
                event = self._cupy.cuda.Event(block=False, disable_timing=True)
        self.ops.wait(self.wait_stream, addr, value)
        event.record(self.wait_stream)
        caller.wait_event(event)
        with self._lock:
            self._pending.append(_Wait(event, ctx, step, peer, addr, value, what))

    def signal(self, caller: Any, addr: int, value: int) -> None:
        """Write ``value`` at ``addr`` once the work queued on ``caller`` so far completed.

        The write goes on the signal stream, after an event of ``caller``: the counters of an edge
        must grow in the order of the calls, and calls may come on different streams with no
        order between them (a later call's write on another stream must not overtake an earlier
        call's: the neighbour's wait for the earlier value would pass before its chunk is there).
        One event serves every signal: a stream's wait on an event takes the event's last record
        at the time of the wait, so recording it again later changes nothing queued."""
        self._signalled.record(caller)
        self.signal_stream.wait_event(self._signalled)
        self.ops.write(self.signal_stream, addr, value)

    def _watch(self) -> None:
        interval = min(0.05, max(0.001, self.comm.timeout / 20))
        failed = None
        self._cupy.cuda.Device(self.device_id).use()  # a new thread: driver calls need the context current
        while not self._stop.wait(interval):
            try:
                self._check()
            except Exception as e:  # noqa: BLE001 - the watchdog must not die silently (said once per error)
                if str(e) != failed:
                    failed = str(e)
                    log.warning("ringcomm: the ipc-stream watchdog on rank %d failed: %s", self.comm.rank, e)

    def _check(self) -> None:
        now = time.monotonic()
        with self._lock:
            while self._pending and self._pending[0].event.done:
                self._free.append(self._pending.popleft().event)
                self._since = now
            if not self._pending:
                return
            head = self._pending[0]
            if now - max(head.queued, self._since or head.queued) <= self.comm.timeout:
                return
            stuck = list(self._pending)
        release: dict[int, int] = {}
        for w in stuck:  # the value every pending wait on an address waits for (they only grow)
            release[w.addr] = max(release.get(w.addr, w.value), w.value)
        for addr, value in release.items():
            self.ops.write(self._release_stream, addr, value)
        error = TimeoutError(
            head.collective,
            head.step,
            self.comm.rank,
            head.peer,
            self.comm.timeout,
            f"{head.what} (ipc-stream watchdog: call {head.call}'s wait on the GPU was "
            "released; the results of that call and of those queued after it are undefined)",
        )
        log.error("ringcomm: %s", error)
        if self.comm._late_error is None:
            self.comm._late_error = error
        with self._lock:
            self._since = time.monotonic()

    def drain(self, comm: Any) -> bool:
        """Wait on the host (within the timeout) until every wait and counter write queued so far
        has completed: then no queued kernel reads a neighbour's mapping and no write into one is
        pending, so the mappings may be closed. False when they did not complete in time."""
        from ..devices import HostDevice
        from ..engine import Context
        from .staged import wait_event

        ctx = Context("Communicator.close()", comm, HostDevice(), np.dtype(np.uint8), None)
        try:
            for stream in (self.wait_stream, self.signal_stream):
                with self._cupy.cuda.Device(self.device_id):
                    done = self._cupy.cuda.Event(block=False, disable_timing=True)
                    done.record(stream)
                wait_event(done, ctx, None, comm.rank, "the GPU to finish this communicator's ipc-stream steps")
        except Exception as e:  # noqa: BLE001 - a stuck peer: the mappings must stay
            log.warning(
                "ringcomm: rank %d closes with ipc-stream work still queued (%s); its CUDA IPC mappings "
                "and exported memory stay for the life of the process",
                comm.rank,
                e,
            )
            return False
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def handshake(comm: Any, device_id: int) -> Handshake:
    """The communicator's Handshake for ``device_id`` (made on first use)."""
    hs = comm._handshakes.get(device_id)
    if hs is None:
        hs = comm._handshakes[device_id] = Handshake(comm, device_id)
    return hs


class IpcStreamSend(IpcSend):
    """The sending half: exports its buffers and its flag buffer with the table of where each
    chunk lies; per step only stream operations: READY after the chunk's producers, and a wait for
    DONE before it overwrites what it announced."""

    name = "ipc-stream"

    def __init__(self, comm: Any) -> None:
        self._table_rows = max(16, 12 * comm.size)  # as many steps as the ring schedules take
        super().__init__(comm)
        self._flags = None  # this half's flag buffer (cupy.cuda.Memory), made once
        self._announced = 0  # chunks announced on this edge (READY's value), over all calls
        self._awaited = (None, 0)  # (stream, DONE value) that stream already waits for

    def _desc_rows(self) -> int:
        return len(SLOTS) + self._table_rows

    def begin(self, ctx: Any, work: Any, src: Any, bounds: Any) -> None:
        if self.fallback is None and self.comm.size > 1:
            self._hs = handshake(self.comm, ctx.device.device_id)
        return super().begin(ctx, work, src, bounds)

    def _describe(self, work: Any, src: Any, acc: Any) -> None:
        super()._describe(work, src, acc)
        cp = self._cupy
        if self._flags is None:
            self._flags = cp.cuda.Memory(FLAG_BYTES)
            cp.ndarray((FLAG_BYTES,), np.uint8, cp.cuda.MemoryPointer(self._flags, 0)).fill(0)
            cp.cuda.get_current_stream().synchronize()  # zero before the right may read it (once)
            self._flags_handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self._flags.ptr))
            self._flags_words = _words(self._flags_handle)
        self._pins[self._flags_handle] = self._flags
        self._fill(FLAGS, self._flags_words, 0, FLAG_BYTES, FLAG_BYTES)
        # where each step's chunk lies: step, slot, byte offset in the slot's array, bytes
        table = self._desc_out[len(SLOTS) :, :4]
        table[:] = -1
        steps, bound = self.ctx.sends
        arrays = (src, work, acc)
        row = 0
        for st, (send_from, _, _) in zip(steps, bound):
            if send_from is None:
                continue
            a = arrays[send_from]
            lo, hi = self._bounds[st.send]
            if hi == lo:
                continue
            if row >= len(table):
                raise RuntimeError(f"ipc-stream: more chunks than the {len(table)} rows of its table")
            table[row] = (st.index, self._slot_of[_ENGINE_SLOT[send_from]], lo * a.itemsize, (hi - lo) * a.itemsize)
            row += 1

    def _post(self, step: Any, send: Any, writes: bool) -> None:
        stream = self.stream
        if send is not None and send.size:
            slot, offset = self._locate(send)
            if slot == SCRATCH:  # a write into the scratch: its earlier readers must be done
                self._wait_read(step.index)
                self.device.copy(self._scratch[offset : offset + send.nbytes], send.view(np.uint8))
            self._announced += 1
            self._hs.signal(stream, self._flags.ptr + READY, self._announced)  # after the chunk's producers
        if writes:  # this step's kernel writes this rank's buffer: what the right reads must be read
            self._wait_read(step.index, before=self._announced - (send is not None and send.size > 0))
        return None

    def _wait_read(self, step: int | None, before: int | None = None) -> None:
        """Order the stream after the right's DONE reaches ``before`` (default: every chunk
        announced so far)."""
        want = self._announced if before is None else before
        stream, awaited = self._awaited
        # a wait queued for another stream (an earlier call's) orders nothing here: calls may come
        # on streams with no order between them, and this half's scratch is reused across calls
        if want > awaited or (want and stream is not self.stream):
            self._hs.wait(
                self.ctx,
                self.stream,
                self._flags.ptr + DONE,
                want,
                step,
                self.comm.right,
                "the right neighbour to finish reading this rank's chunks (ipc-stream, on the GPU)",
            )
            self._awaited = (self.stream, want)

    def end(self) -> None:
        if self._active and self._connect(None):
            self._wait_read(None)  # later work on the stream may overwrite the buffers the right reads
        if self.fallback is not None:
            self.fallback.end()
        self._clear()
        self._work = self._src = self._acc = None


class IpcStreamRecv(IpcRecv):
    """The receiving half: maps the left's buffers and flags; per step a wait for the left's READY
    before its kernel reads the chunk, and DONE written into the left's flags after it."""

    name = "ipc-stream"

    def __init__(self, comm: Any) -> None:
        self._table_rows = max(16, 12 * comm.size)
        super().__init__(comm)
        self._received = 0  # chunks received on this edge, over all calls
        self._where: dict[int, tuple[int, int, int]] = {}  # step -> (slot, byte offset, bytes) of its chunk
        self._where_of: bytes | None = None  # the descriptor _where was read from

    def _desc_rows(self) -> int:
        return len(SLOTS) + self._table_rows

    def begin(self, ctx: Any, work: Any, src: Any, bounds: Any) -> None:
        if self.fallback is None and self.comm.size > 1:
            self._hs = handshake(self.comm, ctx.device.device_id)
        super().begin(ctx, work, src, bounds)
        if self.fallback is None and self._active:
            from ..devices.cuda import pointer

            flags = self._peer[FLAGS]
            if flags is None:
                raise MismatchError(
                    f"{ctx.collective} call {ctx.call}: rank {self.comm.left} sent no ipc-stream "
                    f"flags to rank {self.comm.rank}: the ranks disagree on the transport"
                )
            self._left_flags = pointer(flags)
            if self._where_of is not self._opened:  # (the same descriptor as the last call's: the same table)
                table = self._desc_in[len(SLOTS) :, :4].tolist()
                self._where = {r[0]: (r[1], r[2], r[3]) for r in table if r[0] >= 0}
                self._where_of = self._opened
            self._check_sizes(ctx, bounds)

    def _check_sizes(self, ctx: Any, bounds: Any) -> None:
        """Every chunk this call will read, against what the left said it will send (before
        anything is queued: a mismatch found at step k would leave steps 0..k-1 on the GPU)."""
        acc = ctx.acc
        steps, _ = ctx.sends
        for st in steps:
            if st.recv is None:
                continue
            lo, hi = bounds[st.recv]
            want = (hi - lo) * (acc.itemsize if acc is not None and st.reduce else ctx.dtype.itemsize)
            got = self._where.get(st.index, (-1, 0, 0))[2]
            if want and got != want:
                raise MismatchError(
                    f"{ctx.collective} call {ctx.call}: rank {self.comm.rank} expects {want} bytes of chunk "
                    f"{st.recv} from rank {self.comm.left} at step {st.index}, and rank {self.comm.left} will send "
                    f"{got} bytes at that step: the ranks disagree on the count or the dtype"
                )

    def post(self, step: Any, recv_count: int, recv_into: Any, recv_dtype: Any) -> None:
        if self.fallback is not None:
            return self.fallback.post(step, recv_count, recv_into, recv_dtype)
        self._incoming = (recv_count, np.dtype(recv_dtype)) if recv_count else None
        return None

    def _recv(self, step: Any, sender: Any) -> Iterator[tuple[int, int, Any]]:
        count, dtype = self._incoming
        slot, offset, nbytes = self._where.get(step.index, (-1, 0, 0))
        want = count * dtype.itemsize
        view = self._chunk(slot, offset, nbytes, dtype) if nbytes == want else None
        if nbytes != want or view is None:
            raise MismatchError(
                f"{self.ctx.collective} call {self.ctx.call}: rank {self.comm.rank} expected {want} bytes of chunk "
                f"{step.recv} from rank {self.comm.left} at step {step.index}, and rank {self.comm.left} announced "
                f"{nbytes} bytes for that step: the ranks disagree on the count or the dtype"
            )
        sender.pump(step, 0)
        self._received += 1
        self._hs.wait(
            self.ctx,
            self.stream,
            self._left_flags + READY,
            self._received,
            step.index,
            self.comm.left,
            f"chunk {step.recv} from the left (ipc-stream, on the GPU)",
        )
        self._reading = True
        yield 0, count, view

    def step_done(self, step: Any) -> None:
        if self.fallback is not None:
            return self.fallback.step_done(step)
        if self._reading:  # after the kernel that read the left's chunk
            self._hs.signal(self.stream, self._left_flags + DONE, self._received)
            self._reading = False
        return None

    def abort(self) -> None:
        if self.fallback is not None:
            return self.fallback.abort()
        self._incoming = None
        return super().abort()
