"""The Communicator: an mpi4py communicator seen as a ring, with the collectives as methods."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np
from mpi4py import MPI

from . import collectives, devices, schedule, tags, transports
from .arrays import span
from .config import env, flag
from .engine import (
    Context,
    DirectPlan,
    GatherFold,
    Plan,
    SharedDirectPlan,
    SharedGatherFold,
    SharedPlacesPlan,
    execute,
    sent_bytes,
)
from .errors import AbortError, MismatchError, NotCoResident, RingcommError
from .ops import ReduceOp, parse_accumulate
from .schedule import Bounds, partition
from .transports.base import abandon, wait
from .transports.mpi import GatheredBlocks
from .transports.shm import SharedBlocks, SharedDirect, SharedPlaces, SharedWindow, region_bytes

log = logging.getLogger("ringcomm")

DEFAULT_TIMEOUT = 300.0
#: the MPI message size a chunk is cut into (and a broadcast/reduce chain piece's size): measured
#: on 2 cores, 4 MiB against 1 MiB: in-place all-reduces of 4-16 MiB 5-10 % faster at N = 2 (each
#: message costs MPICH a rendezvous) and no loss at 64 MiB, broadcast and reduce at N = 4 as fast
DEFAULT_SLICE_BYTES = 4 << 20
#: all-reduces up to this many bytes gather whole buffers and fold (N-1 steps, no reduce-scatter):
#: below the ring's break-even S < alpha*beta/(1 - 2/N) on the host (python -m ringcomm.model: about
#: 160-320 KB with this machine's alpha and beta for N >= 4; at N = 2 gathering is never worse), and
#: measured 13-19 us faster than the ring from 8 to 64 KiB at N = 2 and 2x at N = 4
DEFAULT_SMALL_BYTES = 1 << 16
#: cached ring plans (engine.Plan): at most this many, owning at most PLAN_CACHE_BYTES together
#: (all are freed, between collectives, when one more would not fit)
PLAN_LIMIT = 64
PLAN_CACHE_BYTES = 64 << 20
#: cached small all-reduces (one per kind, count and dtype; each owns N·count elements, at most
#: N·small_bytes bytes): all are freed when one more would not fit. The cache follows the calls
#: alone (never addresses), so every rank frees and remakes them at the same calls, as the
#: persistent MPI_Allgather_init on the host needs (persistent collectives match in init order)
GATHER_LIMIT = 16
#: host collectives on buffers up to this size run cached plans (persistent requests; all-reduces
#: of 3+ ranks on one node, engine.DirectPlan, whose scratch is (N-1)/N of the buffer); above it
#: the engine's loop runs and keeps no memory (measured at N = 4 on 2 cores: plans up to 8 MiB
#: are 13-15 % faster; at 32 MiB the gain is within noise)
PLAN_BYTES = 16 << 20
#: host all-reduces (and broadcasts) on one node up to this size run through the shared-memory window
#: in one piece (engine.SharedDirectPlan above small_bytes; larger all-reduces in pieces, see
#: SHARED_PIECE_BYTES). Each rank's region of the window holds two slots of min(the largest
#: small_bytes, SHARED_SMALL_BYTES) and an inbox of the direct size: all ranks together at most
#: SHARED_TOTAL_BYTES and a quarter of the free space of /dev/shm (which containers keep small, 64 MiB
#: by default in Docker), the direct size shrunk (then dropped, then the slots too) to fit
SHARED_BYTES = 4 << 20
SHARED_SMALL_BYTES = 1 << 20
SHARED_TOTAL_BYTES = 32 << 20
#: a shared-memory wait reads the others' sequence words this often before it yields, when every
#: rank can have a core (measured at N = 2 on 2 cores: 0.3-0.5 us less per small all-reduce than
#: yielding at once); with more ranks than cores it yields at once (the rank it waits for may need
#: this core; measured: spinning first is slower at N = 4)
SHARED_SPINS = 50
#: at 2 ranks an all-gather's shard and a broadcast run in the window up to these sizes: beyond
#: them MPI's one message per rank (the receiver reads the sender's buffer: one copy) is faster
#: than the window's copy in and copy out (measured on 2 cores: all-gathers of 256 KiB-2 MiB
#: shards 0.26-0.36 of MPICH in place against the ring's 0.54-0.83, out of place 0.76-0.96 against
#: 0.78-0.86; a broadcast of 64 KiB 8.2 us against the chain's 6.8, of 32 KiB 5.2 against 5.4)
SHARED_PAIR_LIMITS = {"all_gather": 128 << 10, "broadcast": 32 << 10}
#: an all-reduce larger than the inbox runs in the window in pieces (two publications each: each
#: rank's run of every chunk side by side in the inbox) when an inbox holds N runs of at least this
#: size, at every size; else it leaves the window beyond the inbox. (Measured on 2 cores, 16 MiB,
#: µs out / in place, against the ring's 2249 / 2537 at N = 2 and 7285 / 7640 at N = 4: runs of
#: 2 MiB (N = 2, inbox 4 MiB) 2062 / 1461; 512 KiB 1980 / 1437; 128 KiB 2304 / 2185; 32 KiB
#: 4214 / 3490; at N = 4 runs of 1 MiB 6462 / 7724, 256 KiB 7544 / 6313, 64 KiB 10158 / 9417; at
#: 64 MiB the bench gave 3.4-3.7x MPICH out of place and 3.4-3.8x in place at N = 2, against the
#: ring's 3.5-3.7x and 3.2x, and at N = 4 2.9-3.4x against 1.9-2.5x.)
SHARED_PIECE_BYTES = 256 << 10

_CLOSED = "closed by Communicator.close()"
#: bytes of an abort message: the origin rank and the communicator's number (int64), then the error in UTF-8
ABORT_BYTES = 256
_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "barrier")
_OPS = (None,) + tuple(ReduceOp)


def _schedule_name(ctx: Context) -> str:
    """What the DEBUG line calls a schedule's steps: broadcasts and reduces run a pipelined chain,
    the other collectives the ring."""
    return "chain" if ctx.collective in ("broadcast", "reduce") else "ring"


class Communicator:
    """A ring over the ranks of an mpi4py intracommunicator.

    The ring follows the topology: ``ring`` is the tuple of MPI ranks in ring order, each node's
    ranks adjacent (in MPI order; one node: MPI order), so the ring leaves a node once. A rank
    receives from ``left`` and sends to ``right``, its neighbours in it (MPI ranks). Results keep
    MPI rank order (shards, roots). Nodes come from MPI's shared-memory split, or from
    ``RINGCOMM_NODES`` (one label per rank, comma-separated, in MPI rank order). The wrapped
    communicator is duplicated, so ringcomm's messages never mix with the caller's.

    ``timeout``: seconds any one wait (for a neighbour's message, an agreement, a barrier, or the
    communicator's own creation) may last before :class:`ringcomm.TimeoutError` (env
    ``RINGCOMM_TIMEOUT`` overrides). ``check``: before each collective, all ranks verify that they
    agree on its kind, count, dtype, op, root and call number, raising :class:`ringcomm.MismatchError`
    on every rank when they do not (env ``RINGCOMM_CHECK``). ``slice_bytes``: the MPI message size a
    chunk is cut into (env ``RINGCOMM_SLICE_BYTES``). ``small_bytes``: all-reduces of at most this
    many bytes gather whole buffers round the ring and reduce locally, N-1 steps instead of 2(N-1)
    (env ``RINGCOMM_SMALL_BYTES``; 0 turns it off); GPU collectives of at most this many bytes (an
    all-gather's out; the smallest of any rank's, so that all route alike) go through the host, on rings
    whose collectives are not ring kernels. ``shared_memory``: when MPI puts every rank on
    one node, host collectives up to a few MiB meet in an MPI shared-memory window
    instead of MPI messages (transports.shm; env ``RINGCOMM_SHM``; any rank's False or no /dev/shm space turns
    it off for all). Creating a Communicator is collective.
    """

    _ready = False  # set once the communicator exists: waits then also watch for aborts and mismatches
    _id = 0  # (set during creation: see __init__)

    def __init__(
        self,
        mpi_comm: MPI.Intracomm,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        check: bool = False,
        slice_bytes: int = DEFAULT_SLICE_BYTES,
        small_bytes: int = DEFAULT_SMALL_BYTES,
        shared_memory: bool = True,
    ) -> None:
        if not isinstance(mpi_comm, MPI.Intracomm) or mpi_comm == MPI.COMM_NULL:
            raise TypeError(f"Communicator needs an mpi4py intracommunicator; got {mpi_comm!r}")
        self.timeout = float(env("RINGCOMM_TIMEOUT", float, timeout))
        self.check = bool(env("RINGCOMM_CHECK", flag, check))
        self.slice_bytes = int(env("RINGCOMM_SLICE_BYTES", int, slice_bytes))
        self.small_bytes = int(env("RINGCOMM_SMALL_BYTES", int, small_bytes))
        shared_memory = bool(env("RINGCOMM_SHM", flag, shared_memory))
        #: RINGCOMM_ACCUMULATE, when set, overrides every call's ``accumulate`` ("" when unset)
        self.accumulate_override: str = env("RINGCOMM_ACCUMULATE", parse_accumulate, "")
        transports.override()  # an unknown RINGCOMM_TRANSPORT fails here, not inside a collective
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds; got {self.timeout}")
        if self.slice_bytes < 1 or self.small_bytes < 0:
            raise ValueError(f"need slice_bytes >= 1 and small_bytes >= 0; got {self.slice_bytes}, {self.small_bytes}")
        self.rank: int = mpi_comm.rank
        self.size: int = mpi_comm.size
        labels = env("RINGCOMM_NODES", lambda raw: _node_labels(raw, self.size), None)
        self._host = devices.HostDevice()
        # MPI_Comm_idup under the deadline: a peer that never creates its Communicator raises here
        # instead of hanging; once every peer is known to be present, the node split follows.
        setup = Context("Communicator()", self, self._host, np.dtype(np.uint8), None)
        self.mpi: MPI.Intracomm = self._dup(mpi_comm, setup)
        #: small host all-reduces' persistent MPI_Allgather (GatheredBlocks): a communicator of their own
        self._gather_mpi: MPI.Intracomm = self._dup(self.mpi, setup)
        self.left = (self.rank - 1) % self.size  # (named by set-up waits until the ring is known)
        self._layout = tags.Layout.for_mpi(self.mpi.Get_attr(MPI.TAG_UB), self.size)
        #: the ranks that share this rank's node (MPI's shared-memory split, or RINGCOMM_NODES)
        self.node_comm: MPI.Intracomm | None = None
        window = None  # the shared-memory window's (small, direct) bytes, when there is one
        lowest = free = 0
        if labels is None:  # MPI's shared-memory split: a node is named by its lowest rank
            self.node_comm = self.mpi.Split_type(MPI.COMM_TYPE_SHARED)
            lowest = MPI.Group.Translate_ranks(self.node_comm.Get_group(), [0], self.mpi.Get_group())[0]
            free = _shm_free() if shared_memory else 0
        nonce = int.from_bytes(os.urandom(7), "little")
        table = self._allgather_ints(setup, [lowest, self.small_bytes, free, nonce], "finding every rank's node")
        #: this communicator's number (rank 0's random one), in its abort messages: MPI may give a later
        #: communicator the freed one's context, and an abort sent to a rank that had closed would
        #: otherwise abort the next one
        self._id = int(table[0, 3])
        #: small_bytes for GPU arrays: the smallest of every rank's, so that all route a call alike (GPU
        #: collectives have no window to meet in and mismatch there); 0 on any rank: never, not even empty
        self._gpu_small = int(table[:, 1].min()) or -1
        if labels is None:
            labels = tuple(f"node{int(r)}" for r in table[:, 0])
            if int(table[:, 0].max()) == 0 and self.size > 1:  # every rank on node 0: one node, as MPI sees it
                window = _window_bytes(self.size, int(table[:, 1].max()), int(table[:, 2].min()))
        #: this rank's node as a number (its label's place among the sorted labels), the same on every rank
        self.node_index = sorted(set(labels)).index(labels[self.rank])
        if self.node_comm is None:
            self.node_comm = self.mpi.Split(self.node_index, self.rank)
        #: the node label of every rank, in MPI rank order (RINGCOMM_NODES, or "node<lowest rank>")
        self.nodes: tuple[str, ...] = labels
        #: the MPI ranks in ring order: each node's ranks adjacent, in MPI order (schedule.ring_order)
        self.ring: tuple[int, ...] = schedule.ring_order(labels)
        #: this rank's place in the ring; the schedule runs on places (chunk p: rank ring[p]'s shard)
        self.position = self.ring.index(self.rank)
        #: the MPI ranks this rank receives from and sends to
        self.left = self.ring[(self.position - 1) % self.size]
        self.right = self.ring[(self.position + 1) % self.size]
        self.single_node: bool = self.node_comm.size == self.size
        #: the host all-reduces' shared-memory window (transports.shm), when MPI's own split puts
        #: every rank on this node (see _window_bytes)
        self._shared: SharedWindow | None = None
        if window is not None:
            spins = SHARED_SPINS if self.size <= _cores() else 0
            self._shared = SharedWindow(self.mpi, *window, spins)
            wait([self.mpi.Ibarrier()], setup, None, self.left, "every rank's shared-memory window")
        self._ring_is_identity = self.ring == tuple(range(self.size))
        #: payload bytes this rank has sent in collectives (not counting metadata or checks)
        self.bytes_sent = 0
        self._seq = 0
        #: collectives started (every rank counts alike): the call number in message tags
        self._calls = 0
        self._aborted: str | None = None
        self._abort_sent: list = []  # (message, request) of the abort messages sent to the neighbours
        self._probe = MPI.Status()
        self._transports: dict[str, Any] = {}
        self._scratch: dict[str, Any] = {}
        self._plans: dict[tuple, Any] = {}  # ring plans (engine.Plan) by collective, root, dtype, bounds, addresses
        self._plan_bytes = 0
        self._gathers: dict[tuple, GatherFold] = {}  # small host all-reduces by ("host", count, dtype)
        #: fast lanes of host calls that ran a cached plan (the shared-memory window's; a broadcast's
        #: or all-gather's Plan, at its buffers' addresses), but small all-reduces (whose gathers keep
        #: theirs): (ctx, run, ...) by collective, count, dtype, op, root (collectives; dropped with
        #: the plans they run); and GPU calls' kernel lanes, by "kernel <collective>", count, dtype,
        #: op or root, result placement (collectives._kernel_lane; at most collectives.LANES in all)
        self._lanes: dict[tuple, tuple] = {}
        #: weak references to the (x, out) of the last small all-reduce found apart by
        #: np.may_share_memory (collectives._small_host; None: none yet)
        self._apart: tuple | None = None
        #: the error a ring kernel recorded after its call returned (raised by the next call or check_errors())
        self._late_error: BaseException | None = None
        #: RINGCOMM_TRANSPORT=kernel: the ring executor by device (ringcomm.executor), made on first use
        self._executors: dict[int, Any] = {}
        #: the scratch of calls captured in CUDA graphs (:meth:`_scratch_array`), kept while this lives
        self._graph_scratch: list = []
        self._ready = True

    # ------------------------------------------------------------------ the collectives
    # (the functions of ringcomm.collectives, bound as methods: no call in between)
    all_reduce = collectives.all_reduce
    reduce_scatter = collectives.reduce_scatter
    all_gather = collectives.all_gather
    broadcast = collectives.broadcast
    reduce = collectives.reduce

    def barrier(self) -> None:
        """Wait until every rank has called barrier (with the communicator's deadline)."""
        self._usable()
        ctx = Context("barrier", self, self._host, np.dtype(np.uint8), None)
        if self.check:
            self._guarded(lambda: self._agree(ctx, "barrier", 0, -1))
        self._guarded(lambda: wait([self.mpi.Ibarrier()], ctx, None, self.left, "barrier"))

    def check_errors(self) -> None:
        """Raise the error of a GPU collective that failed after its call returned, if any.

        With ``RINGCOMM_TRANSPORT=kernel`` a call returns once its kernel is queued, and the kernel
        itself records a failure (a timeout, an abort by a neighbour, a neighbour's different call)
        in pinned host memory and returns. That error is raised here, or by the next call, and the
        communicator is aborted (the neighbours are told). Without such an error this returns None.
        """
        self._poll_executors()
        error = self._late_error
        if error is not None and not self._aborted:
            self._abort(error)
            raise error

    def shard_bounds(self, count: int) -> Bounds:
        """The (start, stop) of every rank's shard of ``count`` elements, as reduce_scatter cuts them.

        Boundaries are multiples of :data:`ringcomm.schedule.ALIGN` (16) elements, so for counts of
        16·(size - 1) or fewer the last shards are empty; see :func:`ringcomm.schedule.partition`.
        """
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"count must be a non-negative integer; got {count!r}")
        return list(partition(int(count), self.size))

    def shared_memory(self) -> tuple[int, int] | None:
        """The shared-memory window's (small, direct) bytes: host all-reduces up to ``small``
        (and small_bytes) gather there, larger ones run the shared direct all-reduce (beyond
        ``direct`` in pieces, when ``direct`` holds N runs of SHARED_PIECE_BYTES; else they leave
        the window there); broadcasts run there up to ``small`` (at 3 or more ranks up to
        ``direct``), the other collectives up to ``direct`` (at 2 ranks all-gathers and broadcasts
        at most SHARED_PAIR_LIMITS; _window_limit);
        None when there is no window (ranks on several nodes, ``shared_memory=False``, no room)."""
        return None if self._shared is None else (self._shared.small, self._shared.direct)

    def transport_name(self, array: Any) -> str:
        """The name of the transport a collective on ``array`` would use ("mpi", "ipc", "staged", "kernel"),
        or "mixed" when the ring's edges use different ones (as this rank knows them: an edge whose
        IPC set-up failed elsewhere may have turned to staging). The first call for GPU arrays is
        collective (the ranks exchange what their GPUs can reach), as a first collective is."""
        return self._transport(collectives.classify(array, "array")[0]).name

    def ring_edges(self, array: Any) -> tuple[tuple[int, int, str], ...]:
        """Every edge of the ring for arrays like ``array``, as (sender, receiver, transport) in ring
        order from the edge into ``ring[0]`` (as this rank knows them; collective on the first call
        for GPU arrays, as transport_name)."""
        edges = self._transport(collectives.classify(array, "array")[0]).current()
        return tuple((self.ring[p - 1], self.ring[p], edges[p]) for p in range(self.size))

    def edge_transport(self, array: Any) -> str:
        """The name of the transport on this rank's receiving edge (``left`` -> this rank) for
        arrays like ``array``; collective on its first call for GPU arrays, as transport_name."""
        return self._transport(collectives.classify(array, "array")[0]).recv.name

    def close(self) -> None:
        """Free the communicator's MPI resources (collective, like MPI_Comm_free); later calls raise.

        Also available as a context manager: ``with ringcomm.init() as comm: ...``.
        A ring kernel's failure that no call or ``check_errors()`` raised yet (``kernel``: a call
        returns before its kernel runs) is raised here, once everything is freed: the last kernels
        end (within the deadline) before the communicator is.
        """
        if self._aborted == _CLOSED:
            return
        late = None
        try:
            self._free_plans()
            self._free_gathers()
            for link in self._transports.values():
                link.close()
            for ex in self._executors.values():
                ex.close()
            if not self._aborted:  # (an aborted communicator raised its error already)
                self._poll_executors()
                late = self._late_error
        except BaseException as e:  # (a neighbour that never closed: the others are told, and the rest is freed)
            self._abort(e)
            raise
        finally:
            self._executors.clear()
            self._graph_scratch.clear()
            self._transports.clear()
            for reused in self._scratch.values():
                reused.free()
            self._scratch.clear()
            window, self._shared = self._shared, None
            try:
                if window is not None:
                    self._free_window(window)
            finally:  # (MPI frees a communicator once what is pending on it completes)
                self.node_comm.Free()
                self._gather_mpi.Free()
                self.mpi.Free()
                self._aborted = _CLOSED
        if late is not None:
            raise late

    def _free_window(self, window: SharedWindow) -> None:
        """Free the shared-memory window. MPI_Win_free synchronizes every rank and has no
        deadline, so two MPI_Ibarriers under the deadline come first, and a rank frees only once
        both completed: a rank that never closes is a TimeoutError, not a hang, and a rank that
        gives up on the first never posts the second, so a late rank whose first barrier completes
        against the abandoned one times out in the second instead of hanging in MPI_Win_free.
        A rank that gives up (a timeout, an interrupt) tells its neighbours (an abort: their waits
        end at once). Not closed: a rank that stalls for the whole timeout between its two barriers,
        or is interrupted in the second once the others have passed theirs, leaves them waiting in
        MPI_Win_free. After an abort, or that timeout, a late peer may still read the window: it is
        kept for the process's life."""
        if self._aborted:
            abandon(None, window)
            return
        ctx = Context("close()", self, self._host, np.dtype(np.uint8), None)
        for what in (
            "every rank's close() (they free shared memory together)",
            "every rank's second barrier of close() (before they free shared memory)",
        ):
            request = self.mpi.Ibarrier()
            try:
                self._guarded(lambda request=request, what=what: wait([request], ctx, None, self.left, what))
            except BaseException as e:
                abandon(request, window)
                self._abort(e)  # (done already for a timeout)
                raise
        window.free()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        """close(); after an exception in the block, without waiting for the other ranks: the
        communicator is aborted first (the neighbours are told, and their waits, close()
        included, raise AbortError), and the exception goes on. A clean exit (sys.exit(0), a
        generator closed) closes with the others as the block's end does."""
        clean = isinstance(error, GeneratorExit) or (isinstance(error, SystemExit) and not error.code)
        if error is not None and not clean and self._aborted != _CLOSED:
            self._abort(error)
        self.close()

    def __repr__(self) -> str:
        return f"<ringcomm.Communicator rank {self.rank} of {self.size}, timeout {self.timeout:g} s>"

    # ------------------------------------------------------------------ used by collectives
    def _transport(self, kind: str) -> Any:
        """This rank's transports.Link for arrays of ``kind`` (made on first use; collective then
        for GPU arrays)."""
        link = self._transports.get(kind)
        if link is None:
            link = self._transports[kind] = self._guarded(lambda: transports.select(self, kind))
            if link.kernel:  # the executor's set-up probes that every rank's blocks run at once
                from .executor import RingExecutor

                try:
                    ex = self._guarded(lambda: RingExecutor(self, link.channels, link.mesh))
                except NotCoResident as e:
                    link.keep_host_driven(str(e))
                else:
                    self._executors[ex.device_id] = ex
        return link

    def _small(self, kind: str) -> int:
        """The small-call limit for ``kind`` arrays: this rank's small_bytes on the host (ranks whose
        limits differ meet in the window, or mismatch), the ranks' agreed one on GPUs."""
        return self.small_bytes if kind == "host" else self._gpu_small

    def _via_host(self, kind: str, nbytes: int) -> bool:
        """Whether a collective of ``nbytes`` (the whole buffer: x, or all_gather's out) of ``kind``
        arrays goes through the host (collectives._through_host): GPU arrays up to the agreed
        small_bytes whose ring waits on the host anyway, not a ring kernel's (whose calls only queue
        the kernel and return; as chosen at set-up, the same on every rank), on 2 or more ranks."""
        return kind != "host" and 1 < self.size and nbytes <= self._gpu_small and not self._transport(kind).kernel

    def _device(self, kind: str, stream: Any) -> Any:
        return self._host if kind == "host" else devices.get(kind, stream)

    def _in_ring(self, bounds: Bounds) -> Bounds:
        """``bounds`` by MPI rank (shards) as the schedule's chunks by ring place."""
        return bounds if self._ring_is_identity else schedule.in_ring_order(bounds, self.ring)

    def _scratch_array(self, kind: Any, device: Any, count: int, dtype: np.dtype, pinned: bool = False) -> Any:
        """A scratch array of ``count`` elements over one reused buffer per ``kind`` (grown when
        needed; ``pinned``: pinned host memory), ordered after its use by the previous call; call
        :meth:`_scratch_done` after the call's last use of it.

        In a CUDA graph capture (the device's stream captures) a new array instead, the graph's
        own: kept while the communicator lives, since every replay writes it; no event orders it
        (a capture may not wait on work outside it), the replays are ordered by their stream."""
        if device.stream is not None and device.stream.is_capturing():
            buf = device.empty(count, dtype)
            self._graph_scratch.append(buf)
            return buf
        reused = self._scratch.get(kind)
        if reused is None:
            reused = self._scratch[kind] = devices.Reused(pinned)
        return reused.take(device, count * np.dtype(dtype).itemsize, dtype)

    def _scratch_done(self, kind: Any, device: Any) -> None:
        if device.stream is None or not device.stream.is_capturing():
            self._scratch[kind].done(device)

    def _poll_executors(self) -> None:
        """Take the first failure a ring kernel recorded as the late error (ringcomm.executor)."""
        if self._late_error is None:
            for ex in self._executors.values():
                error = ex.failure()
                if error is not None:
                    self._late_error = error
                    return

    def _executor(self, device: Any, link: Any) -> Any:
        """The ring executor on ``device``'s GPU (made with the link; for another GPU on its first
        use there: collective)."""
        ex = self._executors.get(device.device_id)
        if ex is None:
            from .executor import RingExecutor

            ex = self._executors[device.device_id] = self._guarded(lambda: RingExecutor(self, link.channels, link.mesh))
        return ex

    def _usable(self) -> None:
        if self._executors:
            self._poll_executors()
        if self._late_error is not None:
            self.check_errors()
        if self._aborted:
            raise RingcommError(
                f"this communicator was aborted by an earlier error ({self._aborted}); create a new one"
            )

    def _guarded(self, fn: Any) -> Any:
        """Run the exchange ``fn``; a timeout aborts the communicator (a message may still be pending).

        A MismatchError (or a NotCoResident) does not: it is raised alike on every rank before any data moved.
        """
        try:
            return fn()
        except (MismatchError, NotCoResident):
            raise
        except RingcommError as e:
            self._abort(e)
            raise
        except MPI.Exception as e:  # no raw MPI error leaves a collective
            error = RingcommError(f"MPI error on rank {self.rank}: {e.Get_error_string()}")
            self._abort(error)
            raise error from e

    # ------------------------------------------------------------------ aborts and mismatches
    def _abort(self, error: BaseException) -> None:
        """Mark the communicator aborted and tell both ring neighbours, which do the same (once)."""
        if self._aborted:
            return
        self._aborted = f"{type(error).__name__}: {error}"
        if self.size == 1:
            return
        origin, reason = (error.origin, error.reason) if isinstance(error, AbortError) else (self.rank, self._aborted)
        note = np.zeros(ABORT_BYTES, np.uint8)
        note[:16].view(np.int64)[:] = origin, self._id
        text = reason.encode("utf-8", "replace")[: ABORT_BYTES - 16]
        note[16 : 16 + len(text)] = np.frombuffer(text, np.uint8)
        for peer in {self.left, self.right}:
            try:
                self._abort_sent.append((note, self.mpi.Isend(note, peer, tags.ABORT)))
            except MPI.Exception:  # the first error is the one to report
                pass

    def _watch(self, ctx: Context, step: int | None, peer: int) -> None:
        """Called by every wait that lasts (transports.base.wait_until), every few milliseconds.

        Raises AbortError when a neighbour aborted (after passing it on), and MismatchError when a
        neighbour sent a message that this call cannot receive: a tag not of ``ctx.expect`` (another
        collective, dtype, op, root or channel; in the shared-memory window, any) from this call or
        an earlier one, or when a rank is in the window for this call or an earlier one while this
        rank waits outside it (SharedWindow.watch). A message of a later call is no evidence (a
        neighbour may be one call ahead); the wait goes on.
        """
        if not self._ready or self.size == 1 or self._aborted == _CLOSED:
            return
        st, neighbours = self._probe, (self.left, self.right) if self.left != self.right else (self.left,)
        for nb in neighbours:
            while self.mpi.Iprobe(nb, tags.ABORT, st):
                note = np.zeros(ABORT_BYTES, np.uint8)
                self.mpi.Recv(note, nb, tags.ABORT)
                origin, of = (int(v) for v in note[:16].view(np.int64))
                if of != self._id:  # sent to a communicator closed since, whose MPI context this one reuses
                    continue
                reason = bytes(note[16:]).rstrip(b"\0").decode("utf-8", "replace")
                error = AbortError(ctx.collective, step, self.rank, peer, origin, reason)
                self._abort(error)
                raise error
        if self._shared is not None and ctx.call:  # a rank in the window for this call, this one outside it
            self._shared.watch(ctx, step, peer)
        if not ctx.expect:
            return
        layout = self._layout
        for nb in neighbours:
            if self.mpi.Iprobe(nb, MPI.ANY_TAG, st):
                tag = st.Get_tag()
                if tag in ctx.expect or tag == tags.ABORT or layout.later(tag, ctx.call):
                    continue
                at = "during set-up" if step is None else f"at step {step}"
                raise MismatchError(
                    f"{ctx.collective}: rank {nb} sent a message of {layout.describe(tag, ctx.call)}, but rank "
                    f"{self.rank} is in {layout.describe(ctx.expect[0], ctx.call)} ({at}, waiting for rank {peer}): "
                    "the ranks did not make the same call"
                )

    def _agree(self, ctx: Context, kind: str, count: int, root: int, extra: int = 0) -> np.ndarray:
        """Exchange (call number, collective, count, dtype, op, root, extra) with every rank.

        Returns the gathered table (one row per rank). Raises MismatchError, on every rank alike,
        when ranks disagree on anything but ``extra``.
        """
        self._seq += 1
        mine = np.array(
            [
                self._seq,
                _KINDS.index(kind),
                count,
                tags.dtype_code(ctx.dtype, ctx.wide),
                _OPS.index(ctx.op),
                root,
                extra,
            ],
            np.int64,
        )
        table = self._allgather_ints(ctx, mine, "argument agreement")
        names = ("call number", "collective", "count", "dtype", "op", "root")
        show = (int, lambda i: _KINDS[i], int, tags.dtype_name, lambda i: _OPS[i], int)
        for j, (name, fmt) in enumerate(zip(names, show)):
            if (table[:, j] != table[0, j]).any():
                values = ", ".join(f"rank {r}: {fmt(int(v))}" for r, v in enumerate(table[:, j]))
                # The ranks' small all-reduce caches may now differ (each made the entry of its own
                # call), and persistent collectives match in init order: start them afresh, alike
                # on every rank (all of them raise here).
                self._free_gathers()
                self._gather_mpi.Free()
                self._gather_mpi = self._guarded(lambda: self._dup(self.mpi, ctx))
                raise MismatchError(f"{ctx.collective}: ranks disagree on the {name} ({values})")
        return table

    def _dup(self, comm: MPI.Intracomm, ctx: Context) -> MPI.Intracomm:
        """``comm`` duplicated (MPI_Comm_idup under the deadline: a missing peer is a TimeoutError)."""
        dup, request = comm.Idup()
        wait([request], ctx, None, (self.rank - 1) % self.size, "duplicating the MPI communicator")
        return dup

    def _allgather_ints(self, ctx: Context, mine: Any, what: str) -> np.ndarray:
        """Every rank's int64 values ``mine`` (one row per rank), under the deadline."""
        mine = np.ascontiguousarray(mine, np.int64)
        table = np.empty((self.size, mine.size), np.int64)
        request = self.mpi.Iallgather(mine, table)
        try:
            wait([request], ctx, None, self.left, what)
        except BaseException:  # a late peer may still complete it: its buffers must outlive this call
            abandon(request, mine, table)
            raise
        return table

    def _run(
        self,
        ctx: Context,
        kind: str,
        count: int,
        steps: Any,
        bounds: Bounds,
        work: Any,
        src: Any,
        result_chunks: Any = (),
        root: int = -1,
        agreed: bool = False,
        own: Any = None,
    ) -> Any:
        """Run one collective's schedule through the engine. ``count``: the user's element count.
        Returns the cached plan that ran (the shared-memory window's, or a Plan or DirectPlan bound
        to the buffers' addresses: ``plan.by_address``), else None.

        On the host with a shared-memory window, all-reduces, broadcasts and all-gathers that fit
        it run there, with no message (:meth:`_window_plan`; a reduce-scatter and a reduce look for
        their plan first). Else, on the host, buffers up to PLAN_BYTES run a cached
        :class:`ringcomm.engine.Plan` (found by the collective, root, dtype, chunk bounds and the
        buffers' addresses); an all-reduce of 3 or more ranks on one node runs a
        :class:`ringcomm.engine.DirectPlan` instead (2 rounds of direct messages, bitwise the
        ring's result; a reduce-scatter its first round alone). With ``ctx.wide``
        (accumulate="float32" on a half type) the partial sums live in :meth:`_partial_sums`
        (``ctx.acc``) for the call, and the engine's loop runs. GPU arrays on a ring whose every edge
        is "kernel" (RINGCOMM_TRANSPORT=kernel) run as one kernel (ringcomm.executor) instead of the
        engine's loop; ``own`` (a kernel ring's only: executor.RingExecutor.run's) puts this rank's chunk
        in an array of its own, so that the collective queues no copy around the kernel."""
        link = self._transport(kind)
        if ctx.wide:
            ctx.acc = self._partial_sums(kind, ctx.device, count)
        elif (plan := self._window_plan(ctx, kind, count, steps, bounds, root)) is not None:
            self._launch(ctx, count, root, agreed, plan.algorithm, link, plan.steps, plan.run, work, src)
            return plan
        elif kind == "host" and work.nbytes <= PLAN_BYTES and self.size > 1:
            direct = (
                ctx.collective in ("all_reduce", "reduce_scatter")
                and self.size > 2
                and self.single_node
                and link.direct(ctx)
            )
            at = span(work)[0]
            key = (ctx.collective, root, ctx.dtype, bounds, at, at if src is work else span(src)[0])
            plan = self._plans.get(key)
            if plan is None:
                made = (
                    DirectPlan(ctx, bounds, work, src, link)
                    if direct
                    else Plan(ctx, steps, bounds, work, src, link, result_chunks)
                )
                plan = self._cache(key, made)
            algorithm, nsteps = (
                ("direct", 2 if ctx.collective == "all_reduce" else 1) if direct else (_schedule_name(ctx), len(steps))
            )
            self._launch(ctx, count, root, agreed, algorithm, link, nsteps, plan.run, work, src)
            return plan
        if kind != "host" and link.kernel:  # one kernel runs every step (ringcomm.executor)
            ex = self._executor(ctx.device, link)
            run, algorithm = ex.run, ex.algorithm(ctx, bounds, _schedule_name(ctx))
            args = (steps, bounds, work, src, result_chunks, own)
            nsteps = 1 if ex.one_shot(ctx, bounds) else len(steps)
            self._launch(ctx, count, root, agreed, algorithm, link, nsteps, run, *args)
        else:
            assert own is None, "own: a ring kernel's only"
            args = (steps, bounds, work, src, link, result_chunks)
            self._launch(ctx, count, root, agreed, _schedule_name(ctx), link, len(steps), execute, *args)
        if ctx.wide:
            self._scratch_done((kind, "partial sums"), ctx.device)
        return None

    def _window_plan(self, ctx: Context, kind: str, count: int, steps: Any, bounds: Bounds, root: int) -> Any:
        """The cached plan of a host call that fits the shared-memory window (:meth:`_window_limit`),
        or None: engine.SharedDirectPlan for an all-reduce, else engine.SharedPlacesPlan (whose
        reduce-scatter folds into ``work``, this rank's shard: collectives.reduce_scatter). Bound to
        the window, not to addresses: found by the collective, root, dtype and ``bounds``."""
        window = self._shared
        if kind != "host" or window is None:
            return None
        key = (ctx.collective, root, ctx.dtype, bounds, "shared")
        plan = self._plans.get(key)  # (made only for a call that fits: the window's sizes never change)
        if plan is None:
            place = _place(ctx.collective, bounds, count)
            if place * ctx.dtype.itemsize > self._window_limit(ctx.collective) or count >= transports.shm.COUNT_LIMIT:
                return None
            if ctx.collective == "all_reduce":
                made = SharedDirectPlan(ctx, bounds, SharedDirect(self, window, ctx.dtype, count, bounds))
            else:
                places = SharedPlaces(window, ctx.dtype, count, place)
                made = SharedPlacesPlan(ctx, bounds, places, root, sent_bytes(steps, bounds, ctx.dtype.itemsize))
            plan = self._cache(key, made)
        return plan

    def _window_limit(self, collective: str) -> float:
        """The most bytes a host ``collective`` writes into a rank's place in the shared-memory
        window (:func:`_place`; there is one): an all-reduce of any size when the inbox holds N
        runs of SHARED_PIECE_BYTES (in pieces beyond the inbox), else up to the inbox
        (engine.SharedDirectPlan; smaller ones gather in its slots), an all-gather's shard and a
        reduce-scatter's or a reduce's buffer up to its inbox, a broadcast up to its slots and at 3
        or more ranks up to its inbox (engine.SharedPlacesPlan); at 2 ranks an all-gather and a
        broadcast at most SHARED_PAIR_LIMITS; ``math.inf``: no limit. (Measured on 2 cores against
        the ring at N = 2 from 128 KiB to 2 MiB: reduce-scatters 1.3-2.1x MPICH against 0.85-1.1x,
        and at 4 MiB 1.20/0.95 against 0.85/0.79 (out / in place); a broadcast against the chain at N = 4,
        1.5-3x faster from 128 KiB to 2 MiB, the N - 1 copies out side by side; a reduce against the chain: 2-3x
        faster up to 32 KiB at N = 2 and 4, 1.3-2x from 32 KiB to 2 MiB at N = 2 and 3, at N = 4
        from 32 KiB to 2 MiB, and even at 4 MiB, where the root's fold of four buffers on one core
        meets the chain's folds spread over the ranks, as at N = 2.)"""
        window = self._shared
        if collective == "all_reduce":
            return math.inf if window.direct // self.size >= SHARED_PIECE_BYTES else window.direct
        elif collective == "broadcast" and self.size == 2:
            limit = window.small
        else:
            limit = max(window.small, window.direct)
        return min(limit, SHARED_PAIR_LIMITS.get(collective, limit)) if self.size == 2 else limit

    def _partial_sums(self, kind: str, device: Any, count: int) -> Any:
        """The float32 scratch (``count`` elements) where accumulate="float32" keeps partial sums;
        call ``_scratch_done((kind, "partial sums"), device)`` after the call's last use."""
        return self._scratch_array((kind, "partial sums"), device, count, np.dtype(np.float32))

    def _gather_plan(self, ctx: Context, count: int) -> GatherFold:
        """The cached small all-reduce of host arrays (engine.GatherFold) of ``count`` elements of
        ctx's dtype.

        The blocks meet in the shared-memory window when every rank is on this node and they fit
        (transports.shm.SharedBlocks), else in one persistent MPI_Allgather
        (transports.mpi.GatheredBlocks, on a communicator of its own). (Small GPU all-reduces go
        through the host, collectives._through_host, or run in a ring kernel.)
        """
        key = ("host", count, ctx.dtype)
        small = self._gathers.get(key)
        if small is None:
            if len(self._gathers) >= GATHER_LIMIT:
                self._free_gathers()
            n, ring = self.size, self.ring
            shared = self._shared
            if shared is not None:  # (within its slots: collectives.all_reduce)
                gather = SharedBlocks(self, shared, ctx.dtype, count)
                sides = [(mine, [blocks[rank] for rank in ring]) for mine, blocks in zip(gather.mine, gather.blocks)]
                algorithm, made = "gather-fold (shared memory)", SharedGatherFold
            else:
                gather = GatheredBlocks(self, self._gather_mpi, ctx.dtype, count)
                sides = [(gather.mine, [gather.blocks[rank] for rank in ring])]
                algorithm, made = "gather-fold (MPI_Allgather_init)", GatherFold
            small = made(
                gather, sides, self._in_ring(schedule.partition(count, n)), n, algorithm, self._transport("host")
            )
            self._gathers[key] = small
        return small

    def _cache(self, key: tuple, plan: Any) -> Any:
        """Keep the ring plan under ``key``, within PLAN_LIMIT and PLAN_CACHE_BYTES."""
        if len(self._plans) >= PLAN_LIMIT or self._plan_bytes + plan.nbytes > PLAN_CACHE_BYTES:
            self._free_plans()
        self._plans[key] = plan
        self._plan_bytes += plan.nbytes
        return plan

    def _free_plans(self) -> None:
        for plan in self._plans.values():
            plan.free()
        self._plans.clear()
        self._lanes.clear()
        self._plan_bytes = 0

    def _free_gathers(self) -> None:
        for small in self._gathers.values():
            small.free()
        self._gathers.clear()

    def _launch(
        self,
        ctx: Context,
        count: int,
        root: int,
        agreed: bool,
        algorithm: str,
        link: Any,
        nsteps: int,
        run: Any,
        *args: Any,
    ) -> None:
        """The agreement check (if enabled and not ``agreed`` already), the call's identity (its
        number and message tag), the DEBUG log line, then :meth:`_execute` of ``run(ctx, *args)``."""
        if self.check and not agreed:
            self._guarded(lambda: self._agree(ctx, ctx.collective, count, root))
        self._calls += 1
        ctx.call, ctx.root = self._calls, root
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: rank %d/%d call %d count=%d dtype=%s op=%s algorithm=%s transport=%s device=%s steps=%d ring=%s",
                ctx.collective,
                self.rank,
                self.size,
                ctx.call,
                count,
                ctx.dtype,
                ctx.op,
                algorithm,
                link.name,
                ctx.device.name,
                nsteps,
                link.describe(),
            )
        self._execute(ctx, run, *args)

    def _execute(self, ctx: Context, run: Any, *args: Any) -> None:
        """``run(ctx, *args)``, which returns the payload bytes sent; any error in it aborts the
        communicator, and the neighbours are told (:meth:`_failed`). (Called by _launch; all_reduce's
        fast lane numbers and runs its call itself: collectives._small_host.)"""
        try:
            self.bytes_sent += run(ctx, *args)
        except BaseException as e:
            self._failed(ctx, e)

    def _failed(self, ctx: Context, e: BaseException) -> None:
        """Called in the handler of the error ``e`` of a running call: abort the communicator (data
        may be in flight: it cannot be trusted again) and raise ``e``, an MPI error as a RingcommError."""
        if isinstance(e, MPI.Exception):  # no raw MPI error leaves a collective
            error = RingcommError(
                f"{ctx.collective} call {ctx.call}: MPI error on rank {self.rank}: {e.Get_error_string()}"
            )
            self._abort(error)
            raise error from e
        self._abort(e)
        raise  # (the handled error, e: its traceback keeps the frames where it was raised)


