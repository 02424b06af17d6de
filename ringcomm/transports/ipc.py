"""CUDA IPC transport: ranks on one node read the left neighbour's chunk straight from its memory.

Each rank exports the allocations that hold its ``src`` and ``work`` arrays (``cudaIpcGetMemHandle``
on the allocation's base; the array's offset inside it travels beside the handle, since CuPy's pool
sub-allocates large blocks) and sends the handles to its right neighbour at the start of every
collective. A handle is opened once and the mapping cached, keyed by the handle's bytes. A step is
then one kernel: the reduce (or copy) kernel reads the incoming chunk from the mapped memory.
Memory that cannot be exported (stream-ordered or virtual-memory allocations) is sent through a
registered scratch buffer of this rank, allocated once with cudaMalloc: one local copy per chunk sent.

The step handshake (DESIGN.md), with small MPI messages between neighbours and host-side event
waits; no kernel ever waits on a flag, so ranks that share one GPU cannot deadlock:

- read-after-write, from the left: before announcing the chunk it sends at step k ("ready": which
  buffer, offset, length), a rank waits for an event recorded after everything its stream queued
  so far, the kernels that produced the chunk included. The right reads only after "ready".
- write-after-read, from the right: a rank that reads its left's chunk waits for an event after its
  reading kernel and then sends "read done". Before a rank writes at step k (its reduce or copy
  kernel, or a copy into its scratch buffer) it has "read done" for every chunk it announced at
  the steps before k; and ``end()`` waits for all of them, so when a collective returns the
  neighbours no longer read this rank's memory.

Lifetime of exported memory: CUDA leaves freeing an allocation that another process still maps
undefined, and CuPy's pool frees cached blocks on its own (``free_all_blocks()``, and before
retrying an allocation that ran out of memory). So every allocation a rank exports stays pinned
(a reference to the array it was exported for keeps the pool from freeing it) until its right
neighbour reports the mapping closed: in its reply to every collective's handles the right lists
those it closed since the last one (mappings evicted from its cache beyond MAX_MAPPINGS, least recently
used first), and at ``close()`` it closes all of them and says so before its left drops any pin.
This holds device memory: at most MAX_MAPPINGS allocations per neighbour that the user has
already dropped, until they are evicted or the communicator is closed.

Halves: :class:`IpcSend` is this rank's end of the edge to its right (it exports, announces and
waits for "read done"), :class:`IpcRecv` its end of the edge from its left (it maps, reads and
says "read done"). The sending half sends its handles at ``begin`` and reads the right's reply at
its first step, so no rank waits in ``begin`` on a neighbour that is still sending its own.

Set-up failures (an export or an open fails): the receiving half's reply says so, and both ends of
that edge switch to the staged transport's halves, with a warning, for this collective and the
ones after it; the ring's other edges keep theirs. The driver queries CuPy does not wrap
(cuMemGetAddressRange, cuPointerGetAttribute) go through NVIDIA's cuda-bindings,
with the array's device made current first; a failing query is logged once.
"""

from __future__ import annotations

import collections
import logging
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import tags
from ..errors import MismatchError, RingcommError
from .base import abandon, cancel, wait
from .staged import EventPool, StagedRecv, StagedSend, wait_event

log = logging.getLogger("ringcomm")

SRC, WORK, SCRATCH, ACC = 0, 1, 2, 3  # ACC: the float32 partial sums (accumulate="float32")
SLOTS = (SRC, WORK, SCRATCH, ACC)
#: descriptor words per buffer slot: state, offset in allocation, nbytes, allocation size, 8 words of handle
_DESC = 12
_UNUSED, _VALID, _FAILED = 0, 1, -1
#: smallest registered scratch buffer (it grows by doubling, and old ones stay allocated)
SCRATCH_MIN_BYTES = 1 << 20
#: opened neighbour allocations kept mapped (least recently used ones are closed beyond this)
MAX_MAPPINGS = 64

#: handle slots in one reply (more wait for the next collective)
RELEASE_SLOTS = 8
#: words of the receiving half's reply: state, count of released handles, closing flag, handles
REPLY_WORDS = 3 + 8 * RELEASE_SLOTS


