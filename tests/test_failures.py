"""Disagreeing ranks raise MismatchError everywhere (check=True); a missing peer gives TimeoutError."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import make_comm
from mpi4py import MPI

import ringcomm


def expect_mismatch(comm: ringcomm.Communicator, call, match: str) -> None:
    with pytest.raises(ringcomm.MismatchError, match=match):
        call()
    comm.mpi.Barrier()


@pytest.mark.parallel(nprocs=[2, 3])
def test_mismatch_is_detected_on_every_rank():
    comm = make_comm(check=True)
    r, n = comm.rank, comm.size
    x = np.ones(64, np.float32)
    comm.all_reduce(x)  # agreement passes: everybody agrees
    assert (x == n).all()

    def count_differs():
        comm.all_reduce(np.ones(10 + (r == 0), np.float32))

    def op_differs():
        comm.all_reduce(np.ones(8, np.float32), "max" if r == n - 1 else "sum")

    def dtype_differs():
        comm.reduce_scatter(np.ones(8, np.float64 if r == 0 else np.float32))

    def collective_differs():
        if r == 0:
            comm.broadcast(np.ones(8, np.float32))
        else:
            comm.all_reduce(np.ones(8, np.float32))

    def root_differs():
        comm.broadcast(np.ones(8, np.float32), root=r % 2)

    expect_mismatch(comm, count_differs, r"all_reduce: ranks disagree on the count \(rank 0: 11, rank 1: 10")
    expect_mismatch(comm, op_differs, r"ranks disagree on the op")
    expect_mismatch(comm, dtype_differs, r"ranks disagree on the dtype \(rank 0: float64, rank 1: float32")
    expect_mismatch(
        comm, collective_differs, r"ranks disagree on the collective \(rank 0: broadcast, rank 1: all_reduce"
    )
    expect_mismatch(comm, root_differs, r"ranks disagree on the root \(rank 0: 0, rank 1: 1")


@pytest.mark.parallel(nprocs=[2, 3])
def test_call_sequence_mismatch():
    """A rank whose call count ran ahead (a call its peers never made) is caught by the call number."""
    comm = make_comm(check=True)
    comm.all_reduce(np.ones(4))
    if comm.rank == 0:
        comm._seq += 1  # as if rank 0 had made one more checked call than its peers
    expect_mismatch(
        comm, lambda: comm.all_reduce(np.ones(4)), r"ranks disagree on the call number \(rank 0: 3, rank 1: 2"
    )


@pytest.mark.parallel(nprocs=[2, 3])
def test_missing_peer_times_out_with_names():
    """The late rank's neighbours time out naming the step and the peer; every other rank is told
    at once (abort propagation) and raises AbortError naming where the failure started."""
    comm = make_comm(timeout=1.0)
    late = comm.size - 1
    if comm.rank != late:
        x = np.ones(1000, np.float32)
        t0 = time.monotonic()
        with pytest.raises((ringcomm.TimeoutError, ringcomm.AbortError)) as info:
            comm.all_reduce(x)
        elapsed = time.monotonic() - t0
        e = info.value
        assert e.collective == "all_reduce" and e.rank == comm.rank and e.step is not None
        assert e.peer in (comm.left, comm.right)
        if isinstance(e, ringcomm.TimeoutError):
            assert e.timeout == 1.0
            assert f"all_reduce: rank {comm.rank} waited 1 s for rank {e.peer} at step {e.step}" in str(e)
        else:
            assert e.origin != comm.rank and e.origin != late and "TimeoutError" in e.reason
            assert f"rank {e.origin} aborted the communicator" in str(e)
        assert 0.9 < elapsed < 10
        with pytest.raises(ringcomm.RingcommError, match="aborted by an earlier error"):
            comm.all_reduce(x)
    MPI.COMM_WORLD.Barrier()
    # The agreement exchange and the barrier time out too (set-up waits: step None).
    checked, plain = make_comm(timeout=0.5, check=True), make_comm(timeout=0.5)
    if checked.rank != late:
        with pytest.raises((ringcomm.TimeoutError, ringcomm.AbortError), match="during set-up") as info:
            checked.broadcast(np.ones(4))
        assert info.value.step is None
        assert "argument agreement" in str(info.value) or isinstance(info.value, ringcomm.AbortError)
        with pytest.raises((ringcomm.TimeoutError, ringcomm.AbortError), match="barrier: rank"):
            plain.barrier()
    MPI.COMM_WORLD.Barrier()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.alone  # rank 0's abandoned duplication of COMM_WORLD would match the next one rank 1 makes
def test_barrier_is_checked_and_a_missing_peer_at_creation_times_out():
    comm = make_comm(check=True)
    if comm.rank == 0:
        call = comm.barrier
    else:

        def call():
            comm.all_reduce(np.ones(4))

    expect_mismatch(comm, call, r"ranks disagree on the collective \(rank 0: barrier, rank 1: all_reduce")
    comm.barrier()
    if comm.rank == 0:
        with pytest.raises(ringcomm.TimeoutError, match=r"Communicator\(\): rank 0 waited 0.5 s.*duplicating"):
            ringcomm.Communicator(MPI.COMM_WORLD, timeout=0.5)
    MPI.COMM_WORLD.Barrier()


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.parametrize("lane", [True, False])
@pytest.mark.parametrize("raw_mpi", [True, False])
def test_an_error_in_a_running_call_aborts_and_no_raw_mpi_error_leaves(lane, raw_mpi, monkeypatch):
    """In all_reduce's fast lane (check=False) as in the full path (check=True): an MPI error in
    a running call is a RingcommError naming the call and the rank; any other error leaves as it
    was raised, with its traceback; either aborts the communicator (Communicator._failed)."""
    from ringcomm.transports import shm

    publish = shm.SharedWindow.publish

    def failing(self, ctx, step, what, word):
        if ctx.call == 2:
            raise MPI.Exception(MPI.ERR_OTHER) if raw_mpi else ValueError("injected")
        publish(self, ctx, step, what, word)

    monkeypatch.setattr(shm.SharedWindow, "publish", failing)
    comm = make_comm(check=not lane)
    x = np.ones(8, np.float32)
    assert (comm.all_reduce(x) == 2).all()  # call 1 (the full path: it makes the gather)
    error = ringcomm.RingcommError if raw_mpi else ValueError
    with pytest.raises(error, match=r"all_reduce call 2: MPI error on rank \d" if raw_mpi else "injected") as info:
        comm.all_reduce(x)
    assert raw_mpi or info.traceback[-1].name == "failing"
    assert comm._aborted
    with pytest.raises(ringcomm.RingcommError, match="aborted by an earlier error"):
        comm.all_reduce(x)