def _place(collective: str, bounds: Bounds, count: int) -> int:
    """The elements a rank's place in the shared-memory window holds for a call of ``collective``
    on ``count`` elements cut into ``bounds``: an all-gather's largest shard, else the whole buffer."""
    return max(hi - lo for lo, hi in bounds) if collective == "all_gather" else count


def _node_labels(raw: str, size: int) -> tuple[str, ...]:
    """RINGCOMM_NODES: one non-empty label per rank, comma-separated (e.g. "a,b,a,b")."""
    labels = tuple(label.strip() for label in raw.split(","))
    if len(labels) != size:
        raise ValueError(f"needs one node label per rank ({size}), comma-separated; got {len(labels)}")
    if not all(labels):
        raise ValueError("a node label is empty")
    return labels


def _shm_free() -> int:
    """The free bytes of /dev/shm, where MPI maps shared memory (0 when it cannot be read; MPICH's
    window is a file there, seen in /proc/self/maps as /dev/shm/mpich_shar_tmp*). The window's
    pages are touched at creation, so only a /dev/shm filled by others after the check can still
    fail later (with SIGBUS, as for MPI's own shared memory)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _cores() -> int:
    """The processors this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _window_bytes(n: int, small_bytes: int, free: int) -> tuple[int, int] | None:
    """The shared-memory window's (slot, direct) data bytes for ``n`` ranks, or None: slots of
    small_bytes (at most SHARED_SMALL_BYTES), an inbox of SHARED_BYTES, halved until all regions
    together fit SHARED_TOTAL_BYTES and a quarter of ``free``; without slots or inbox, no window.
    (Measured on 2 cores: a reduce-scatter at N = 2 beats the ring by 1.2-1.4x at 4 MiB; the
    all-reduce's pieces: SHARED_PIECE_BYTES.)"""
    budget = min(SHARED_TOTAL_BYTES, free // 4)
    small, direct = min(small_bytes, SHARED_SMALL_BYTES), SHARED_BYTES
    while direct and n * region_bytes(n, small, direct) > budget:
        direct = direct // 2 if direct > 64 << 10 else 0
    if n * region_bytes(n, small, direct) > budget:
        small = 0
    return (small, direct) if small or direct else None


def init(**options: Any) -> Communicator:
    """A Communicator over mpi4py's COMM_WORLD (MPI is initialised by importing mpi4py.MPI).

    ``options`` are the Communicator's keyword arguments (timeout, check, slice_bytes, small_bytes).
    """
    return Communicator(MPI.COMM_WORLD, **options)