class _Driver:
    """The CUDA driver queries CuPy does not wrap, through NVIDIA's cuda-bindings (``cuda.bindings.driver``).

    A failing call is logged once per function and CUDA result (at WARNING), with the result's name.
    """

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise RuntimeError(
                "CUDA IPC needs NVIDIA's cuda-bindings (cuda.bindings.driver) for cuMemGetAddressRange and "
                f"cuPointerGetAttribute: pip install 'ringcomm[cuda]' ({e})"
            ) from e
        self.cu = driver
        attr = driver.CUpointer_attribute
        self.BUFFER_ID = attr.CU_POINTER_ATTRIBUTE_BUFFER_ID
        self.IPC_CAPABLE = attr.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
        self._logged: set[tuple[str, int]] = set()

    def _failed(self, call: str, err: Any, ptr: int) -> str:
        """Describe (and log, the first time for this call and result) a CUresult other than success."""
        code = int(err)
        ok, name = self.cu.cuGetErrorName(err)
        text = f"{call}({ptr:#x}) returned {name.decode() if int(ok) == 0 and name else code}"
        if (call, code) not in self._logged:
            self._logged.add((call, code))
            log.warning("ringcomm: %s (logged once); CUDA IPC of this buffer goes through the scratch buffer", text)
        return text

    def allocation(self, ptr: int) -> tuple[int, int]:
        """(base address, size) of the allocation that contains device address ``ptr``."""
        err, base, size = self.cu.cuMemGetAddressRange(ptr)
        if int(err) != 0:
            raise RuntimeError(self._failed("cuMemGetAddressRange", err, ptr))
        return int(base), int(size)

    def attribute(self, ptr: int, attr: Any) -> int | None:
        """The pointer attribute ``attr`` of ``ptr`` as an int, None when the query fails."""
        err, value = self.cu.cuPointerGetAttribute(attr, ptr)
        if int(err) != 0:
            self._failed(f"cuPointerGetAttribute({attr.name})", err, ptr)
            return None
        return int(value)


_driver: _Driver | None = None


class _Mapping:
    """A neighbour's allocation opened in this process, and the transports that use it."""

    __slots__ = ("whole", "owners")

    def __init__(self, whole: Any) -> None:
        self.whole = whole
        self.owners: set = set()


#: neighbour allocations opened by this process, keyed by handle bytes, shared by every transport
#: (one mapping per handle: CUDA counts a repeated open of a handle, each needing its own close);
#: least recently used beyond MAX_MAPPINGS are closed
_mapped: collections.OrderedDict[bytes, _Mapping] = collections.OrderedDict()
_mapped_lock = threading.Lock()


def _words(handle: bytes) -> np.ndarray:
    """A handle (64 bytes, padded) as the 8 int64 words it takes in a message."""
    return np.frombuffer(handle.ljust(64, b"\0")[:64], np.int64)


def _get_driver() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def _warn_fallback(comm: Any, why: str) -> None:
    msg = f"ringcomm: CUDA IPC unavailable on rank {comm.rank} ({why}); this edge uses the staged transport"
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
    log.warning(msg)


def _close_tag(comm: Any) -> int:
    """The tag of the closing handshake's messages: after the last collective (a neighbour still
    in it waits on)."""
    return comm._layout.base("close", np.dtype(np.uint8), None, -1, comm._calls + 1) | tags.RELEASED


def _close_context(comm: Any) -> Any:
    from ..devices import HostDevice
    from ..engine import Context

    ctx = Context("Communicator.close()", comm, HostDevice(), np.dtype(np.uint8), None)
    ctx.call, ctx.tag = comm._calls + 1, _close_tag(comm)
    ctx.expect = (ctx.tag,)
    return ctx


class _IpcHalf:
    """What both IPC halves share: binding a call."""

    def _start(self, ctx: Any) -> bool:
        """Bind the call; False when there is nothing to do (one rank)."""
        self.ctx, self.device = ctx, ctx.device
        self._clear()
        self._active = self.comm.size > 1
        if not self._active:
            return False
        import cupy

        self._cupy, self._began = cupy, True
        self.stream = self.device.stream
        return True


