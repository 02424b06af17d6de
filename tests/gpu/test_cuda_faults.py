"""Faults injected into the emulated GPU (tests/emulated): a driver query that fails, a thread with
no current CUDA context, a stream that never completes, a machine without NVRTC. Skipped on a
real GPU, where these cannot be provoked on demand."""

from __future__ import annotations

import logging
import re
import threading
import time

import numpy as np
import pytest
from conftest import deadline_barrier, make_comm, require_gpu, transport_env
from mpi4py import MPI

cupy, _ngpu = require_gpu()
if not getattr(cupy, "_emulated", False):
    pytest.skip("fault injection needs the emulated GPU (tests/emulated)", allow_module_level=True)

import ringcomm  # noqa: E402
from ringcomm.devices import cuda as cuda_device  # noqa: E402


def comm_with(transport: str, **kw):
    """A Communicator whose GPU transport is chosen (collectively, at the first GPU call: here)
    under RINGCOMM_TRANSPORT=``transport``."""
    with transport_env(transport):
        comm = make_comm(**kw)
        comm.transport_name(cupy.empty(1, cupy.float32))
    return comm


@pytest.mark.parallel(nprocs=[2])
def test_ipc_from_a_thread_without_a_current_context(caplog):
    """A collective called from a new thread, whose first CUDA call is ringcomm's driver query:
    without the array's device made current there, the query fails (CUDA_ERROR_INVALID_CONTEXT)
    and the buffer would silently go through the scratch copy."""
    r = MPI.COMM_WORLD.rank
    comm = comm_with("ipc")
    x = cupy.full(40_003, r + 1.0, cupy.float32)  # allocated in this thread
    errors = []

    def run() -> None:
        try:
            comm.all_reduce(x)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        t = threading.Thread(target=run)
        t.start()
        t.join(120)
    assert not errors, errors
    assert (cupy.asnumpy(x) == sum(k + 1 for k in range(MPI.COMM_WORLD.size))).all()
    messages = [rec.getMessage() for rec in caplog.records]
    assert not [m for m in messages if "scratch buffer" in m or "returned CUDA_ERROR" in m], messages


@pytest.mark.parallel(nprocs=[2])
def test_failing_driver_query_is_logged_once(monkeypatch, caplog):
    """cuPointerGetAttribute failing: the buffer takes the scratch path (results stay right), and
    the CUDA result is logged once, by name, instead of being swallowed."""
    r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    monkeypatch.setenv("RINGCOMM_EMULATED_DRIVER_FAIL", "cuPointerGetAttribute")
    comm = comm_with("ipc")
    with caplog.at_level(logging.WARNING, logger="ringcomm"):
        for i in range(3):
            x = cupy.full(20_000, r + i, cupy.int64)
            comm.all_reduce(x)
            assert (cupy.asnumpy(x) == sum(k + i for k in range(n))).all()
    logged = [rec.getMessage() for rec in caplog.records if "cuPointerGetAttribute" in rec.getMessage()]
    assert len(logged) == 1 and "CUDA_ERROR_INVALID_VALUE" in logged[0], logged
    assert comm.transport_name(x) == "ipc"


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.alone  # its stalled stream never completes: later streams of its work queue would wait behind it
@pytest.mark.parametrize("transport", ["mpi", "staged"])
def test_hung_stream_times_out_instead_of_hanging(monkeypatch, transport):
    """Rank 0's stream never completes (a hung kernel). The host waits on GPU paths (the CUDA-aware
    MPI transport's stream waits, the staged transport's copies and its error path) poll with the
    communicator's deadline: every rank raises ringcomm.TimeoutError, none hangs."""
    monkeypatch.setenv("RINGCOMM_CUDA_AWARE_MPI", "1")  # emulated device memory is host memory
    r = MPI.COMM_WORLD.rank
    timeout = 2.0
    comm = comm_with(transport, timeout=timeout)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.full(50_000, r, cupy.float32)
    if r == 0:
        cupy._stall(s)
    t0 = time.monotonic()
    with pytest.raises((ringcomm.TimeoutError, ringcomm.AbortError)) as caught:  # the first to time out tells the other
        comm.all_reduce(x, stream=s)
    took = time.monotonic() - t0
    assert caught.value.collective == "all_reduce"
    assert took < 2 * timeout + 5, f"took {took:.1f} s"


def test_no_nvrtc_is_one_clear_error_at_the_first_gpu_call(monkeypatch):
    """A machine with only a driver: CuPy cannot load NVRTC. The first GPU call says what to install."""
    monkeypatch.setenv("RINGCOMM_EMULATED_NO_NVRTC", "1")
    monkeypatch.setattr(cuda_device, "_modules", {})
    monkeypatch.setattr(cuda_device, "_kernels", {})
    comm = make_comm()
    x = cupy.ones(10, cupy.float32)
    with pytest.raises(RuntimeError, match=r"NVRTC.*ringcomm\[cuda\]") as caught:
        comm.all_reduce(x)
    assert "libnvrtc" in str(caught.value)  # CuPy's own message is kept
    assert not comm._aborted  # raised before any communication
    np.testing.assert_array_equal(cupy.asnumpy(x), np.ones(10, np.float32))


