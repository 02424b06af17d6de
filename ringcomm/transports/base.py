"""What every transport shares: the deadline wait, and byte views of arrays."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from ..errors import MismatchError, TimeoutError

BYTE = MPI.BYTE

#: how often a wait that lasts looks for an abort from a neighbour or a message of another call (s)
WATCH_INTERVAL = 0.002


def wait_until(done: Callable[[], bool], ctx: Any, step: int | None, peer: int, what: str, *args: Any) -> None:
    """Poll ``done()`` until it is true, or raise :class:`ringcomm.TimeoutError` after ``ctx.comm.timeout`` s.

    Yields the processor between polls (``os.sched_yield``, not ``time.sleep(0)``, which pays the
    kernel's timer slack of ~50 us): when ranks outnumber cores, the rank being waited for gets the
    core at once (measured: 8 B all-reduce at 4 ranks on 2 cores, 41 us instead of 73 us with 50
    spins first), and alone on a core the yield returns at once. Every wait gets the whole timeout.
    A wait that lasts also watches, every WATCH_INTERVAL seconds and once more before it times
    out, for an abort from a neighbour (AbortError) and for a message from ``peer`` that belongs
    to another call (MismatchError): ``Communicator._watch``. The error names the collective, the
    step, this rank and ``peer``; ``what % args`` says what was awaited (formatted only then).
    """
    polls = 0
    deadline = watch_at = None
    watch = getattr(ctx.comm, "_watch", None)
    while not done():
        os.sched_yield()
        polls += 1
        if polls & 15 == 0:
            now = time.monotonic()
            if deadline is None:
                deadline, watch_at = now + ctx.comm.timeout, now + WATCH_INTERVAL
            elif now > watch_at:
                watch_at = now + WATCH_INTERVAL
                if watch is not None:
                    watch(ctx, step, peer)
                if now > deadline:
                    if done():
                        return
                    raise TimeoutError(ctx.collective, step, ctx.comm.rank, peer, ctx.comm.timeout, what % args)


def wait(
    requests: Sequence[MPI.Request],
    ctx: Any,
    step: int | None,
    peer: int,
    what: str,
    *args: Any,
    sizes: Sequence[int | None] | None = None,
    statuses: list[MPI.Status] | None = None,
) -> None:
    """Complete the MPI ``requests`` (MPI_Testall also drives MPI's progress) within the timeout.

    ``sizes``: the bytes each request must receive (None for sends): a message of another size is
    a MismatchError naming the collective, step, peer and both sizes (``statuses``: preallocated
    MPI.Status objects to use, one per request). On an error the requests are left as they are:
    the transport's ``abort()`` cancels what it posted (:func:`cancel`).
    """
    if sizes is None:
        if len(requests) == 1:  # MPI_Test: MPICH 5.0's MPI_Testall fails a completed persistent
            req = requests[0]  # collective with MPI_ERR_IN_STATUS (its status says MPI_SUCCESS)
            if not req.Test():
                wait_until(req.Test, ctx, step, peer, what, *args)
        elif not MPI.Request.Testall(requests):
            wait_until(lambda: MPI.Request.Testall(requests), ctx, step, peer, what, *args)
        return
    if statuses is None:
        statuses = [MPI.Status() for _ in requests]
    # One request is tested alone (MPI_Test), so that if it completes with an error (a truncated
    # message) it is freed and its handle nulled, and nothing touches it again (cancel() skips
    # it). Several requests at once must be persistent ones (they are never freed by a test).
    try:
        if len(requests) == 1:
            req, st = requests[0], statuses[0]
            if not req.Test(st):
                wait_until(lambda: req.Test(st), ctx, step, peer, what, *args)
        elif not MPI.Request.Testall(requests, statuses):
            wait_until(lambda: MPI.Request.Testall(requests, statuses), ctx, step, peer, what, *args)
    except MPI.Exception as e:  # a message longer than its receive: MPI_ERR_TRUNCATE (in its status, for Testall)
        error = MPI.Get_error_class(e.Get_error_code())
        for st, size in zip(statuses, sizes):
            if size is not None and MPI.ERR_TRUNCATE in (error, MPI.Get_error_class(st.Get_error())):
                raise _size_mismatch(ctx, step, peer, what % args, size, f"more than {size}") from None
        raise
    for st, size in zip(statuses, sizes):
        if size is not None and st.Get_count(BYTE) != size:
            raise _size_mismatch(ctx, step, peer, what % args, size, str(st.Get_count(BYTE)))


def _size_mismatch(ctx: Any, step: int | None, peer: int, what: str, expected: int, got: str) -> MismatchError:
    at = "during set-up" if step is None else f"at step {step}"
    return MismatchError(
        f"{ctx.collective} call {ctx.call}: rank {ctx.comm.rank} expected a message of {expected} bytes from rank "
        f"{peer} {at} ({what}) and got {got} bytes: the ranks disagree on the count or the dtype"
    )


#: requests left outstanding by an error, and their buffers, kept referenced for the life of the
#: process: sends (MPICH crashes cancelling a send that its receiver has not matched, and MPI 4.1
#: deprecates MPI_Cancel for sends) and collectives (they cannot be cancelled), which a late peer
#: may still complete
_abandoned: list = []


def abandon(request: MPI.Request, *buffers: Any) -> None:
    """Keep ``request`` and the buffers it reads or writes alive (see _abandoned)."""
    _abandoned.append((request, buffers))


def cancel(recvs: Sequence[MPI.Request], sends: Sequence[MPI.Request] = ()) -> None:
    """After an error: cancel the outstanding receives (MPI writes no more into their buffers once
    cancelled) and leave the outstanding sends be (see _abandoned), without waiting."""
    for req in recvs:
        if req != MPI.REQUEST_NULL:
            try:
                req.Cancel()
                req.Test()
            except MPI.Exception:
                pass
    for req in sends:
        if req != MPI.REQUEST_NULL:
            abandon(req)


def slices(count: int, per_slice: int) -> list[tuple[int, int]]:
    """Cut ``count`` elements into consecutive (lo, hi) pieces of at most ``per_slice`` elements."""
    return [(lo, min(count, lo + per_slice)) for lo in range(0, count, per_slice)]


def as_bytes(a: Any) -> Any:
    """A 1-D uint8 view of the contiguous array ``a`` (numpy or CuPy), so MPI moves raw bytes."""
    return a.view("u1")