class IpcSend(_IpcHalf):
    """The sending half: exports this rank's buffers to the right neighbour, announces each chunk
    it may read ("ready") and waits for its "read done" before this rank overwrites it."""

    name = "ipc"

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.fallback: StagedSend | None = None  # set, on both ends of the edge, once its set-up failed
        # allocation buffer id -> handle, and handle -> what keeps the allocation alive (the array or
        # scratch Memory it was exported for) until the right has closed its mapping
        self._handle_of: dict[int, bytes] = {}
        self._pins: dict[bytes, Any] = {}
        # device address -> (handle, its message words, allocation base, allocation size) of an
        # allocation pinned ever since (dropped when it is unpinned): a pinned allocation cannot be
        # freed, so the address still lies in it (a call on the last call's arrays queries nothing)
        self._exports: dict[int, tuple[bytes, np.ndarray, int, int]] = {}
        self._scratch = None  # registered send scratch (cudaMalloc), grown when needed
        self._began = False  # some collective ran: close() agrees the unmapping with the right
        cap = max(16, 12 * comm.size)
        self._ready_out = np.zeros((cap, 4), np.int64)  # step, slot, byte offset, nbytes
        self._done_in = np.zeros((cap, 1), np.int64)
        self._desc_out = np.zeros((len(SLOTS), _DESC), np.int64)
        self._reply_in = np.zeros(REPLY_WORDS, np.int64)
        self._events = EventPool()
        self._active = False
        self._setup: list = []  # this call's handle message to the right, and the right's reply
        self._clear()

    def _clear(self) -> None:
        self._seq = 0
        self._done_pending: list = []  # (step index, request) "read done" expected from the right
        self._sends: list = []  # Isend requests of "ready" messages
        self._events.reset()

    def begin(self, ctx: Any, work: Any, src: Any, bounds: Any) -> None:
        """Export src, work and the partial sums, and send their handles to the right; the right's
        reply (mapped or not, and what it closed) is awaited at the first step, so that no rank
        waits here for a neighbour that is still sending its own handles."""
        if self.fallback is not None:
            return self.fallback.begin(ctx, work, src, bounds)
        if not self._start(ctx):
            return None
        cupy = self._cupy
        self._work, self._src, self._acc, self._bounds = work, src, ctx.acc, bounds
        base = ctx.identity()
        t_handles, self._t_ready, self._t_done, t_reply = (
            base | tags.HANDLES,
            base | tags.READY,
            base | tags.DONE,
            base | tags.RELEASED,
        )
        ctx.expect += (self._t_done, t_reply)
        self._problem = ""
        try:
            with cupy.cuda.Device(self.device.device_id):
                # the driver calls need the device's context current on this thread: cudaSetDevice makes
                # it so (CUDA 12+); CuPy's Device makes no call when the device is current already
                cupy.cuda.runtime.setDevice(self.device.device_id)
                self._describe(work, src, ctx.acc)
        except Exception as e:  # noqa: BLE001 - any failure means: this edge falls back, on both ends
            self._problem = f"exporting this rank's buffers failed: {e}"
            self._desc_out[:, 0] = _FAILED
        mpi, right = self.comm.mpi, self.comm.right
        self._setup = [mpi.Isend(self._desc_out, right, t_handles), mpi.Irecv(self._reply_in, right, t_reply)]
        return None

    def _connect(self, step: int | None) -> bool:
        """Once per call: wait for the right's reply to the handles. It lists this rank's
        allocations the right closed since the last call (unpinned here, unless described again
        now) and says whether the right mapped the new ones; if not, this edge falls back to
        staging (the right does the same). True while the edge is IPC."""
        if self._setup:
            setup, self._setup = self._setup, []
            wait(
                setup, self.ctx, step, self.comm.right, "rank %d to map this rank's memory (CUDA IPC)", self.comm.right
            )
            self._unpin_released(described=True)
            if self._reply_in[0] != _VALID:
                _warn_fallback(self.comm, self._problem or f"rank {self.comm.right} could not map this rank's memory")
                self.fallback, self.name, self._active = StagedSend(self.comm), "staged", False
                self.fallback.begin(self.ctx, self._work, self._src, self._bounds)
        return self.fallback is None

    def _describe(self, work: Any, src: Any, acc: Any) -> None:
        """Fill the outgoing descriptor: how the right neighbour can map src, work, the partial
        sums (``acc``, or None) and the scratch.

        Every allocation exported is pinned (a reference to the array it was exported for, which
        keeps CuPy's pool from freeing it) until the right reports its mapping closed.
        """
        from ..devices.cuda import pointer

        self._desc_out[:] = 0
        self._slot_of: dict[int, int] = {}
        need_scratch = 0
        for slot, a in ((SRC, src), (WORK, work), (ACC, acc)):
            if a is None or a.nbytes == 0:
                continue
            ptr = pointer(a)
            export = self._exports.get(ptr) or self._export(ptr)
            if export is None:
                need_scratch = max(need_scratch, a.nbytes)
                self._slot_of[slot] = SCRATCH
                continue
            handle, words, base, size = export
            self._pins[handle] = a
            self._fill(slot, words, ptr - base, a.nbytes, size)
            self._slot_of[slot] = slot
        if need_scratch:
            if self._scratch is None or self._scratch.nbytes < need_scratch:
                old = self._scratch.nbytes if self._scratch is not None else 0
                mem = self._cupy.cuda.Memory(max(need_scratch, 2 * old, SCRATCH_MIN_BYTES))
                self._scratch = self._cupy.ndarray((mem.size,), np.uint8, self._cupy.cuda.MemoryPointer(mem, 0))
                self._scratch_handle = bytes(self._cupy.cuda.runtime.ipcGetMemHandle(mem.ptr))
                log.debug("ipc: rank %d exports a %d-byte scratch buffer", self.comm.rank, mem.size)
            self._pins[self._scratch_handle] = self._scratch  # an outgrown one stays until released
            self._fill(SCRATCH, _words(self._scratch_handle), 0, self._scratch.nbytes, self._scratch.nbytes)

    def _export(self, ptr: int) -> tuple[bytes, np.ndarray, int, int] | None:
        """(handle, its words, base, size) of the allocation holding ``ptr`` (driver queries;
        remembered in ``_exports`` while pinned), or None when it cannot be exported (scratch)."""
        drv = _get_driver()
        if not drv.attribute(ptr, drv.IPC_CAPABLE):
            return None
        base, size = drv.allocation(ptr)
        key = drv.attribute(base, drv.BUFFER_ID)  # unique per allocation over the process lifetime
        handle = self._handle_of.get(key) if key is not None else None
        if handle is None:
            handle = bytes(self._cupy.cuda.runtime.ipcGetMemHandle(base))
            if key is not None:
                self._handle_of[key] = handle
        if len(self._exports) >= 4 * MAX_MAPPINGS:  # addresses of arrays gone: start afresh
            self._exports.clear()
        export = self._exports[ptr] = (handle, _words(handle), base, size)
        return export

    def _fill(self, slot: int, words: np.ndarray, offset: int, nbytes: int, alloc: int) -> None:
        row = self._desc_out[slot]
        row[0], row[1], row[2], row[3] = _VALID, offset, nbytes, alloc
        row[4:] = words

    def _unpin_released(self, described: bool = False) -> None:
        """Drop the pins of the allocations the right reports it no longer maps (all of them when
        it is closing), except, when ``described``, those described again in this collective (the
        right opens them anew)."""
        got = self._reply_in
        if got[2]:
            self._pins.clear()
            self._handle_of.clear()
            self._exports.clear()
            return
        if not got[1]:
            return
        released = {got[3 + 8 * i : 11 + 8 * i].tobytes() for i in range(int(got[1]))}
        if described:
            released -= {self._desc_out[slot, 4:].tobytes() for slot in SLOTS}
        for handle in released:
            self._pins.pop(handle, None)
        if released:
            self._handle_of = {k: h for k, h in self._handle_of.items() if h not in released}
            self._exports = {p: e for p, e in self._exports.items() if e[0] not in released}

    def _row(self, table: np.ndarray) -> np.ndarray:
        if self._seq >= table.shape[0]:  # more steps than foreseen: never in the ring schedules
            raise RuntimeError(f"ipc transport: step {self._seq} exceeds its {table.shape[0]} message slots")
        return table[self._seq]

    def post(self, step: Any, send: Any, writes: bool) -> None:
        if self.fallback is not None:
            return self.fallback.post(step, send, writes)
        if not self._active:
            return None
        if not self._connect(step.index):
            return self.fallback.post(step, send, writes)
        return self._post(step, send, writes)

    def _post(self, step: Any, send: Any, writes: bool) -> None:
        """The step's handshake, once the edge is known to be IPC: "ready" for the chunk sent,
        and the right's "read done" for the earlier ones before this rank writes."""
        mpi, right = self.comm.mpi, self.comm.right
        if send is not None and send.size:
            slot, offset = self._locate(send)
            if slot == SCRATCH:  # a write into the scratch: its earlier readers must be done
                self._wait_done_before(step)
                self.device.copy(self._scratch[offset : offset + send.nbytes], send.view(np.uint8))
            ev = self._events.take()
            ev.record(self.stream)  # after the kernels that produced this chunk (and the scratch copy)
            wait_event(ev, self.ctx, step.index, right, "this rank's kernels producing chunk %s", step.send)
            out = self._row(self._ready_out)
            out[:] = (step.index, slot, offset, send.nbytes)
            self._sends.append(mpi.Isend(out, right, self._t_ready))
            self._done_pending.append((step.index, mpi.Irecv(self._row(self._done_in), right, self._t_done)))
        if writes:  # this step's kernel writes this rank's work: earlier readers must be done
            self._wait_done_before(step)
        self._seq += 1
        return None

    def _locate(self, send: Any) -> tuple[int, int]:
        """(slot, byte offset within the slot's array) of the chunk ``send`` (a view of work, src or acc)."""
        from ..devices.cuda import pointer

        p = pointer(send)
        for slot, a in ((WORK, self._work), (SRC, self._src), (ACC, self._acc)):
            if a is None:
                continue
            start = pointer(a)
            if a.nbytes and start <= p and p + send.nbytes <= start + a.nbytes:
                return self._slot_of[slot], p - start
        raise RuntimeError("ipc transport: the chunk to send is neither in work, src nor the partial sums")

    def _wait_done_before(self, step: Any) -> None:
        earlier = [req for index, req in self._done_pending if index < step.index]
        if earlier:
            wait(
                earlier,
                self.ctx,
                step.index,
                self.comm.right,
                "the right neighbour to finish reading this rank's earlier chunks (CUDA IPC)",
            )
            self._done_pending = [(i, r) for i, r in self._done_pending if i >= step.index]

    def pump(self, step: Any, piece: int) -> None:
        if self.fallback is not None:
            self.fallback.pump(step, piece)

    def step_done(self, step: Any) -> None:
        if self.fallback is not None:
            return self.fallback.step_done(step)
        self._events.reset()  # every event used so far has completed
        return None

    def end(self) -> None:
        if self._active and self._connect(None):
            wait(
                [req for _, req in self._done_pending],
                self.ctx,
                None,
                self.comm.right,
                "the right neighbour to finish reading this rank's chunks (CUDA IPC)",
            )
            wait(self._sends, self.ctx, None, self.comm.right, "delivering CUDA IPC step messages")
        if self.fallback is not None:
            self.fallback.end()
        self._clear()
        self._work = self._src = self._acc = None

    def close(self) -> None:
        """Wait for the right to say it closed its mappings of this rank's memory, then drop the
        pins (collective, as Communicator.close() is: the right's receiving half says so first).
        On an aborted communicator the right may be gone: the pins stay for the process's life."""
        if self.fallback is not None:
            self.fallback.close()
        if not self._began or self.comm._aborted:
            return
        ctx = _close_context(self.comm)
        try:
            wait(
                [self.comm.mpi.Irecv(self._reply_in, self.comm.right, ctx.tag)],
                ctx,
                None,
                self.comm.right,
                "the right neighbour to close its CUDA IPC mappings of this rank's memory",
            )
        except RingcommError as e:  # the neighbour is gone or aborted: keep the pins (the memory stays)
            log.warning(
                "ringcomm: rank %d closes without its right neighbour's word (%s); what it exported stays allocated",
                self.comm.rank,
                e,
            )
            return
        self._unpin_released()
        self._scratch = None
        self._began = False

    def abort(self) -> None:
        if self.fallback is not None:
            return self.fallback.abort()
        setup, self._setup = self._setup, []
        cancel([req for _, req in self._done_pending] + setup[1:], self._sends + setup[:1])
        self._clear()
        self._work = self._src = self._acc = None
        return None


