"""What every transport shares: the deadline wait on MPI requests, and byte views of arrays."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from ..errors import TimeoutError

#: Spins of MPI_Testall before the wait starts yielding the CPU (ranks may outnumber cores).
_SPINS = 50


def wait(requests: Sequence[MPI.Request], ctx: Any, step: int | None, peer: int, what: str, *args: Any) -> None:
    """Complete ``requests`` or raise :class:`ringcomm.TimeoutError` at ``ctx.deadline``.

    Polls MPI_Testall (which also drives MPI's progress engine), spinning briefly and then yielding
    the processor between polls so that oversubscribed ranks still make progress. On expiry the
    requests are cancelled and the error names the collective, the step, this rank and ``peer``;
    ``what % args`` says what was awaited (formatted only then).
    """
    spins = 0
    while not MPI.Request.Testall(requests):
        spins += 1
        if spins > _SPINS:
            os.sched_yield()  # not time.sleep(0): that pays the kernel's timer slack (~50 us)
            if spins & 255 == 0 and time.monotonic() > ctx.deadline:
                cancel(requests)
                raise TimeoutError(ctx.collective, step, ctx.comm.rank, peer, ctx.comm.timeout, what % args)


def cancel(requests: Sequence[MPI.Request]) -> None:
    """Cancel whatever is still outstanding, without waiting (the communicator is aborted after)."""
    for req in requests:
        if req != MPI.REQUEST_NULL:
            try:
                req.Cancel()
            except MPI.Exception:
                pass


def as_bytes(a: Any) -> Any:
    """A 1-D uint8 view of the contiguous array ``a`` (numpy or CuPy), so MPI moves raw bytes."""
    return a.view("u1")
