"""MPI transport: chunks travel between ring neighbours by nonblocking MPI point-to-point.

Each chunk is cut into slices of ``slice_bytes`` so that a large chunk is not one message and the
reduction of a slice follows its arrival while it is still in cache. A reduce step receives into a
scratch buffer (allocated once per communicator, grown when a larger chunk comes); a copy step
receives straight into its destination. Buffers may be host arrays or, when the MPI library is
CUDA-aware, device arrays (the device is synchronized before a chunk it produced is sent).

Latency: when the collective says its buffers are the communicator's own small scratch
(``ctx.stable``), the messages are persistent requests, made once (MPI_Send_init/Recv_init, keyed
by address, size and peer) and restarted on every call, which saves about a microsecond a message.

Ordering: MPI's non-overtaking rule orders the slices and the steps between two neighbours (one
tag, receives posted in the order the sends are made), and a send is complete before the step ends,
so the read-after-write and write-after-read hazards of DESIGN.md are both met by MPI itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mpi4py import MPI

from .base import as_bytes, cancel, wait

TAG = 17
#: persistent requests kept (when more, all are freed before the next collective)
PERSISTENT_LIMIT = 256


class MpiTransport:
    """Point-to-point MPI between ring neighbours (host memory, or device memory if CUDA-aware)."""

    def __init__(self, comm: Any, slice_bytes: int, name: str = "mpi") -> None:
        self.comm, self.slice_bytes, self.name = comm, slice_bytes, name
        self._scratch = None  # raw uint8 scratch for reduce steps, reused across calls
        self._sends: list = []
        self._recvs: list = []
        self._persistent: dict[tuple[int, int, int, bool], MPI.Prequest] = {}

    def begin(self, ctx: Any, work: Any, src: Any, bounds: list[tuple[int, int]]) -> None:
        self.ctx, self.device = ctx, ctx.device
        self._on_host = self.device.name == "host"
        self._stable = ctx.stable and self._on_host
        if len(self._persistent) >= PERSISTENT_LIMIT:  # only between collectives: none is active now
            self._free_persistent()
        self._per_slice = max(1, self.slice_bytes // work.itemsize)

    def post(self, step: Any, send: Any, recv_count: int, recv_into: Any) -> None:
        per = self._per_slice
        if recv_count:
            if recv_into is None:
                dtype = self.ctx.dtype
                need = recv_count * dtype.itemsize
                if self._scratch is None or self._scratch.size < need:  # grows once, then reused
                    self._scratch = self.device.empty(need, "u1")
                dst = self._scratch[:need].view(dtype)
            else:
                dst = recv_into
            self._in_place = recv_into is not None
            left = self.comm.left
            for lo in range(0, recv_count, per):
                piece = dst[lo : lo + per]
                self._recvs.append((lo, lo + piece.size, piece, self._start(piece, left, False)))
        if send is not None and send.size:
            if not self._on_host:
                self.device.synchronize()  # the chunk may still be in flight on the stream
            right = self.comm.right
            for lo in range(0, send.size, per):
                self._sends.append(self._start(send[lo : lo + per], right, True))

    def _start(self, buf: Any, peer: int, send: bool) -> MPI.Request:
        """Start sending ``buf`` to / receiving it from ``peer``: a persistent request when stable."""
        mpi = self.comm.mpi
        if not self._stable:
            return mpi.Isend(as_bytes(buf), peer, TAG) if send else mpi.Irecv(as_bytes(buf), peer, TAG)
        key = (MPI.buffer(buf).address, buf.nbytes, peer, send)
        req = self._persistent.get(key)
        if req is None:
            req = (mpi.Send_init if send else mpi.Recv_init)(as_bytes(buf), peer, TAG)
            self._persistent[key] = req
        req.Start()
        return req

    def _free_persistent(self) -> None:
        for req in self._persistent.values():
            req.Free()
        self._persistent.clear()

    def recv(self, step: Any) -> Iterator[tuple[int, int, Any]]:
        for lo, hi, view, req in self._recvs:
            wait([req], self.ctx, step.index, self.comm.left, "receiving chunk %d", step.recv)
            yield lo, hi, None if self._in_place else view

    def step_done(self, step: Any) -> None:
        if not self._on_host and self._recvs:
            self.device.synchronize()  # the scratch is reused by the next step's receive
        if self._sends:
            wait(self._sends, self.ctx, step.index, self.comm.right, "sending chunk %d", step.send)
        self._sends, self._recvs = [], []

    def end(self) -> None:
        pass

    def close(self) -> None:
        """Free the persistent requests (the communicator is being freed)."""
        self._free_persistent()

    def abort(self) -> None:
        cancel(self._sends + [req for *_, req in self._recvs])
        self._sends, self._recvs = [], []
        self._free_persistent()  # cancelled ones cannot be restarted; the communicator is aborted
