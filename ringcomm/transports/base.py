"""What every transport shares: the deadline wait, and byte views of arrays."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from ..errors import TimeoutError

def wait_until(done: Callable[[], bool], ctx: Any, step: int | None, peer: int, what: str, *args: Any) -> None:
    """Poll ``done()`` until it is true, or raise :class:`ringcomm.TimeoutError` after ``ctx.comm.timeout`` s.

    Yields the processor between polls (``os.sched_yield``, not ``time.sleep(0)``, which pays the
    kernel's timer slack of ~50 us): when ranks outnumber cores, the rank being waited for gets the
    core at once (measured: 8 B all-reduce at 4 ranks on 2 cores, 41 us instead of 73 us with 50
    spins first), and alone on a core the yield returns at once. Every wait gets the whole timeout.
    The error names the collective, the step, this rank and ``peer``; ``what % args`` says what was
    awaited (formatted only then).
    """
    polls = 0
    deadline = None
    while not done():
        os.sched_yield()
        polls += 1
        if polls & 255 == 0:
            now = time.monotonic()
            if deadline is None:
                deadline = now + ctx.comm.timeout
            elif now > deadline:
                raise TimeoutError(ctx.collective, step, ctx.comm.rank, peer, ctx.comm.timeout, what % args)


def wait(requests: Sequence[MPI.Request], ctx: Any, step: int | None, peer: int, what: str, *args: Any) -> None:
    """Complete the MPI ``requests`` (MPI_Testall also drives MPI's progress) within the timeout.

    On a timeout the requests are cancelled before :class:`ringcomm.TimeoutError` propagates.
    """
    if MPI.Request.Testall(requests):
        return
    try:
        wait_until(lambda: MPI.Request.Testall(requests), ctx, step, peer, what, *args)
    except TimeoutError:
        cancel(requests)
        raise


def cancel(requests: Sequence[MPI.Request]) -> None:
    """Cancel whatever is still outstanding, without waiting (the communicator is aborted after)."""
    for req in requests:
        if req != MPI.REQUEST_NULL:
            try:
                req.Cancel()
            except MPI.Exception:
                pass


def slices(count: int, per_slice: int) -> list[tuple[int, int]]:
    """Cut ``count`` elements into consecutive (lo, hi) pieces of at most ``per_slice`` elements."""
    return [(lo, min(count, lo + per_slice)) for lo in range(0, count, per_slice)]


def as_bytes(a: Any) -> Any:
    """A 1-D uint8 view of the contiguous array ``a`` (numpy or CuPy), so MPI moves raw bytes."""
    return a.view("u1")