def test_bench_synchronisation_has_the_deadline():
    """The benchmark waits for each call's stream: a hung stream is a TimeoutError, not a hang."""
    from ringcomm.bench.impls import stream_sync

    comm = make_comm(timeout=1.0)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        cupy.ones(8, cupy.float32)
    stream_sync(comm, s)()  # completes
    cupy._stall(s)
    t0 = time.monotonic()
    with pytest.raises(ringcomm.TimeoutError, match="benchmark synchronisation"):
        stream_sync(comm, s)()
    assert time.monotonic() - t0 < 5


@pytest.mark.parallel(nprocs=[2])
@pytest.mark.alone  # rank 1's stalled stream never completes (as test_hung_stream's)
def test_kernel_ring_reports_a_peer_whose_stream_is_stuck(monkeypatch):
    """Rank 1's stream never runs (a hung kernel queued before the call): rank 0's all_reduce
    returns at once; its ring kernel waits for rank 1's header until the deadline, records a
    timeout naming the collective, step and peer, and returns, so rank 0's stream completes; the
    error comes from check_errors() within timeout + 1 s, and the communicator is aborted."""
    monkeypatch.setenv("RINGCOMM_ONESHOT_BYTES", "0")  # (the ring's steps, whatever the one-shot's default)
    r = MPI.COMM_WORLD.rank
    timeout = 2.0
    comm = comm_with("kernel", timeout=timeout)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.full(50_000, r, cupy.float32)
    comm.all_reduce(cupy.ones(64, cupy.float32), stream=s)  # a first call: set-up done, streams fine
    s.synchronize()
    comm.check_errors()
    if r == 1:
        cupy._stall(s)
    t0 = time.monotonic()
    comm.all_reduce(x, stream=s)
    returned = time.monotonic() - t0
    assert returned < timeout / 2, f"the call waited {returned:.1f} s on the host"
    if r == 0:
        s.synchronize()  # the kernel returns at its deadline: the stream completes (its result is undefined)
        took = time.monotonic() - t0
        assert timeout <= took < timeout + 1.0, f"took {took:.2f} s"
        with pytest.raises(ringcomm.TimeoutError) as caught:
            comm.check_errors()
        error = caught.value
        assert (error.collective, error.peer, error.rank, error.step) == ("all_reduce", 1, 0, 0), error
        assert re.search(r"ring kernel call \d+, channel \d+, at the call's header, before step 0", str(error)), error
        with pytest.raises(ringcomm.RingcommError, match="aborted"):
            comm.all_reduce(x, stream=s)
    deadline_barrier(MPI.COMM_WORLD)


def _kernel_ring_stays_host_driven(why: str) -> None:
    """RINGCOMM_TRANSPORT=kernel where the ranks' ring kernels cannot all run at once: every rank
    warns ``why`` and keeps the host-driven ipc ring (the bench header's note says so too), and the
    collectives give the right result, bitwise the same on every rank."""
    r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    cupy.cuda.Device(0).use()  # every rank on one GPU
    with pytest.warns(RuntimeWarning, match=why):
        comm = comm_with("kernel", timeout=30.0)
    x = cupy.asarray(np.random.default_rng(r).standard_normal(40_003).astype(np.float32))
    assert comm.transport_name(x) == "ipc" and not comm._executors
    assert comm._transport("cuda").note.startswith("RINGCOMM_TRANSPORT=kernel, but the ring stays host-driven")
    want = sum(np.random.default_rng(k).standard_normal(40_003).astype(np.float32) for k in range(n))
    comm.all_reduce(x)
    got = cupy.asnumpy(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len({a.tobytes() for a in MPI.COMM_WORLD.allgather(got)}) == 1
    comm.close()


@pytest.mark.parallel(nprocs=[2])
def test_kernel_ring_of_ranks_sharing_a_gpu_without_mps_stays_host_driven(monkeypatch):
    """Ranks sharing a GPU without MPS (cudaDevAttrMpsEnabled 0; RINGCOMM_EMULATED_MPS=0 says the same):
    their contexts take turns on the GPU, so a kernel that waits on another rank's would wait for a
    time slice at every step. transports.select sees it in the ranks' records, before any kernel."""
    monkeypatch.setattr(cuda_device, "mps_enabled", lambda device_id: False)
    _kernel_ring_stays_host_driven(r"ranks 0, 1 share GPU 0000:00:00.0 of node 0, rank\(s\) 0, 1 not under MPS")


@pytest.mark.parallel(nprocs=[3])
def test_kernel_ring_whose_probe_blocks_do_not_all_run_stays_host_driven(monkeypatch):
    """The set-up's probe kernel: rank 1's blocks never run (its launch is lost here; on a GPU, its
    blocks could not become resident beside other work), so rank 2, its right neighbour, waits for its
    header until the probe's deadline and records a timeout (rank 0 has rank 2's header: it passes),
    and every rank agrees to keep the host-driven ring."""
    from ringcomm import executor

    monkeypatch.setattr(executor, "PROBE_SECONDS", 0.5)
    if MPI.COMM_WORLD.rank == 1:
        real = executor.kernel

        def lost_probe(source: str, name: str):
            return (lambda *args, **kw: None) if name == "ringcomm_ring_sum_u8" else real(source, name)

        monkeypatch.setattr(executor, "kernel", lost_probe)
    started = time.monotonic()
    _kernel_ring_stays_host_driven(r"the probe kernel's blocks did not all run at once: rank\(s\) 2 waited 0.5 s")
    assert time.monotonic() - started < 20
