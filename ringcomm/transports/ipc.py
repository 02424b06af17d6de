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
neighbour reports the mapping closed: at every collective's start the right sends the handles it
closed since the last one (mappings evicted from its cache beyond MAX_MAPPINGS, least recently
used first), and at ``close()`` it closes all of them and says so before its left drops any pin.
This holds device memory: at most MAX_MAPPINGS allocations per neighbour that the user has
already dropped, until they are evicted or the communicator is closed.

Set-up failures (an export, an exchange or an open fails on any rank) are agreed on by all ranks
at the start of each collective (one small all-reduce); then every rank switches to the staged
transport, with a warning, for this collective and the ones after it. The driver queries CuPy
does not wrap (cuMemGetAddressRange, cuPointerGetAttribute) go through NVIDIA's cuda-bindings,
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
from .base import cancel, wait
from .staged import EventPool, StagedTransport, wait_event

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

#: handle slots in one "released" message (more wait for the next collective)
RELEASE_SLOTS = 8


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
#: (CUDA lets a process open a handle once); least recently used beyond MAX_MAPPINGS are closed
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


class IpcTransport:
    """Ring neighbours on one node exchange chunks through CUDA IPC mappings (see module doc)."""

    name = "ipc"

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.fallback: StagedTransport | None = None  # set, on every rank, once IPC set-up failed
        # exporting: allocation buffer id -> handle, and handle -> what keeps the allocation alive
        # (the array or scratch Memory it was exported for) until the right has closed its mapping
        self._handle_of: dict[int, bytes] = {}
        self._pins: dict[bytes, Any] = {}
        self._scratch = None  # registered send scratch (cudaMalloc), grown when needed
        self._releases: list[bytes] = []  # handles of the left's memory closed here, to report to it
        self._began = False  # some collective ran: close() agrees the unmapping with the neighbours
        cap = max(16, 12 * comm.size)
        self._ready_out = np.zeros((cap, 4), np.int64)  # step, slot, byte offset, nbytes
        self._ready_in = np.zeros((cap, 4), np.int64)
        self._done_out = np.zeros((cap, 1), np.int64)
        self._done_in = np.zeros((cap, 1), np.int64)
        self._desc_out = np.zeros((len(SLOTS), _DESC), np.int64)
        self._desc_in = np.zeros((len(SLOTS), _DESC), np.int64)
        self._release_out = np.zeros(2 + 8 * RELEASE_SLOTS, np.int64)  # count, closing flag, handles
        self._release_in = np.zeros(2 + 8 * RELEASE_SLOTS, np.int64)
        self._flag_out = np.zeros(1, np.int32)
        self._flag_in = np.zeros(1, np.int32)
        self._events = EventPool()
        self._active = False
        self._clear()

    def _clear(self) -> None:
        self._seq = 0
        self._incoming = None  # (request, row, count, dtype) of this step's "ready" from the left
        self._reading = False  # this step read from the left: send "read done" at step_done
        self._done_pending: list = []  # (step index, request) "read done" expected from the right
        self._sends: list = []  # Isend requests of "ready" and "read done" messages
        self._events.reset()

    # ------------------------------------------------------------------ set-up
    def begin(self, ctx: Any, work: Any, src: Any, bounds: list[tuple[int, int]]) -> None:
        if self.fallback is not None:
            return self.fallback.begin(ctx, work, src, bounds)
        self.ctx, self.device = ctx, ctx.device
        self._clear()
        self._active = self.comm.size > 1
        if not self._active:
            return None
        import cupy

        self._cupy = cupy
        self._began = True
        self.stream = self.device.stream
        self._work, self._src, self._acc = work, src, ctx.acc
        base = ctx.identity()
        self._t_handles, self._t_ready, self._t_done, self._t_released = (
            base | tags.HANDLES, base | tags.READY, base | tags.DONE, base | tags.RELEASED)
        # (and data: a neighbour whose agreement completed first may be sending as the staged fallback)
        ctx.expect = (self._t_handles, self._t_ready, self._t_done, self._t_released, base | tags.DATA)
        mpi, left, right = self.comm.mpi, self.comm.left, self.comm.right
        problem = ""
        try:
            with cupy.cuda.Device(self.device.device_id):  # driver calls need the device's context current
                self._describe(work, src, ctx.acc)
        except Exception as e:  # noqa: BLE001 - any failure means: fall back, on every rank
            problem = f"exporting this rank's buffers failed: {e}"
            self._desc_out[:, 0] = _FAILED
        self._fill_releases(closing=False)
        wait([mpi.Irecv(self._desc_in, left, self._t_handles), mpi.Isend(self._desc_out, right, self._t_handles),
              mpi.Irecv(self._release_in, right, self._t_released), mpi.Isend(self._release_out, left, self._t_released)],
             ctx, None, left, "exchanging CUDA IPC handles")
        self._unpin_released(keep={bytes(self._desc_out[slot, 4:].tobytes()) for slot in SLOTS})
        if not problem:
            try:
                self._peer = [self._open(self._desc_in[slot]) for slot in SLOTS]
                with _mapped_lock:  # after every slot is open: the mappings of this call are the newest
                    self._evict()
            except Exception as e:  # noqa: BLE001
                problem = f"opening rank {left}'s CUDA IPC handle failed: {e}"
        self._flag_out[0] = 0 if problem else 1
        from mpi4py import MPI

        wait([mpi.Iallreduce(self._flag_out, self._flag_in, op=MPI.MIN)], ctx, None, left, "agreeing on CUDA IPC")
        if self._flag_in[0] != 1:
            self._fall_back(problem or "another rank could not set up CUDA IPC")
            return self.fallback.begin(ctx, work, src, bounds)
        return None

    def _fall_back(self, why: str) -> None:
        msg = f"ringcomm: CUDA IPC unavailable on rank {self.comm.rank} ({why}); using the staged transport"
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)
        self.fallback = StagedTransport(self.comm)
        self.name = "staged"
        self._active = False

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
            drv = _get_driver()
            if not drv.attribute(ptr, drv.IPC_CAPABLE):
                need_scratch = max(need_scratch, a.nbytes)
                self._slot_of[slot] = SCRATCH
                continue
            base, size = drv.allocation(ptr)
            key = drv.attribute(base, drv.BUFFER_ID)  # unique per allocation over the process lifetime
            handle = self._handle_of.get(key) if key is not None else None
            if handle is None:
                handle = bytes(self._cupy.cuda.runtime.ipcGetMemHandle(base))
                if key is not None:
                    self._handle_of[key] = handle
            self._pins[handle] = a
            self._fill(slot, handle, ptr - base, a.nbytes, size)
            self._slot_of[slot] = slot
        if need_scratch:
            if self._scratch is None or self._scratch.nbytes < need_scratch:
                old = self._scratch.nbytes if self._scratch is not None else 0
                mem = self._cupy.cuda.Memory(max(need_scratch, 2 * old, SCRATCH_MIN_BYTES))
                self._scratch = self._cupy.ndarray((mem.size,), np.uint8, self._cupy.cuda.MemoryPointer(mem, 0))
                self._scratch_handle = bytes(self._cupy.cuda.runtime.ipcGetMemHandle(mem.ptr))
                log.debug("ipc: rank %d exports a %d-byte scratch buffer", self.comm.rank, mem.size)
            self._pins[self._scratch_handle] = self._scratch  # an outgrown one stays until released
            self._fill(SCRATCH, self._scratch_handle, 0, self._scratch.nbytes, self._scratch.nbytes)

    def _fill(self, slot: int, handle: bytes, offset: int, nbytes: int, alloc: int) -> None:
        row = self._desc_out[slot]
        row[0], row[1], row[2], row[3] = _VALID, offset, nbytes, alloc
        row[4:] = _words(handle)

    def _fill_releases(self, closing: bool) -> None:
        """The outgoing "released" message: handles of the left's memory this rank closed since
        the last one (at most RELEASE_SLOTS; the rest go next time), and whether it is closing."""
        out, sent = self._release_out, self._releases[:RELEASE_SLOTS]
        del self._releases[:RELEASE_SLOTS]
        out[:] = 0
        out[0], out[1] = len(sent), int(closing)
        for i, handle in enumerate(sent):
            out[2 + 8 * i: 10 + 8 * i] = _words(handle)

    def _unpin_released(self, keep: set[bytes] = frozenset()) -> None:
        """Drop the pins of the allocations the right reports it no longer maps (all of them when
        it is closing), except those described again in this collective (the right opens them anew)."""
        got = self._release_in
        if got[1]:
            self._pins.clear()
            self._handle_of.clear()
            return
        released = {got[2 + 8 * i: 10 + 8 * i].tobytes() for i in range(int(got[0]))} - set(keep)
        for handle in released:
            self._pins.pop(handle, None)
        if released:
            self._handle_of = {k: h for k, h in self._handle_of.items() if h not in released}

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
            if handle in self._releases:  # closed earlier, mapped again: the left must keep its pin
                self._releases.remove(handle)
        if offset < 0 or offset + nbytes > alloc:
            raise RuntimeError(f"descriptor out of range: offset {offset} + {nbytes} bytes > allocation {alloc}")
        return mapping.whole[offset: offset + nbytes]

    def _evict(self) -> None:
        # From begin() only, once every slot of the call is open, with _mapped_lock held: the
        # mappings of the current collective are the most recently used ones. Every transport
        # that used a closed mapping tells its left at its next collective (the exporter unpins).
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

    def _row(self, table: np.ndarray) -> np.ndarray:
        if self._seq >= table.shape[0]:  # more steps than foreseen: never in the ring schedules
            raise RuntimeError(f"ipc transport: step {self._seq} exceeds its {table.shape[0]} message slots")
        return table[self._seq]

    # ------------------------------------------------------------------ steps
    def post(self, step: Any, send: Any, recv_count: int, recv_into: Any, recv_dtype: Any) -> None:
        if self.fallback is not None:
            return self.fallback.post(step, send, recv_count, recv_into, recv_dtype)
        if not self._active:
            return None
        mpi, ctx, left, right = self.comm.mpi, self.ctx, self.comm.left, self.comm.right
        self._incoming = None
        if recv_count:
            row = self._row(self._ready_in)
            self._incoming = (mpi.Irecv(row, left, self._t_ready), row, recv_count, np.dtype(recv_dtype))
        if send is not None and send.size:
            slot, offset = self._locate(send)
            if slot == SCRATCH:  # a write into the scratch: its earlier readers must be done
                self._wait_done_before(step)
                self.device.copy(self._scratch[offset: offset + send.nbytes], send.view(np.uint8))
            ev = self._events.take()
            ev.record(self.stream)  # after the kernels that produced this chunk (and the scratch copy)
            wait_event(ev, ctx, step.index, right, "this rank's kernels producing chunk %s", step.send)
            out = self._row(self._ready_out)
            out[:] = (step.index, slot, offset, send.nbytes)
            self._sends.append(mpi.Isend(out, right, self._t_ready))
            self._done_pending.append((step.index, mpi.Irecv(self._row(self._done_in), right, self._t_done)))
        if recv_count:  # this step's kernel writes this rank's work: earlier readers must be done
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
            wait(earlier, self.ctx, step.index, self.comm.right,
                 "the right neighbour to finish reading this rank's earlier chunks (CUDA IPC)")
            self._done_pending = [(i, r) for i, r in self._done_pending if i >= step.index]

    def recv(self, step: Any) -> Iterator[tuple[int, int, Any]]:
        if self.fallback is not None:
            yield from self.fallback.recv(step)
            return
        if not self._active or self._incoming is None:
            return
        req, row, count, dtype = self._incoming
        wait([req], self.ctx, step.index, self.comm.left, "chunk %s announced by the left (CUDA IPC)", step.recv)
        index, slot, offset, nbytes = (int(v) for v in row)
        view = self._peer[slot] if 0 <= slot < len(SLOTS) else None
        want = count * dtype.itemsize
        if nbytes != want or index != step.index or view is None:
            raise MismatchError(
                f"{self.ctx.collective} call {self.ctx.call}: rank {self.comm.rank} expected {want} bytes of chunk "
                f"{step.recv} from rank {self.comm.left} at step {step.index}, and rank {self.comm.left} announced "
                f"{nbytes} bytes at its step {index}: the ranks disagree on the count or the dtype"
            )
        self._reading = True
        yield 0, count, view[offset: offset + nbytes].view(dtype)

    def step_done(self, step: Any) -> None:
        if self.fallback is not None:
            return self.fallback.step_done(step)
        if not self._active:
            return None
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
            pending = [req for _, req in self._done_pending]
            wait(pending, self.ctx, None, self.comm.right,
                 "the right neighbour to finish reading this rank's chunks (CUDA IPC)")
            wait(self._sends, self.ctx, None, self.comm.right, "delivering CUDA IPC step messages")
        self._clear()
        self._work = self._src = self._acc = None
        return None

    def close(self) -> None:
        """Close this transport's mappings of the left's memory and release what the right mapped
        of this rank's, agreed with both neighbours (collective, as Communicator.close() is).

        Each rank closes its mappings (those no other transport of the process still uses), then
        tells its left so, and waits for its right to say the same before dropping its pins: no
        allocation is freed while a neighbour still maps it. On an aborted communicator the
        neighbours may be gone: the mappings are closed, and the pins kept for the process's life.
        """
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
        self._peer = []
        if self.comm._aborted:
            return
        from ..engine import Context
        from ..devices import HostDevice

        ctx = Context("Communicator.close()", self.comm, HostDevice(), np.dtype(np.uint8), None)
        call = self.comm._calls + 1  # after the last collective: a neighbour still in it waits on
        tag = self.comm._layout.base("close", ctx.dtype, None, -1, call) | tags.RELEASED
        ctx.call, ctx.tag, ctx.expect = call, tag, (tag,)
        self._fill_releases(closing=True)
        mpi = self.comm.mpi
        try:
            wait([mpi.Irecv(self._release_in, self.comm.right, tag), mpi.Isend(self._release_out, self.comm.left, tag)],
                 ctx, None, self.comm.right, "the right neighbour to close its CUDA IPC mappings of this rank's memory")
        except RingcommError as e:  # the neighbour is gone or aborted: keep the pins (the memory stays)
            log.warning("ringcomm: rank %d closes without its right neighbour's word (%s); what it exported stays "
                        "allocated", self.comm.rank, e)
            return
        self._unpin_released()
        self._scratch = None
        self._began = False

    def abort(self) -> None:
        if self.fallback is not None:
            return self.fallback.abort()
        recvs = [req for _, req in self._done_pending]
        if self._incoming is not None:
            recvs.append(self._incoming[0])
        cancel(recvs, self._sends)
        self._clear()
        self._work = self._src = self._acc = None
        return None
