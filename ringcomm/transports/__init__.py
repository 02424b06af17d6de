"""Transports move a chunk from the left neighbour; they never decide which chunk moves.

Protocol (used by :func:`ringcomm.engine.execute`): ``begin(ctx, work, src, bounds)``,
``post(step, send, recv_count, recv_into)``, ``recv(step)`` yielding ``(lo, hi, incoming)`` pieces,
``step_done(step)``, ``end()``, ``abort()``. See transports/mpi.py for the reference one.
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
    override()
    if kind == "host":
        return MpiTransport(comm, comm.slice_bytes)
    raise ValueError(f"no transport for arrays of kind {kind!r}")
