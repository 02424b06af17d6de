"""ipc-stream: the ring's steps ordered on the GPU (stream memory operations), not by the host.

The collectives themselves run through every GPU test with ipc-stream (test_cuda_collectives'
transports, and tests/test_cuda_emulated.py's ipc-stream variant of tests/gpu but the kernels'); here: a call
returns before any of its kernels ran, several calls queue back to back with no host wait, and a
call's result is bitwise ipc's. On the emulated GPU and on a real one.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import deadline_barrier, make_comm, require_gpu, transport_env
from mpi4py import MPI

cupy, _ngpu = require_gpu()

from ringcomm.transports.ipc_stream import StreamOps  # noqa: E402


def comm_with(transport: str, **kw):
    with transport_env(transport):
        comm = make_comm(**kw)
        assert comm.transport_name(cupy.empty(1, cupy.float32)) == transport
    return comm


def _use_local_gpu() -> None:
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    cupy.cuda.Device(node.rank % _ngpu).use()
    node.Free()


class Gate:
    """A word of pinned host memory that holds a stream back (a value wait queued on it) until the
    host opens it with a plain store. Not a write queued on another stream: streams share the GPU's
    hardware work queues (few per process under MPS), and such a write can sit behind the very wait
    it should release (under MPS on an H200, 2026-12-04, test_the_call_returns_before_any_of_its_kernels_ran
    hung so). With unified addressing, pinned memory's device address is its host address."""

    def __init__(self) -> None:
        self._mem = cupy.cuda.alloc_pinned_memory(4)
        self._word = np.frombuffer(self._mem, np.uint32, 1)
        self._word[0] = 0

    def hold(self, stream) -> None:
        StreamOps().wait(stream, self._mem.ptr, 1)

    def open(self) -> None:
        self._word[0] = 1


def _gated(count: int):
    """An ipc-stream communicator past its first call (mappings and flags set up), a stream, an
    input of ``count`` float32 (arange + rank) and a closed Gate."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    comm = comm_with("ipc-stream", small_bytes=0)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.arange(count, dtype=cupy.float32) + mpi.rank
    comm.all_reduce(cupy.ones(16, cupy.float32), stream=s)  # set-up (mappings, flags) on a first call
    s.synchronize()
    return mpi, mpi.rank, mpi.size, comm, s, x, Gate()


@pytest.mark.parallel(nprocs=[2, 3])
def test_the_call_returns_before_any_of_its_kernels_ran():
    """Rank 0's stream is held by a gate (a value wait) queued before the call: all_reduce(x,
    stream=s) still returns, with nothing on s having run (an event after it is not complete, and
    on the emulated GPU no kernel ran); once the gate opens, the result is right on every rank."""
    mpi, r, n, comm, s, x, gate = _gated(10_001)
    if r == 0:
        gate.hold(s)
    ran = cupy._emulated_kernels_run() if hasattr(cupy, "_emulated_kernels_run") else None
    comm.all_reduce(x, stream=s)
    comm.all_reduce(x, stream=s)  # a second call queues behind the first, still no host wait
    after = cupy.cuda.Event(block=False, disable_timing=True)
    after.record(s)
    if r == 0:
        try:
            assert not after.done, "the calls' work ran before the gate opened"
            if ran is not None:
                assert cupy._emulated_kernels_run() == ran, "a kernel ran before the call's stream reached it"
        finally:  # open the gate whatever happened: the other ranks wait for this one's stream
            gate.open()
    deadline_barrier(mpi)
    s.synchronize()
    base = np.arange(10_001, dtype=np.float64)
    want = (base * n + sum(range(n))) * n
    np.testing.assert_array_equal(cupy.asnumpy(x), want.astype(np.float32))
    comm.check_errors()  # nothing went wrong


@pytest.mark.parallel(nprocs=[2, 4])
def test_bitwise_ipc_and_many_calls_without_host_waits():
    """A sequence of calls on one stream, none waited for on the host between them: the results
    are bitwise those of ipc, for every collective, in place and out of place."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    r, n = mpi.rank, mpi.size
    rng = np.random.default_rng([17, r])
    results = {}
    for transport in ("ipc", "ipc-stream"):
        comm = comm_with(transport)
        s = cupy.cuda.Stream(non_blocking=True)
        outs = []
        with s:
            for count in (0, 1, n + 1, 16 * n + 3, 40_003):
                host = rng.standard_normal(count).astype(np.float32) if transport == "ipc" else results[count][0]
                x = cupy.asarray(host)
                y = comm.all_reduce(x.copy(), stream=s)
                z = comm.all_reduce(x, out=cupy.empty_like(x), stream=s)
                shard = comm.reduce_scatter(x, "max", stream=s)
                g = comm.all_gather(shard, out=cupy.empty_like(x), stream=s)
                b = x.copy()
                comm.broadcast(b, root=n - 1, stream=s)
                red = comm.reduce(x, "sum", root=0, out=cupy.empty_like(x), stream=s)
                outs.append((count, host, [y, z, shard, g, b] + ([red] if r == 0 else [])))
        s.synchronize()
        for count, host, arrays in outs:
            got = [cupy.asnumpy(a).tobytes() for a in arrays]
            if transport == "ipc":
                results[count] = (host, got)
            else:
                assert got == results[count][1], f"ipc-stream differs from ipc at count {count}"
        comm.check_errors()
        comm.close()


