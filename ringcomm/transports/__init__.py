"""Transports move a chunk from the left neighbour; they never decide which chunk moves.

Protocol (used by :func:`ringcomm.engine.execute`): ``begin(ctx, work, src, bounds)``,
``post(step, send, recv_count, recv_into, recv_dtype)`` (``recv_dtype``: what the incoming chunk is
made of, float32 for partial sums under accumulate="float32", else the call's dtype), ``recv(step)``
yielding ``(lo, hi, incoming)`` pieces, ``step_done(step)``, ``end()``, ``abort()``, ``close()``.
Every message's tag is the call's (``ctx.identity() | channel``, ringcomm.tags), and the transport
sets ``ctx.expect`` to the tags its messages of this call may carry. See transports/mpi.py for the
reference one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .mpi import MpiTransport

log = logging.getLogger("ringcomm")

#: the names RINGCOMM_TRANSPORT accepts
NAMES = ("mpi", "ipc", "staged")


def override() -> str:
    """The transport named by RINGCOMM_TRANSPORT ("" when unset); ValueError for an unknown name."""
    name = os.environ.get("RINGCOMM_TRANSPORT", "").strip().lower()
    if name and name not in NAMES:
        raise ValueError(f"RINGCOMM_TRANSPORT={name!r} is not a transport; accepted: {', '.join(NAMES)}")
    return name


def select(comm: Any, kind: str) -> Any:
    """A new transport for arrays of ``kind`` ("host" or "cuda") on ``comm``.

    Host arrays always travel by MPI. ``RINGCOMM_TRANSPORT`` overrides the automatic choice for GPU
    arrays (ipc, staged, or mpi for CUDA-aware MPI).
    """
    name = override()
    if kind == "host":
        return MpiTransport(comm, comm.slice_bytes)
    if kind == "cuda":
        return _select_cuda(comm, name)
    raise ValueError(f"no transport for arrays of kind {kind!r}")


def _select_cuda(comm: Any, name: str) -> Any:
    """GPU arrays: CUDA IPC when every rank is on this node, else CUDA-aware MPI, else staged.

    ``name`` (from RINGCOMM_TRANSPORT) forces one. The IPC transport itself falls back to staged,
    on every rank alike and with a warning, when its set-up fails.
    """
    from .ipc import IpcTransport
    from .staged import StagedTransport, cuda_aware_mpi

    aware = cuda_aware_mpi()
    choice = name or ("ipc" if comm.single_node else "mpi" if aware else "staged")
    if choice == "mpi" and not aware:
        raise ValueError(
            "RINGCOMM_TRANSPORT=mpi with GPU arrays needs a CUDA-aware MPI, and this one does not say it is "
            "(MPIX_Query_cuda_support); set RINGCOMM_CUDA_AWARE_MPI=1 if it is, or use ipc or staged"
        )
    log.debug(
        "cuda transport for rank %d/%d: %s (single node: %s, CUDA-aware MPI: %s, RINGCOMM_TRANSPORT=%r)",
        comm.rank, comm.size, choice, comm.single_node, aware, name,
    )
    if choice == "ipc":
        return IpcTransport(comm)
    if choice == "staged":
        return StagedTransport(comm)
    return MpiTransport(comm, comm.slice_bytes, name="mpi")
