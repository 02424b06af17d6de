"""Transports move a chunk from the left neighbour; they never decide which chunk moves.

A transport is one ring edge's two halves: the sending end on rank r and the receiving end on the
rank after it. Each rank holds the receiving half of its left edge and the sending half of its
right edge (a :class:`Link`); they may be of different transports (the last rank of a node: IPC
in, staging out). The engine (:func:`ringcomm.engine.execute`) drives them:

- both halves: ``begin(ctx, work, src, bounds)`` (the sending half first; it must not wait for
  its neighbour there), ``step_done(step)``, ``end()``, ``abort()``, ``close()``;
- the receiving half: ``post(step, recv_count, recv_into, recv_dtype)`` (``recv_dtype``: what the
  incoming chunk is made of, float32 for partial sums under accumulate="float32", else the call's
  dtype; ``recv_into`` None for a reduce step), then ``recv(step, sender)`` yielding
  ``(lo, hi, incoming)`` pieces; before it waits for piece i it calls ``sender.pump(step, i)``;
  its ``private`` attribute says whether a reduce step's pieces are its own scratch, which the
  device may overwrite;
- the sending half: ``post(step, send, writes)`` (``writes``: this step writes this rank's
  buffer, so the right must be done reading what it was sent earlier), ``pump(step, i)`` (post at
  least the first i+1 pieces of what it sends);
- optionally ``prepare`` (persistent requests for a :class:`ringcomm.engine.Plan`); the Link's
  ``exchange`` gives messages between any ranks (engine.DirectPlan) where every edge is MPI on host
  memory.

Every message's tag is the call's (``ctx.identity() | channel``, ringcomm.tags), and each half adds
to ``ctx.expect`` the tags its neighbour's messages of this call may carry. See transports/mpi.py
for the reference transport.

Which transport an edge gets: every rank holds the same table of per-rank records (node, GPU,
the GPUs it can reach, CUDA-aware MPI, RINGCOMM_TRANSPORT) and runs the same rule on it
(:func:`edge_kind`), so both ends of an edge, and the log, agree without a negotiation round.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import MismatchError
from .mpi import Exchange, MpiRecv, MpiSend, PreparedStep

log = logging.getLogger("ringcomm")

#: the names RINGCOMM_TRANSPORT accepts ("kernel": a ring of IPC edges runs each collective as one
#: kernel, ringcomm.executor; chosen only when asked for, until it has run on a GPU)
NAMES = ("mpi", "ipc", "staged", "kernel")
#: names RINGCOMM_TRANSPORT still accepts for the transport that replaced theirs: "ipc-stream" (IPC
#: with the step handshake on the GPU's streams, removed: the ring kernel keeps the handshake on the GPU)
RENAMED = {"ipc-stream": "kernel"}
_renamed_warned: set[str] = set()  # (one FutureWarning per name and process)
#: peer GPUs a record can list (the GPUs of one node that this rank's GPU can access)
MAX_PEERS = 16


def override() -> str:
    """The transport named by RINGCOMM_TRANSPORT ("" when unset; a :data:`RENAMED` name as its
    replacement's, with a FutureWarning the first time); ValueError for an unknown name."""
    name = os.environ.get("RINGCOMM_TRANSPORT", "").strip().lower()
    if name in RENAMED:
        new = RENAMED[name]
        if name in _renamed_warned:
            return new
        _renamed_warned.add(name)
        warnings.warn(
            f"RINGCOMM_TRANSPORT={name} was removed; it now selects {new!r}, which replaced it",
            FutureWarning,
            stacklevel=3,
        )
        return new
    if name and name not in NAMES:
        raise ValueError(f"RINGCOMM_TRANSPORT={name!r} is not a transport; accepted: {', '.join(NAMES)}")
    return name


@dataclasses.dataclass(frozen=True)
class PeerRecord:
    """What one rank tells every other before GPU edges are chosen.

    ``node``: its node's index; ``gpu``: its GPU's PCI bus id as an integer (:func:`bus_id`);
    ``peers``: the bus ids of the GPUs its GPU can access (cudaDeviceCanAccessPeer); ``aware``:
    its MPI takes device buffers; ``forced``: its RINGCOMM_TRANSPORT ("" when unset); ``sms`` and
    ``mps``: its GPU's multiprocessors and whether its contexts are shared through MPS
    (cudaDevAttrMpsEnabled; read only when kernel is asked for: executor.kernel_fit).
    """

    node: int
    gpu: int
    peers: frozenset[int]
    aware: bool
    forced: str
    sms: int = 0
    mps: bool = False

    def words(self) -> np.ndarray:
        peers = sorted(self.peers)[:MAX_PEERS]
        out = np.zeros(7 + MAX_PEERS, np.int64)
        forced = (NAMES.index(self.forced) + 1) if self.forced else 0
        out[:7] = self.node, self.gpu, self.aware, forced, self.sms, self.mps, len(peers)
        out[7 : 7 + len(peers)] = peers
        return out

    @classmethod
    def from_words(cls, w: Sequence[int]) -> PeerRecord:
        w = [int(v) for v in w]
        forced = NAMES[w[3] - 1] if w[3] else ""
        return cls(w[0], w[1], frozenset(w[7 : 7 + w[6]]), bool(w[2]), forced, w[4], bool(w[5]))


def bus_id(pci: str) -> int:
    """A PCI bus id in CUDA's form "dddd:bb:dd.f" (hex) as one integer."""
    domain, bus, rest = pci.strip().split(":")
    dev, fn = rest.split(".")
    return int(domain, 16) << 24 | int(bus, 16) << 16 | int(dev, 16) << 8 | int(fn, 16)


def edge_kind(sender: PeerRecord, receiver: PeerRecord, forced: str) -> str:
    """The transport of the edge sender -> receiver for GPU arrays; the same on both ends.

    CUDA IPC when both are on one node and the receiver can read the sender's memory (one GPU
    shared, or peer access from the receiver's GPU to the sender's); else CUDA-aware MPI when both
    ends' MPI takes device buffers; else staging through host memory. ``forced`` (RINGCOMM_TRANSPORT)
    takes that transport on every edge it can serve: "staged" on all, "ipc" where IPC can, "mpi"
    on all (ValueError where an end's MPI is not CUDA-aware), "kernel" where IPC can (its halves
    are ipc's, for the calls the executor does not run).
    """
    ipc = sender.node == receiver.node and (sender.gpu == receiver.gpu or sender.gpu in receiver.peers)
    aware = sender.aware and receiver.aware
    if forced == "mpi" and not aware:
        raise ValueError(
            "RINGCOMM_TRANSPORT=mpi with GPU arrays needs a CUDA-aware MPI, and this one does not say it is "
            "(MPIX_Query_cuda_support); set RINGCOMM_CUDA_AWARE_MPI=1 if it is, or use ipc or staged"
        )
    if forced in ("mpi", "staged"):
        return forced
    if ipc and forced == "kernel":
        return "kernel"
    return "ipc" if ipc else "mpi" if aware else "staged"


def choose_edges(records: Sequence[PeerRecord], ring: Sequence[int]) -> tuple[str, ...]:
    """Every edge's transport, by ring place p (the edge ring[p-1] -> ring[p]).

    ``records``: one per rank, in MPI rank order. Raises MismatchError (on every rank alike) when
    the ranks were given different RINGCOMM_TRANSPORT values. "kernel" edges stay so only where the
    whole ring is (ringcomm.executor runs whole rings); in a ring with other edges they are "ipc"."""
    forced = {r.forced for r in records}
    if len(forced) > 1:
        values = ", ".join(f"rank {i}: {r.forced or '(unset)'}" for i, r in enumerate(records))
        raise MismatchError(f"the ranks disagree on RINGCOMM_TRANSPORT ({values})")
    force = forced.pop() if forced else ""
    n = len(ring)
    edges = tuple(edge_kind(records[ring[p - 1]], records[ring[p]], force) for p in range(n))
    if "kernel" in edges and set(edges) != {"kernel"}:  # the executor runs whole rings only: the rest is ipc
        edges = tuple("ipc" if e == "kernel" else e for e in edges)
    return edges


def describe_edges(ring: Sequence[int], edges: Sequence[str]) -> str:
    """The ring and its edges for people: "0 -ipc-> 1 -staged-> 2 -ipc-> 3 -staged-> (0)"."""
    if not ring:
        return ""
    parts = [str(ring[0])]
    for p in range(1, len(ring)):
        parts.append(f"-{edges[p]}-> {ring[p]}")
    parts.append(f"-{edges[0]}-> ({ring[0]})")
    return " ".join(parts)


class Link:
    """This rank's two halves for arrays of one kind: ``recv`` (the edge from the left) and
    ``send`` (the edge to the right); ``edges``: every edge's transport by ring place, as chosen."""

    __slots__ = ("comm", "recv", "send", "edges", "kernel", "channels", "mesh", "note")

    def __init__(
        self, comm: Any, recv: Any, send: Any, edges: tuple[str, ...], channels: int = 0, mesh: bool = False
    ) -> None:
        self.comm, self.recv, self.send, self.edges = comm, recv, send, edges
        #: whether the ring executor runs this ring's collectives: every edge "kernel", two ranks or more
        self.kernel = len(edges) > 1 and set(edges) == {"kernel"}
        #: the ring kernel's blocks per rank (executor.kernel_fit), for a kernel ring; ``mesh``: every
        #: rank can map every other rank's memory (executor.all_reach: one-shot calls may run)
        self.channels, self.mesh = channels, mesh
        #: why RINGCOMM_TRANSPORT=kernel did not give a kernel ring ("" where it did, or was not asked for)
        self.note = ""

    def keep_host_driven(self, why: str) -> None:
        """Turn a kernel ring's edges to ipc (its halves are already ipc's), saying ``why`` (a
        warning on every rank, the DEBUG log, :attr:`note`)."""
        self.edges, self.kernel, self.channels = ("ipc",) * len(self.edges), False, 0
        self.note = f"RINGCOMM_TRANSPORT=kernel, but the ring stays host-driven (ipc): {why}"
        warnings.warn(f"ringcomm: {self.note}", RuntimeWarning, stacklevel=4)
        log.warning("ringcomm on rank %d: %s", self.comm.rank, self.note)

    def current(self) -> tuple[str, ...]:
        """``edges`` with this rank's two edges as its halves now say (after an IPC fallback)."""
        if set(self.edges) == {"kernel"}:  # (its halves are ipc's, for the calls the executor does not run)
            return self.edges
        edges, p = list(self.edges), self.comm.position
        edges[p], edges[(p + 1) % len(edges)] = self.recv.name, self.send.name
        return tuple(edges)

    @property
    def name(self) -> str:
        """The transport's name when every edge has the same one, else "mixed"."""
        names = set(self.current())
        return names.pop() if len(names) == 1 else "mixed"

    def describe(self) -> str:
        return describe_edges(self.comm.ring, self.current())

    def prepare(self, ctx: Any, send: Any, recv_into: Any, tag: int) -> PreparedStep | None:
        """Persistent requests with ``tag`` for one step of a Plan (``send``: the outgoing chunk's
        view or None; ``recv_into``: where the incoming chunk lands, or None), when both halves can
        make them for these buffers (MPI halves on host memory); None otherwise."""
        make_recvs, make_sends = getattr(self.recv, "prepare", None), getattr(self.send, "prepare", None)
        if make_recvs is None or make_sends is None:
            return None
        recvs, sends = make_recvs(ctx, recv_into, tag), make_sends(ctx, send, tag)
        if recvs is None or sends is None:
            for req in [req for *_, req in recvs or ()] + (sends or []):
                req.Free()
            return None
        return PreparedStep(self.comm, recvs, sends, tag)

    def exchange(self, ctx: Any, recvs: list, sends: list, tag: int) -> Exchange:
        """Persistent requests with ``tag`` to and from any ranks (``recvs``/``sends``: ``(rank,
        view)``), for an algorithm whose messages leave the ring (engine.DirectPlan): only where
        every edge of the ring is MPI and the buffers are host memory (see :meth:`direct`)."""
        if not self.direct(ctx):
            raise ValueError("direct messages need every ring edge on MPI and host buffers")
        return Exchange(self.comm.mpi, recvs, sends, tag)

    def direct(self, ctx: Any) -> bool:
        """Whether :meth:`exchange` serves this call: host buffers, every edge MPI."""
        return ctx.device.name == "host" and all(edge == "mpi" for edge in self.edges)

    def close(self) -> None:
        """Free both halves (collective, as Communicator.close(): receiving halves go first)."""
        self.recv.close()
        self.send.close()


def _halves(comm: Any, name: str) -> tuple[type, type, tuple]:
    if name in ("ipc", "kernel"):
        from .ipc import IpcRecv, IpcSend

        return IpcRecv, IpcSend, ()
    if name == "staged":
        from .staged import StagedRecv, StagedSend

        return StagedRecv, StagedSend, ()
    return MpiRecv, MpiSend, (comm.slice_bytes,)


def select(comm: Any, kind: str) -> Link:
    """This rank's Link for arrays of ``kind`` ("host" or "cuda") on ``comm``.

    Host arrays always travel by MPI. For GPU arrays the ranks first exchange their
    :class:`PeerRecord` (collective), then every edge gets :func:`edge_kind`.
    """
    name = override()
    n, p = comm.size, comm.position
    if kind == "host":
        return Link(comm, MpiRecv(comm, comm.slice_bytes), MpiSend(comm, comm.slice_bytes), ("mpi",) * n)
    if kind != "cuda":
        raise ValueError(f"no transport for arrays of kind {kind!r}")
    records = [
        PeerRecord.from_words(row)
        for row in comm._allgather_ints(
            _setup_context(comm), gpu_record(comm, name).words(), "exchanging what every rank's GPU can reach"
        )
    ]
    edges = choose_edges(records, comm.ring)
    channels, why, mesh = 0, "", False
    if "kernel" in edges:  # (every edge: choose_edges)
        from ..executor import all_reach, kernel_fit

        (channels, why), mesh = kernel_fit(records), all_reach(records)
    recv_cls, _, recv_args = _halves(comm, edges[p])
    _, send_cls, send_args = _halves(comm, edges[(p + 1) % n])
    link = Link(comm, recv_cls(comm, *recv_args), send_cls(comm, *send_args), edges, channels, mesh)
    if why:
        link.keep_host_driven(why)
    log.debug(
        "cuda transports on rank %d/%d: receives by %s, sends by %s; ring %s (RINGCOMM_TRANSPORT=%r)",
        comm.rank,
        n,
        link.edges[p],
        link.edges[(p + 1) % n],
        link.describe(),
        name,
    )
    return link


def _setup_context(comm: Any) -> Any:
    from ..devices import HostDevice
    from ..engine import Context

    return Context("choosing GPU transports", comm, HostDevice(), np.dtype(np.uint8), None)


def gpu_record(comm: Any, forced: str) -> PeerRecord:
    """This rank's record: its node, its current CuPy device's bus id, the GPUs that device can
    access (peer access), CUDA-aware MPI, RINGCOMM_TRANSPORT (and what kernel needs: the GPU's SMs
    and MPS)."""
    import cupy

    from ..devices.cuda import mps_enabled, sm_count
    from .staged import cuda_aware_mpi

    rt = cupy.cuda.runtime
    me = rt.getDevice()
    peers = frozenset(
        bus_id(cupy.cuda.Device(d).pci_bus_id)
        for d in range(rt.getDeviceCount())
        if d != me and rt.deviceCanAccessPeer(me, d)
    )
    sms, mps = (sm_count(me), mps_enabled(me)) if forced == "kernel" else (0, False)
    bus = bus_id(cupy.cuda.Device(me).pci_bus_id)
    return PeerRecord(comm.node_index, bus, peers, cuda_aware_mpi(), forced, sms, mps)