class IpcRecv(_IpcHalf):
    """The receiving half: maps the left's buffers and reads each announced chunk from them,
    then tells the left "read done"."""

    private = False  # (see MpiRecv.private)

    name = "ipc"

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.fallback: StagedRecv | None = None  # set, on both ends of the edge, once its set-up failed
        self._releases: list[bytes] = []  # handles of the left's memory closed here, to report to it
        self._began = False
        self._peer: list = []  # per slot, a uint8 view of the left's array (None: unused)
        # the descriptor _peer was opened from, the (handle, mapping) pairs it holds, and the
        # chunks viewed in them: a call whose descriptor is the last one's, with its mappings
        # still open, reuses them all (no handle is looked up, no view made)
        self._opened: bytes | None = None
        self._held: list[tuple[bytes, _Mapping]] = []
        self._chunks: dict[tuple, Any] = {}
        cap = max(16, 12 * comm.size)
        self._ready_in = np.zeros((cap, 4), np.int64)
        self._done_out = np.zeros((cap, 1), np.int64)
        self._desc_in = np.zeros((len(SLOTS), _DESC), np.int64)
        self._reply_out = np.zeros(REPLY_WORDS, np.int64)
        self._events = EventPool()
        self._active = False
        self._clear()

    def _clear(self) -> None:
        self._seq = 0
        self._incoming = None  # (request, row, count, dtype) of this step's "ready" from the left
        self._reading = False  # this step read from the left: send "read done" at step_done
        self._sends: list = []  # Isend requests of the reply and the "read done" messages
        self._events.reset()

    def begin(self, ctx: Any, work: Any, src: Any, bounds: Any) -> None:
        """Receive the left's handles, map them (cached), and reply: mapped or not, and which of the
        left's allocations this rank closed since the last call."""
        if self.fallback is not None:
            return self.fallback.begin(ctx, work, src, bounds)
        if not self._start(ctx):
            return None
        cupy = self._cupy
        base = ctx.identity()
        t_handles, self._t_ready, self._t_done, t_reply = (
            base | tags.HANDLES,
            base | tags.READY,
            base | tags.DONE,
            base | tags.RELEASED,
        )
        # (and data: a left whose edge fell back to staging may be sending already)
        ctx.expect += (t_handles, self._t_ready, base | tags.DATA)
        mpi, left = self.comm.mpi, self.comm.left
        wait([mpi.Irecv(self._desc_in, left, t_handles)], ctx, None, left, "rank %d's CUDA IPC handles", left)
        problem = ""
        if (self._desc_in[:, 0] == _FAILED).any():
            problem = f"rank {left} could not export its buffers"
        elif not self._reopened():
            try:
                self._forget_views()
                with cupy.cuda.Device(self.device.device_id):  # a handle opens on the current device
                    self._peer = [self._open(self._desc_in[slot]) for slot in SLOTS]
                with _mapped_lock:  # after every slot is open: the mappings of this call are the newest
                    self._evict()
                self._opened = self._desc_in.tobytes()
            except Exception as e:  # noqa: BLE001 - any failure means: this edge falls back, on both ends
                problem = f"opening rank {left}'s CUDA IPC handle failed: {e}"
        self._fill_reply(ok=not problem, closing=False)
        reply = mpi.Isend(self._reply_out, left, t_reply)
        if not problem:
            self._sends.append(reply)
            return None
        wait([reply], ctx, None, left, "telling rank %d that CUDA IPC failed", left)
        _warn_fallback(self.comm, problem)
        self.fallback, self.name, self._active = StagedRecv(self.comm), "staged", False
        return self.fallback.begin(ctx, work, src, bounds)

    def _fill_reply(self, ok: bool, closing: bool) -> None:
        """The reply to the left: whether its handles are mapped, whether this rank is closing, and
        the handles of its memory closed here since the last reply (at most RELEASE_SLOTS; the rest
        go next time)."""
        out, sent = self._reply_out, self._releases[:RELEASE_SLOTS]
        del self._releases[:RELEASE_SLOTS]
        out[:] = 0
        out[0], out[1], out[2] = _VALID if ok else _FAILED, len(sent), int(closing)
        for i, handle in enumerate(sent):
            out[3 + 8 * i : 11 + 8 * i] = _words(handle)

    def _forget_views(self) -> None:
        self._peer, self._opened, self._held, self._chunks = [], None, [], {}

    def _reopened(self) -> bool:
        """True when this call's descriptor is the one ``_peer`` was opened from and every mapping
        it holds is still open (then marked the most recently used, as :meth:`_open` does)."""
        if self._opened is None or self._desc_in.tobytes() != self._opened:
            return False
        with _mapped_lock:
            if any(_mapped.get(handle) is not mapping for handle, mapping in self._held):
                return False
            for handle, _ in self._held:
                _mapped.move_to_end(handle)
        return True

    def _chunk(self, slot: int, offset: int, nbytes: int, dtype: np.dtype) -> Any:
        """The left's ``nbytes`` at ``offset`` in ``slot`` as an array of ``dtype`` (views kept
        with the mappings they lie in), or None when the slot is unused or no slot."""
        key = (slot, offset, nbytes, dtype)
        view = self._chunks.get(key)
        if view is None:
            whole = self._peer[slot] if 0 <= slot < len(SLOTS) else None
            if whole is None:
                return None
            if len(self._chunks) >= 64:
                self._chunks.clear()
            view = self._chunks[key] = whole[offset : offset + nbytes].view(dtype)
        return view

    def _open(self, row: np.ndarray) -> Any:
        """A uint8 view of the neighbour's array described by ``row`` (None for an unused slot)."""
        state, offset, nbytes, alloc = (int(v) for v in row[:4])
        if state == _UNUSED:
            return None
        if state != _VALID:
            raise RuntimeError("the neighbour could not export its buffer")
        handle = row[4:].tobytes()
        with _mapped_lock:
            mapping = _mapped.get(handle)
            if mapping is None:
                cp = self._cupy
                ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)
                mem = cp.cuda.UnownedMemory(ptr, alloc, None, cp.cuda.runtime.getDevice())
                mapping = _mapped[handle] = _Mapping(cp.ndarray((alloc,), np.uint8, cp.cuda.MemoryPointer(mem, 0)))
                log.debug("ipc: rank %d mapped %d bytes of rank %d", self.comm.rank, alloc, self.comm.left)
            else:
                _mapped.move_to_end(handle)
            mapping.owners.add(self)
            self._held.append((handle, mapping))
            if handle in self._releases:  # closed earlier, mapped again: the left must keep its pin
                self._releases.remove(handle)
        if offset < 0 or offset + nbytes > alloc:
            raise RuntimeError(f"descriptor out of range: offset {offset} + {nbytes} bytes > allocation {alloc}")
        return mapping.whole[offset : offset + nbytes]

    def _evict(self) -> None:
        # From begin() only, once every slot of the call is open, with _mapped_lock held: the
        # mappings of the current collective are the most recently used ones. Every receiving half
        # that used a closed mapping tells its left in its next reply (the exporter unpins).
        while len(_mapped) > max(MAX_MAPPINGS, len(SLOTS)):
            handle, mapping = _mapped.popitem(last=False)
            self._close_mapping(mapping)
            for owner in mapping.owners:
                owner._releases.append(handle)

    def _close_mapping(self, mapping: _Mapping) -> None:
        try:
            self._cupy.cuda.runtime.ipcCloseMemHandle(mapping.whole.data.ptr)
        except Exception as e:  # noqa: BLE001 - the mapping is gone either way
            log.warning("ringcomm: closing a CUDA IPC mapping failed on rank %d: %s", self.comm.rank, e)

    def post(self, step: Any, recv_count: int, recv_into: Any, recv_dtype: Any) -> None:
        if self.fallback is not None:
            return self.fallback.post(step, recv_count, recv_into, recv_dtype)
        if self._seq >= self._ready_in.shape[0]:  # more steps than foreseen: never in the ring schedules
            raise RuntimeError(f"ipc transport: step {self._seq} exceeds its {self._ready_in.shape[0]} message slots")
        row = self._ready_in[self._seq]
        self._seq += 1
        self._incoming = None
        if recv_count:
            req = self.comm.mpi.Irecv(row, self.comm.left, self._t_ready)
            self._incoming = (req, row, recv_count, np.dtype(recv_dtype))
        return None

    def recv(self, step: Any, sender: Any) -> Iterator[tuple[int, int, Any]]:
        if self.fallback is not None:
            yield from self.fallback.recv(step, sender)
        elif self._incoming is not None:
            yield from self._recv(step, sender)

    def _recv(self, step: Any, sender: Any) -> Iterator[tuple[int, int, Any]]:
        """The step's incoming chunk, as a view of the left's mapped memory, once it is announced."""
        req, row, count, dtype = self._incoming
        sender.pump(step, 0)
        wait([req], self.ctx, step.index, self.comm.left, "chunk %s announced by the left (CUDA IPC)", step.recv)
        index, slot, offset, nbytes = row.tolist()
        want = count * dtype.itemsize
        view = self._chunk(slot, offset, nbytes, dtype) if nbytes == want else None
        if nbytes != want or index != step.index or view is None:
            raise MismatchError(
                f"{self.ctx.collective} call {self.ctx.call}: rank {self.comm.rank} expected {want} bytes of chunk "
                f"{step.recv} from rank {self.comm.left} at step {step.index}, and rank {self.comm.left} announced "
                f"{nbytes} bytes at its step {index}: the ranks disagree on the count or the dtype"
            )
        self._reading = True
        yield 0, count, view

    def step_done(self, step: Any) -> None:
        if self.fallback is not None:
            return self.fallback.step_done(step)
        if self._reading:  # the kernel reading the left's memory must be complete before "read done"
            ev = self._events.take()
            ev.record(self.stream)
            wait_event(ev, self.ctx, step.index, self.comm.left, "this rank's kernel reading chunk %s", step.recv)
            out = self._done_out[self._seq - 1]
            out[0] = step.index
            self._sends.append(self.comm.mpi.Isend(out, self.comm.left, self._t_done))
            self._reading = False
        self._events.reset()  # every event used so far has completed
        return None

    def end(self) -> None:
        if self.fallback is not None:
            return self.fallback.end()
        if self._active:
            wait(self._sends, self.ctx, None, self.comm.left, "delivering CUDA IPC step messages")
        self._clear()
        return None

    def close(self) -> None:
        """Close this half's mappings of the left's memory (those no other half of the process
        still uses) and tell the left so, which then drops its pins (IpcSend.close). The note is
        small (sent eagerly by MPI) and not waited for: a left still in close() receives it."""
        if self.fallback is not None:
            self.fallback.close()
        if not self._began:
            return
        with _mapped_lock:
            for handle, mapping in list(_mapped.items()):
                if self in mapping.owners:
                    mapping.owners.discard(self)
                    if not mapping.owners:
                        del _mapped[handle]
                        self._close_mapping(mapping)
        self._releases.clear()
        self._forget_views()
        self._began = False
        if self.comm._aborted:
            return
        self._fill_reply(ok=True, closing=True)
        abandon(self.comm.mpi.Isend(self._reply_out, self.comm.left, _close_tag(self.comm)), self._reply_out)

    def abort(self) -> None:
        if self.fallback is not None:
            return self.fallback.abort()
        recvs = [] if self._incoming is None else [self._incoming[0]]
        cancel(recvs, self._sends)
        self._clear()
        return None