@pytest.mark.parallel(nprocs=[2])
def test_close_waits_for_the_queued_work_before_unmapping():
    """close() right after a call whose GPU work has not run (rank 1's stream held by a gate that
    opens 0.5 s later): close waits for the queued steps before it closes the mappings, so the
    kernels never read unmapped memory and the result is right."""
    import threading
    import time

    mpi, r, n, comm, s, x, gate = _gated(100_000)
    if r == 1:
        gate.hold(s)
        opener = threading.Timer(0.5, gate.open)
        opener.start()
    comm.all_reduce(x, stream=s)
    t0 = time.monotonic()
    comm.close()
    if r == 1:
        opener.join()
        assert time.monotonic() - t0 >= 0.3, "close did not wait for the queued steps"
    s.synchronize()
    want = (np.arange(100_000, dtype=np.float64) * n + sum(range(n))).astype(np.float32)
    np.testing.assert_array_equal(cupy.asnumpy(x), want)
    deadline_barrier(mpi)


@pytest.mark.parallel(nprocs=[2])
def test_send_scratch_is_not_overwritten_by_a_call_on_another_stream(monkeypatch):
    """Memory that cannot be exported goes through the sender's scratch. Call 1 on stream A, call 2
    on stream B, the right neighbour held back: call 2's copy into the scratch must wait (on B) for
    the right to have read call 1's chunk, although call 1's wait was queued on A."""
    import time

    monkeypatch.setenv("RINGCOMM_EMULATED_NO_IPC_POOL", "1")  # (the emulated GPU; no effect on a real one)
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    r, n = mpi.rank, mpi.size
    comm = comm_with("ipc-stream", small_bytes=0)
    gate = Gate()
    m = 4096
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with a:
        out1, out2 = cupy.zeros(n * m, cupy.float32), cupy.zeros(n * m, cupy.float32)
        comm.all_gather(cupy.full(m, -1.0, cupy.float32), out=cupy.empty(n * m, cupy.float32), stream=a)  # set-up
        out1[r * m : (r + 1) * m] = 1 + 10 * r
        out2[r * m : (r + 1) * m] = 2 + 10 * r
    a.synchronize()
    if r == 1:
        gate.hold(a)
    try:
        comm.all_gather(out1[r * m : (r + 1) * m], out=out1, stream=a)
        comm.all_gather(out2[r * m : (r + 1) * m], out=out2, stream=b)
        if r == 1:
            time.sleep(0.5)  # rank 0's call 2 on B has every chance to overwrite its scratch now
    finally:
        if r == 1:
            gate.open()
    a.synchronize()
    b.synchronize()
    for out, base in ((out1, 1), (out2, 2)):
        want = np.repeat([base + 10.0 * k for k in range(n)], m).astype(np.float32)
        np.testing.assert_array_equal(cupy.asnumpy(out), want)
    comm.check_errors()
    deadline_barrier(mpi)


@pytest.mark.parallel(nprocs=[2])
def test_ranks_disagreeing_on_the_count_fail_before_queuing():
    """Rank 1 all-reduces another count: the receiving halves compare every chunk the left will
    send against their own schedule at the start of the call, and both ranks raise MismatchError."""
    import ringcomm

    _use_local_gpu()
    r = MPI.COMM_WORLD.rank
    comm = comm_with("ipc-stream", small_bytes=0)
    x = cupy.ones(5000 if r == 0 else 7000, cupy.float32)
    with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError)) as caught:
        comm.all_reduce(x)
    assert "disagree" in str(caught.value), caught.value
    deadline_barrier(MPI.COMM_WORLD)
