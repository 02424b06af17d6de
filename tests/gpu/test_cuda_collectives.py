"""Every collective, op and dtype on CuPy arrays, N = 1, 2, 4 ranks sharing one GPU (skipped without one;
N = 1, 2, 3 on the emulated GPU).

Each GPU transport in turn (CUDA IPC, staged, the one-kernel executor, and CUDA-aware MPI
where the library is), against
float64 host references (tests/conftest.py), with poisoned outputs, odd counts, views that start at
element 1 (so IPC exports an offset inside a pool block), bitwise agreement across ranks, and
bitwise agreement with the host path on the same data. One mpiexec launch per N loops over all.
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import numpy as np
import pytest
from conftest import (
    DTYPES,
    assert_identical_on_all_ranks,
    assert_matches,
    deadline_barrier,
    default_gpu_transport,
    gather_all,
    make_comm,
    ops_for,
    random_input,
    require_gpu,
    shared_seed,
    transport_env,
)
from mpi4py import MPI

cupy, _ngpu = require_gpu()

import ringcomm  # noqa: E402
from ringcomm.devices.cuda import mps_enabled  # noqa: E402
from ringcomm.ops import ReduceOp  # noqa: E402
from ringcomm.ops import bfloat16 as ringcomm_bfloat16  # noqa: E402
from ringcomm.transports import ipc, staged  # noqa: E402

#: ranks sharing the GPU; on the emulated GPU 1, 2, 3 (an odd ring, and cheaper on a 2-core CI machine
#: than 4 ranks: tests/test_cuda_emulated.py; N = 4 there in the mixed-ring topology tests)
NPROCS = [1, 2, 3] if getattr(cupy, "_emulated", False) else [1, 2, 4]


def _use_local_gpu() -> None:
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    cupy.cuda.Device(node.rank % _ngpu).use()  # one GPU: every rank on device 0
    node.Free()


def transports() -> list[str]:
    """The GPU transports the tests loop over: every one this machine has, or those of them that
    RINGCOMM_TEST_TRANSPORTS names (comma-separated, ``name@N``: at N ranks only;
    tests/test_cuda_emulated.py runs each variant of the emulated GPU with the transports it is
    about); a test fails where it names some but leaves none. Not kernel where ranks share a GPU
    without MPS."""
    names = ["ipc", "staged", "kernel"]
    if MPI.COMM_WORLD.size > _ngpu and not mps_enabled(cupy.cuda.runtime.getDevice()):
        names.remove("kernel")  # ranks sharing a GPU without MPS: the ring stays host-driven (test_kernel_ring_...)
    if staged.cuda_aware_mpi():
        names.append("mpi")
    wanted = [w.strip().split("@") for w in os.environ.get("RINGCOMM_TEST_TRANSPORTS", "").split(",") if w.strip()]
    if not wanted:
        return names
    n = MPI.COMM_WORLD.size
    here = {w[0] for w in wanted if len(w) == 1 or int(w[1]) == n}
    if not here & set(names):  # (a test looping over none would pass without a check)
        pytest.fail(f"RINGCOMM_TEST_TRANSPORTS leaves none of this run's transports ({names}) at N = {n}")
    return [t for t in names if t in here]


def counts(n: int) -> list[int]:
    return sorted({0, 1, n + 1, 16 * n + 3, 40_003})


def dev(a: np.ndarray, offset: int = 0):
    """``a`` on the GPU; with ``offset``, as a view starting ``offset`` elements into a larger buffer."""
    buf = np.zeros(a.size + offset, a.dtype)
    buf[offset:] = a
    try:
        d = cupy.asarray(buf)
    except (TypeError, ValueError) as e:
        pytest.skip(f"CuPy {cupy.__version__} cannot hold {a.dtype} arrays: {e}")
    return d[offset:]


def poisoned(count: int, dtype: np.dtype):
    return dev(np.full(count, 77 if np.dtype(dtype).kind in "iu" else np.nan, dtype))


def host(d) -> np.ndarray:
    return cupy.asnumpy(d)


def _kernel_ring(**kw):
    """A Communicator whose every edge is the ring kernel, on this rank's GPU (the test skips where the
    ring kernel is not among this run's transports)."""
    if "kernel" not in transports():
        pytest.skip("the ring kernel is not among this run's transports (ranks sharing a GPU without MPS?)")
    _use_local_gpu()
    return comm_with("kernel", **kw)


def comm_with(transport: str | None, **kw):
    """A Communicator whose GPU edges all use ``transport`` (None: each edge's automatic choice)."""
    if transport is None:
        return make_comm(**kw)
    with transport_env(transport):
        comm = make_comm(**kw)
        assert comm.transport_name(cupy.empty(1, np.float32)) == transport
    return comm


@pytest.mark.parallel(nprocs=NPROCS)
def test_cuda_collectives_every_op_and_dtype():
    _use_local_gpu()
    check_every_op_and_dtype(transports())


@pytest.mark.parallel(nprocs=[5])
def test_kernel_ring_5_ranks_on_one_gpu():
    """The ring kernel's every collective, op, dtype and count class but the large one (40003 elements:
    N = 1 to 3 have it) at N = 5, every rank on one GPU (under MPS), bitwise the host path's. (Two
    ranks per GPU: N = 3 in tests/test_cuda_emulated.py's two-GPUs variant.)"""
    if "kernel" not in transports():
        pytest.skip("the ring kernel is not among this run's transports (ranks sharing a GPU without MPS?)")
    cupy.cuda.Device(0).use()
    check_every_op_and_dtype(["kernel"], large=False)


@pytest.mark.parallel(nprocs=[2, 3])
def test_kernel_ring_about_a_million_elements():
    """The ring kernel on 1,000,003 elements (not a multiple of N): every chunk is many FIFO pieces of
    the executor's real slot size in every channel, so each step wraps the FIFO many times (the
    counts above fit a piece or two). Every collective, in float32 (sum, and max into out), float16
    with accumulate="float32" (partial sums in float32) and int64 (prod), is bitwise the host path's
    result and the same on every rank; x is left as it was where the call does not write it."""
    if "kernel" not in transports():
        pytest.skip("the ring kernel is not among this run's transports (ranks sharing a GPU without MPS?)")
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    hostcomm, ring = make_comm(small_bytes=0), comm_with("kernel", small_bytes=0)
    n, r, count = mpi.size, mpi.rank, 1_000_003
    lo, hi = ring.shard_bounds(count)[r]
    for dtype, op, acc in (
        (np.float32, ReduceOp.SUM, None),
        (np.float32, ReduceOp.MAX, None),
        (np.float16, ReduceOp.SUM, "float32"),
        (np.int64, ReduceOp.PROD, None),
    ):
        what = f"N={n} {np.dtype(dtype)} {op} accumulate={acc}"
        x = random_input(rng, count, dtype, op)
        expect = hostcomm.all_reduce(x.copy(), op, accumulate=acc)
        xd = dev(x)
        got = host(ring.all_reduce(xd, op, out=poisoned(count, dtype), accumulate=acc))
        assert got.tobytes() == expect.tobytes(), f"all_reduce {what}"
        assert_identical_on_all_ranks(mpi, got, f"all_reduce {what}")
        shard = ring.reduce_scatter(xd, op, accumulate=acc)
        assert host(shard).tobytes() == expect[lo:hi].tobytes(), f"reduce_scatter {what}"
        assert host(xd).tobytes() == x.tobytes(), f"all_reduce or reduce_scatter modified x {what}"
        gathered = host(ring.all_gather(shard, out=poisoned(count, dtype)))
        assert gathered.tobytes() == expect.tobytes(), f"all_gather {what}"
        want = hostcomm.reduce(x.copy(), op, root=n - 1, accumulate=acc)
        got = ring.reduce(xd, op, root=n - 1, out=poisoned(count, dtype), accumulate=acc)
        assert (got is None) == (r != n - 1) and (got is None or host(got).tobytes() == want.tobytes()), what
        assert host(xd).tobytes() == x.tobytes(), f"reduce modified x {what}"
        ring.broadcast(xd, root=0)
        assert host(xd).tobytes() == gather_all(mpi, x)[0].tobytes(), f"broadcast {what}"
    ring.check_errors()
    ring.close()
    hostcomm.close()


def check_every_op_and_dtype(names: list[str | None], large: bool = True) -> None:
    """Every collective, op, dtype and count class on the GPU, bitwise the host path's result, once
    per transport in ``names`` (None: the automatic choice per edge; also run by test_cuda_topology);
    ``large`` False: without the 40003-element count."""
    mpi = MPI.COMM_WORLD
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    hostcomm = make_comm(small_bytes=0)
    for transport in names:
        ring = comm_with(transport, small_bytes=0)
        small = comm_with(transport)  # up to small_bytes: through the host (kernel: in the kernel, one-shot)
        n, r = ring.size, ring.rank
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for count in counts(n) if large else counts(n)[:-1]:
                    offset = int(count % 2)  # odd counts: a view that starts at element 1
                    what = f"{transport} N={n} {dtype} {op} count={count} offset={offset}"
                    x = random_input(rng, count, dtype, op)
                    inputs = gather_all(mpi, x)
                    expect = hostcomm.all_reduce(x.copy(), op)  # the host path: same schedule, same bits

                    xd = dev(x, offset)
                    assert ring.all_reduce(xd, op) is xd
                    got = host(xd)
                    assert_matches(got, inputs, op, f"all_reduce {what}")
                    assert_identical_on_all_ranks(mpi, got, f"all_reduce {what}")
                    assert got.tobytes() == expect.tobytes(), f"all_reduce GPU vs host {what}"

                    xd = dev(x, offset)
                    out = poisoned(count, dtype)
                    assert ring.all_reduce(xd, op, out=out) is out
                    assert host(out).tobytes() == expect.tobytes(), f"out-of-place all_reduce {what}"
                    assert host(xd).tobytes() == x.tobytes(), f"all_reduce out= modified x {what}"

                    lo, hi = ring.shard_bounds(count)[r]
                    shard = ring.reduce_scatter(xd, op)
                    assert host(shard).tobytes() == expect[lo:hi].tobytes(), f"reduce_scatter {what}"
                    out_shard = poisoned(hi - lo, dtype)
                    assert ring.reduce_scatter(xd, op, out=out_shard) is out_shard
                    assert host(out_shard).tobytes() == expect[lo:hi].tobytes(), f"reduce_scatter out= {what}"
                    assert host(xd).tobytes() == x.tobytes(), f"reduce_scatter modified x {what}"

                    gathered = poisoned(count, dtype)
                    assert ring.all_gather(shard, out=gathered) is gathered
                    assert host(gathered).tobytes() == expect.tobytes(), f"all_gather {what}"
                    assert host(ring.all_gather(shard)).tobytes() == expect.tobytes(), f"all_gather out=None {what}"
                    in_place = poisoned(count, dtype)
                    in_place[lo:hi] = shard
                    ring.all_gather(in_place[lo:hi], out=in_place)
                    assert host(in_place).tobytes() == expect.tobytes(), f"in-place all_gather {what}"

                    if count <= 16 * n + 3:  # every collective of small, within its small_bytes
                        via_small = host(small.all_reduce(dev(x, offset), op))
                        assert via_small.tobytes() == expect.tobytes(), f"small all_reduce {what}"
                        shard = small.reduce_scatter(dev(x, offset), op, out=poisoned(hi - lo, dtype))
                        assert host(shard).tobytes() == expect[lo:hi].tobytes(), f"small reduce_scatter {what}"
                        gathered = small.all_gather(dev(expect[lo:hi], offset), out=poisoned(count, dtype))
                        assert host(gathered).tobytes() == expect.tobytes(), f"small all_gather {what}"
                        in_place = poisoned(count, dtype)
                        in_place[lo:hi] = shard
                        small.all_gather(in_place[lo:hi], out=in_place)
                        assert host(in_place).tobytes() == expect.tobytes(), f"small in-place all_gather {what}"
                        b = dev(x, offset)
                        small.broadcast(b, root=n - 1)
                        assert host(b).tobytes() == inputs[n - 1].tobytes(), f"small broadcast {what}"
                        want = hostcomm.reduce(x.copy(), op, root=n - 1)
                        got = small.reduce(dev(x, offset), op, root=n - 1)  # in place at the root
                        if r == n - 1:
                            assert host(got).tobytes() == want.tobytes(), f"small reduce {what}"
                        else:
                            assert got is None

            for root in sorted({0, n - 1}):
                count = 40_003
                x = random_input(rng, count, dtype, ReduceOp.SUM)
                inputs = gather_all(mpi, x)
                b = dev(x, 1)
                assert ring.broadcast(b, root=root) is b
                assert host(b).tobytes() == inputs[root].tobytes(), f"broadcast {transport} N={n} {dtype} root={root}"
                for op in ops_for(dtype):
                    y = random_input(rng, count, dtype, op)
                    ys = gather_all(mpi, y)
                    out = poisoned(count, dtype)
                    yd = dev(y, 1)
                    res = ring.reduce(yd, op, root=root, out=out)
                    what = f"reduce {transport} N={n} {dtype} {op} root={root}"
                    assert host(yd).tobytes() == y.tobytes(), f"{what} modified x"
                    if r == root:
                        assert res is out
                        assert_matches(host(out), ys, op, what)
                        assert host(out).tobytes() == hostcomm.reduce(y.copy(), op, root=root).tobytes(), what
                    else:
                        assert res is None
                        assert hostcomm.reduce(y.copy(), op, root=root) is None
                        assert np.isnan(host(out).astype(np.float64)).all() or (host(out) == 77).all(), what


@pytest.mark.parallel(nprocs=NPROCS)
def test_large_buffers_pipeline_and_back_to_back_reuse():
    """Multi-slice staged chunks; then many collectives in a row on the same buffers, each result
    overwritten right after on the stream: a neighbour still reading this rank's memory after a
    collective returned (a missing write-after-read wait) would corrupt the next one."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    for transport in transports():
        comm = comm_with(transport)
        count = (12 << 20) + 5  # float32: chunks of several staged slices
        x = cupy.arange(count, dtype=cupy.float32) * (r + 1)
        comm.all_reduce(x)
        want = np.arange(count, dtype=np.float64) * (n * (n + 1) / 2)
        np.testing.assert_allclose(host(x), want, rtol=1e-6, err_msg=f"{transport} large all_reduce")
        buf = cupy.empty(1 << 16, cupy.int64)
        s = cupy.cuda.Stream(non_blocking=True)
        for i in range(40):
            with s:
                buf[...] = r + i * 1000  # written on the stream right after the previous collective
            comm.all_reduce(buf, stream=s)
            s.synchronize()
            expected = sum(k + i * 1000 for k in range(n))
            assert (host(buf) == expected).all(), f"{transport}: iteration {i} corrupted"
            half = comm.reduce_scatter(buf, stream=s)
            comm.all_gather(half, out=buf, stream=s)
            s.synchronize()
            assert (host(buf) == expected * n).all(), f"{transport}: iteration {i} reduce_scatter/all_gather"


@pytest.mark.parallel(nprocs=[2, 4])
def test_ipc_failure_falls_back_to_staged_on_that_edge(monkeypatch):
    """Rank 1 cannot open its left's handles: the edge left -> 1 turns to staging on both of its
    ends (with a warning), every other edge stays IPC, and results stay right."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    if mpi.rank == 1:  # one rank cannot open its neighbour's handle

        def broken(self, row):
            raise RuntimeError("simulated cudaIpcOpenMemHandle failure")

        monkeypatch.setattr(ipc.IpcRecv, "_open", broken)
    comm = comm_with("ipc", small_bytes=0)  # (a small all-reduce would go through the host)
    x = cupy.arange(1001, dtype=cupy.float64) + mpi.rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.all_reduce(x)
    warned = any("staged" in str(w.message) for w in caught)
    assert warned == (mpi.rank in (0, 1)), [str(w.message) for w in caught]  # rank 0 is 1's left
    assert comm.edge_transport(x) == ("staged" if mpi.rank == 1 else "ipc")
    link = comm._transport("cuda")
    assert link.send.name == ("staged" if mpi.rank == 0 else "ipc")
    assert comm.transport_name(x) == ("mixed" if mpi.rank in (0, 1) else "ipc")  # as this rank knows
    want = np.arange(1001, dtype=np.float64) * mpi.size + sum(range(mpi.size))
    np.testing.assert_array_equal(host(x), want)
    comm.all_reduce(x)  # that edge stays on staged, no new set-up
    np.testing.assert_array_equal(host(x), want * mpi.size)


@pytest.mark.parallel(nprocs=[2])
def test_transport_choice_is_logged(caplog):
    _use_local_gpu()

    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        comm = make_comm(small_bytes=0)  # (a small all-reduce would go through the host)
        x = cupy.ones(100, cupy.float32)
        comm.all_reduce(x)
    t = default_gpu_transport()
    assert comm.transport_name(x) == t  # two ranks on one node
    assert any(
        "cuda transports" in rec.getMessage() and f"0 -{t}-> 1 -{t}-> (0)" in rec.getMessage() for rec in caplog.records
    )
    assert any(f"transport={t} " in rec.getMessage() for rec in caplog.records)


@pytest.mark.parallel(nprocs=[2])
def test_calls_alternating_between_two_streams_without_host_syncs():
    """Buffers the communicator owns (the small calls' pinned host stage, reduce_scatter's scratch,
    the staged transport's device scratch) are reused by the next call, here on the other stream,
    with no host synchronisation between the calls: each call's stream must wait for the last use
    of every such buffer by the call before (a "last use" event per buffer)."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    for transport in transports():
        comm = comm_with(transport)
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
        calls = []
        for i in range(12):
            s = streams[i % 2]
            with s:  # the inputs are written on the call's stream
                small = cupy.full(1000, r + 10 * i, cupy.float32)  # 4000 bytes: through the host (kernel: one-shot)
                ring = cupy.full(20_003, r + 10 * i, cupy.float32)  # the ring (> small_bytes), reduce_scatter's scratch
            comm.all_reduce(small, stream=s)
            shard = comm.reduce_scatter(ring, stream=s)
            calls.append((i, small, shard))
        for s in streams:
            s.synchronize()
        for i, small, shard in calls:
            want = sum(k + 10 * i for k in range(n))
            assert (host(small) == want).all(), f"{transport}: all_reduce {i} (stream {i % 2}) corrupted"
            assert (host(shard) == want).all(), f"{transport}: reduce_scatter {i} (stream {i % 2}) corrupted"


@pytest.mark.parallel(nprocs=[2] if getattr(cupy, "_emulated", False) else [2, 3])  # (CI time: N = 2 emulated)
def test_kernel_calls_captured_in_a_cuda_graph_give_the_right_result_at_every_replay():
    """RINGCOMM_TRANSPORT=kernel: collectives called while a stream captures become the graph's
    kernel nodes (a kind of call new to the communicator included: its step table is made on a
    stream of its own; the calls that need scratch, reduce_scatter, reduce and accumulate="float32",
    get the graph's own); each of 1000 replays runs them again, on inputs rewritten between replays,
    and gives the right result (the epoch lives in device memory); eager calls go on after it."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    comm = comm_with("kernel")
    count = 1003  # (not a multiple of 16 n: chunks of different sizes, a short last one)
    x = cupy.zeros(count, cupy.float32)
    y = cupy.empty_like(x)
    gathered = cupy.empty(16 * n, cupy.int64)
    b = cupy.empty(40, cupy.float64)
    lo, hi = comm.shard_bounds(count)[r]
    shard = cupy.empty(hi - lo, cupy.float32)
    red = cupy.empty(count, cupy.float32)
    h = cupy.empty(77, cupy.float16)
    comm.all_reduce(x, out=y)  # an eager call of one kind first
    comm.reduce_scatter(x, out=shard)  # (and one that takes the communicator's scratch)
    cupy.cuda.Device().synchronize()  # (ordering eager calls with a capture on another stream is the caller's)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        comm.all_reduce(x, out=y, stream=s)
        comm.all_reduce(y, op="max", stream=s)  # in place: a kind made during the capture
        comm.all_gather(gathered[16 * r : 16 * (r + 1)], out=gathered, stream=s)
        comm.broadcast(b, root=n - 1, stream=s)
        comm.reduce_scatter(x, out=shard, stream=s)
        comm.reduce(x, root=0, out=red if r == 0 else None, stream=s)
        comm.all_reduce(h, accumulate="float32", stream=s)
        graph = s.end_capture()
    want_gather = np.repeat(np.arange(n), 16)
    for i in range(1000):
        with s:
            x[...] = i + r
            gathered[16 * r : 16 * (r + 1)] = r
            b[...] = i if r == n - 1 else -1
            h[...] = i % 7 + r
        graph.launch(stream=s)
        got, want = y.get(stream=s), n * i + n * (n - 1) // 2
        assert (got == want).all(), f"replay {i}: all_reduce gave {got[:4]}"
        assert (gathered.get(stream=s) == want_gather).all(), f"replay {i}: all_gather"
        assert (b.get(stream=s) == i).all(), f"replay {i}: broadcast"
        assert (shard.get(stream=s) == want).all(), f"replay {i}: reduce_scatter"
        assert r != 0 or (red.get(stream=s) == want).all(), f"replay {i}: reduce"
        assert (h.get(stream=s) == n * (i % 7) + n * (n - 1) // 2).all(), f"replay {i}: all_reduce float32 accumulate"
    comm.all_reduce(x, out=y)
    comm.reduce_scatter(x, out=shard)
    assert (host(y) == n * 999 + n * (n - 1) // 2).all() and (host(shard) == n * 999 + n * (n - 1) // 2).all()
    comm.check_errors()


@pytest.mark.parallel(nprocs=[2])
def test_kernel_calls_captured_in_global_mode_as_pytorchs_graphs_capture():
    """A capture in global mode (``torch.cuda.graph``'s default; CuPy's is relaxed) prohibits the
    thread's "unsafe" CUDA calls, cudaMalloc among them: ringcomm's own allocations in a capture (a
    new kind's step table, the graph's scratch, a result it allocates) are made with the thread's
    capture mode relaxed (devices.cuda.capture_relaxed), so the capture holds; replays give the
    right results."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    comm = comm_with("kernel")
    count = 777
    x, y = cupy.zeros(count, cupy.float32), cupy.zeros(count, cupy.float32)
    comm.all_reduce(y)  # (the set-up, before the capture)
    cupy.cuda.Device().synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
        comm.all_reduce(x, op="min", out=y, stream=s)  # a kind new to the communicator: its table
        shard = comm.reduce_scatter(x, stream=s)  # the graph's scratch, and a result ringcomm allocates
        graph = s.end_capture()
    for i in range(20):
        with s:
            x[...] = i + r
        graph.launch(stream=s)
        assert (y.get(stream=s) == i).all(), f"replay {i}: all_reduce min"
        assert (shard.get(stream=s) == n * i + n * (n - 1) // 2).all(), f"replay {i}: reduce_scatter"
    comm.check_errors()


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_ring_kernels_failure_that_no_call_raised_is_raised_by_close():
    """A kernel call returns before its kernel runs. The failure that kernel records (here rank 0's
    count differs: a mismatch, and an abort on the ranks it tells), when no later call or
    check_errors() raised it, is raised by close() on every rank, once the communicator is freed (a
    later call says it is closed; a second close() does nothing)."""
    r, comm = MPI.COMM_WORLD.rank, _kernel_ring()
    x = cupy.ones(1007 if r == 0 else 1000, cupy.float32)
    comm.all_reduce(x)
    cupy.cuda.get_current_stream().synchronize()  # every rank's kernel has ended, its failure recorded
    with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError), match="all_reduce"):
        comm.close()
    with pytest.raises(ringcomm.RingcommError, match="closed"):
        comm.all_reduce(x)
    comm.close()


@pytest.mark.parallel(nprocs=[2])
def test_close_with_a_neighbour_late_past_the_deadline_raises_and_still_closes():
    """close() is collective. Rank 1 comes to it after the deadline: rank 0's close() raises
    TimeoutError (waiting for every rank's ring executor to close), tells rank 1, whose close()
    raises AbortError at once, and both communicators are closed all the same: a second close() does
    nothing, a later call says the communicator is closed."""
    r, comm = MPI.COMM_WORLD.rank, _kernel_ring(timeout=1.0)
    x = cupy.ones(1000, cupy.float32)
    comm.all_reduce(x)
    cupy.cuda.get_current_stream().synchronize()
    if r == 1:
        time.sleep(2.0)
    t0 = time.monotonic()
    with pytest.raises(ringcomm.TimeoutError if r == 0 else ringcomm.AbortError):
        comm.close()
    assert time.monotonic() - t0 < 1.0 + 1.5
    comm.close()
    with pytest.raises(ringcomm.RingcommError, match="closed"):
        comm.all_reduce(x)
    deadline_barrier(MPI.COMM_WORLD)


@pytest.mark.parallel(nprocs=[2])
def test_an_exception_in_with_leaves_at_once_on_the_kernel_ring():
    """An exception inside ``with comm:`` aborts the communicator: that rank's way out does not wait
    for the others (its ring executor keeps its memory for the process's life, as IPC keeps its
    pins), and a rank that comes to its close() later raises AbortError at once."""
    r, comm = MPI.COMM_WORLD.rank, _kernel_ring(timeout=5.0)
    x = cupy.ones(1000, cupy.float32)
    comm.all_reduce(x)
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.monotonic()
    with pytest.raises(ValueError if r == 0 else ringcomm.AbortError), comm:
        if r == 0:
            raise ValueError("in the block")
        time.sleep(2.0)
    assert r != 0 or time.monotonic() - t0 < 1.0, "rank 0 waited for rank 1 on its way out"
    deadline_barrier(MPI.COMM_WORLD)


@pytest.mark.parallel(nprocs=[2, 3])
def test_reduce_scatter_into_its_own_chunk_of_x():
    """reduce_scatter(x, out=x[lo:hi]) on every transport: the result lands in x's own chunk (a ring
    kernel's last reduction writes it there while reading that chunk of x, element by element),
    bitwise the host path's (sum, avg, float16 with accumulate="float32"), and the rest of x is unchanged."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    r = mpi.rank
    rng = np.random.default_rng([shared_seed(mpi), r])
    hostcomm = make_comm(small_bytes=0)
    for transport in transports():
        comm = comm_with(transport, small_bytes=0)
        for dtype, op, acc in ((np.float32, "sum", None), (np.float32, "avg", None), (np.float16, "sum", "float32")):
            count = 16 * mpi.size * 7 + 5
            lo, hi = comm.shard_bounds(count)[r]
            x = (rng.standard_normal(count) * 10).astype(dtype)
            want = hostcomm.reduce_scatter(x.copy(), op, accumulate=acc)
            xd = cupy.asarray(x)
            got = comm.reduce_scatter(xd, op, out=xd[lo:hi], accumulate=acc)
            what = f"{transport} {np.dtype(dtype)} {op}"
            assert host(got).tobytes() == want.tobytes(), what
            rest = host(xd)
            assert rest[:lo].tobytes() == x[:lo].tobytes() and rest[hi:].tobytes() == x[hi:].tobytes(), what
        comm.check_errors()
        comm.close()
    hostcomm.close()


@pytest.mark.parallel(nprocs=[2])
def test_a_capture_on_a_host_driven_ring_is_refused_before_any_communication():
    """A collective on a capturing stream where the ring waits on the host between steps (ipc), or
    before the communicator set its GPU transports up: a RuntimeError saying why, on every rank,
    before any message; the capture ends cleanly and the communicator stays usable."""
    _use_local_gpu()
    n = MPI.COMM_WORLD.size
    fresh, comm = comm_with(None), comm_with("ipc")  # (fresh: no GPU call yet)
    x = cupy.ones(1000, cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    for c, why in ((comm, "only a ring kernel's calls can be captured.*transport is ipc"), (fresh, "not set up")):
        with s:
            s.begin_capture()
            with pytest.raises(RuntimeError, match=f"capturing a CUDA graph.*{why}"):
                c.all_reduce(x, stream=s)
            with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
                c.reduce_scatter(x, stream=s)
            s.end_capture()
    comm.all_reduce(x)
    fresh.all_reduce(x)
    assert (host(x) == n * n).all()
    comm.close()
    fresh.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_kernel_lanes_repeat_every_collective_with_its_checks_and_launch_alone(monkeypatch):
    """RINGCOMM_TRANSPORT=kernel: a call like one that ran before (collective, count, dtype, op, root,
    where its result goes; on CuPy's current stream or a cupy.cuda.Stream given) takes its kernel
    lane (collectives._kernel_lane): no schedule, no new Context or device, only its checks and the
    launch. On fresh data every call, each result equals the host path's bit for bit, and the
    outputs (poisoned before each call) are written; what the lanes do not take (another op or root,
    out on x itself or overlapping it) goes the full path, with its errors."""
    from ringcomm import collectives
    from ringcomm.communicator import Communicator

    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    comm, hostcomm = comm_with("kernel"), make_comm(small_bytes=0)
    full = []
    run = Communicator._run

    def counted(self, ctx, *args, **kw):
        if self is comm:
            full.append(ctx.collective)
        return run(self, ctx, *args, **kw)

    monkeypatch.setattr(Communicator, "_run", counted)
    count = 16 * n + 5  # (not a multiple of N)
    lo, hi = comm.shard_bounds(count)[r]

    def gather_into(x, in_place):
        out = poisoned(count, np.float32)
        if in_place:
            out[lo:hi] = x[lo:hi]
            return comm.all_gather(out[lo:hi], out=out)
        return comm.all_gather(x[lo:hi], out=out)

    # name: (the GPU call on x, the host path's on x, whether x stays as it was on every rank)
    cases = {
        "all_reduce in place": (lambda x: comm.all_reduce(x), lambda x: hostcomm.all_reduce(x.copy()), False),
        "all_reduce avg into out": (
            lambda x: comm.all_reduce(x, "avg", out=poisoned(count, np.float32)),
            lambda x: hostcomm.all_reduce(x.copy(), "avg"),
            True,
        ),
        "reduce_scatter": (lambda x: comm.reduce_scatter(x), lambda x: hostcomm.reduce_scatter(x), True),
        "reduce_scatter max into out": (
            lambda x: comm.reduce_scatter(x, "max", out=poisoned(hi - lo, np.float32)),
            lambda x: hostcomm.reduce_scatter(x, "max"),
            True,
        ),
        "all_gather": (
            lambda x: gather_into(x, False),
            lambda x: hostcomm.all_gather(x[lo:hi], out=np.empty_like(x)),
            True,
        ),
        "all_gather in place": (
            lambda x: gather_into(x, True),
            lambda x: hostcomm.all_gather(x[lo:hi], out=np.empty_like(x)),
            True,
        ),
        "broadcast from the last rank": (
            lambda x: comm.broadcast(x, root=n - 1),
            lambda x: hostcomm.broadcast(x.copy(), root=n - 1),
            False,
        ),
        "reduce in place at 0": (
            lambda x: comm.reduce(x, root=0),
            lambda x: hostcomm.reduce(x.copy(), root=0),
            r != 0,
        ),
        "reduce min into out at the last rank": (
            lambda x: comm.reduce(x, "min", root=n - 1, out=poisoned(count, np.float32)),
            lambda x: hostcomm.reduce(x, "min", root=n - 1, out=np.empty_like(x)),
            True,
        ),
    }
    rng = np.random.default_rng(shared_seed(mpi) + r)
    for i in range(6):
        for name, (gpu_call, host_call, keeps) in cases.items():
            x = rng.standard_normal(count).astype(np.float32)
            xd = dev(x)
            got, want = gpu_call(xd), host_call(x)
            what = f"call {i}, {name}"
            assert (got is None) == (want is None), f"{what}: {got!r}"
            if want is not None:
                assert host(got).tobytes() == want.tobytes(), f"{what}: {host(got)[:4]} {want[:4]}"
            if keeps:
                assert host(xd).tobytes() == x.tobytes(), f"{what}: x changed"
    assert full == [name.split()[0] for name in cases], full  # the first call of each kind only
    x = dev(np.arange(count, dtype=np.float32))
    comm.all_reduce(x, op="prod")  # (another op: the full path, then its own lane)
    assert len(full) == len(cases) + 1
    m = cupy.full((7, 11), r + 1, cupy.int32)
    for _ in range(3):  # (2-D, contiguous: the flat buffer's lane after the first call)
        m[...] = r + 1
        assert comm.all_reduce(m) is m and (host(m) == n * (n + 1) // 2).all()
    assert len(full) == len(cases) + 2
    v = dev(np.full(77, r + 1, np.int32))
    assert comm.all_reduce(v) is v and (host(v) == n * (n + 1) // 2).all()  # (1-D of that count: its lane)
    assert len(full) == len(cases) + 2
    twice = cupy.zeros(2 * count, cupy.float32)  # (x of the lanes' count, and an out overlapping it)
    with pytest.raises(ValueError, match="out partly overlaps x"):
        comm.all_reduce(twice[:count], "avg", out=twice[3 : count + 3])
    with pytest.raises(ValueError, match="out partly overlaps x"):
        comm.reduce(twice[:count], "min", root=n - 1, out=twice[3 : count + 3])
    with pytest.raises(ValueError, match="shard overlaps out but is not"):
        at = lo + 1 if lo == 0 else lo - 1  # (of the shard's size, not at this rank's place)
        comm.all_gather(x[at : at + hi - lo], out=x)
    x[...] = r
    comm.all_reduce(x, "avg", out=x)  # (out is x: in place, the full path)
    assert (host(x) == (n - 1) / 2).all() and len(full) == len(cases) + 3
    x[...] = r
    s = cupy.cuda.Stream(non_blocking=True)
    y = cupy.empty_like(x)
    cupy.cuda.Device().synchronize()
    comm.all_reduce(x, out=y, stream=s)  # (a new kind: sum into out; then its lane)
    comm.broadcast(y, root=n - 1, stream=s)  # (stream= a cupy.cuda.Stream: the lane, on that stream)
    comm.all_reduce(x, out=y, stream=s)
    (ex,) = comm._executors.values()
    assert ex.last.stream is s  # (the lane's kernel went on s)
    kept = cupy.cuda.Stream(non_blocking=True)
    with pytest.warns(DeprecationWarning):  # (CuPy 14 deprecates it, for Stream.from_external)
        external = cupy.cuda.ExternalStream(kept.ptr)
    for other in (external, cupy.cuda.Stream.from_external(kept)):
        comm.broadcast(y, root=n - 1, stream=other)  # (a stream over kept's handle: the lane too, on it)
        assert ex.last.stream is other
    comm.all_reduce(x, out=y, stream=s)
    s.synchronize()
    assert (host(y) == n * (n - 1) // 2).all() and len(full) == len(cases) + 4
    with s:  # (stream None: on CuPy's current stream, the lanes')
        for _ in range(3):
            z = cupy.full(count, r + 1, cupy.float32)
            comm.all_reduce(z)
            comm.broadcast(z, root=n - 1)
    s.synchronize()
    assert (host(z) == n * (n + 1) // 2).all() and len(full) == len(cases) + 4
    comm.broadcast(z, root=0)  # (another root: the full path)
    assert len(full) == len(cases) + 5
    monkeypatch.setattr(collectives, "LANES", 3)  # (past it every lane is dropped, and made again)
    for size in (1, 2, 3, 4, 5, 6, 6, 6):
        z = cupy.full(size, r + 1, cupy.float32)
        comm.all_reduce(z)
        assert (host(z) == n * (n + 1) // 2).all() and len(comm._lanes) <= 3
    assert len(full) == len(cases) + 11  # (the last two calls on their lane)
    comm.check_errors()
    comm.close()
    hostcomm.close()


@pytest.mark.parallel(nprocs=[2])
def test_arrays_ringcomm_allocates_belong_to_the_call_stream():
    """reduce_scatter's result and all_gather's output (out=None) are allocated by ringcomm and
    written on the call's stream: they must be allocated on that stream, since CuPy's pool hands
    the memory of a dropped array to the next allocation on the stream it was allocated on. Here
    the user drops the result at once and allocates on the null stream while the call's kernels
    may still be queued on its own stream."""
    _use_local_gpu()
    r = MPI.COMM_WORLD.rank
    for transport in transports():
        comm = comm_with(transport)
        s = cupy.cuda.Stream(non_blocking=True)
        for i in range(4):
            with s:
                x = cupy.full(4003, r + i, cupy.float32)
            shard = comm.reduce_scatter(x, stream=s)
            size = shard.size
            del shard
            fresh = cupy.full(size, -7, cupy.float32)  # on the null stream
            cupy.cuda.Stream.null.synchronize()  # the fill is done; the call's stream may still run
            s.synchronize()
            assert (host(fresh) == -7).all(), f"{transport}: memory of reduce_scatter's dropped result overwritten"
            with s:
                shard = cupy.full(5, r, cupy.int32)
            gathered = comm.all_gather(shard, stream=s)
            size = gathered.size
            del gathered
            fresh = cupy.full(size, -9, cupy.int32)
            cupy.cuda.Stream.null.synchronize()
            s.synchronize()
            assert (host(fresh) == -9).all(), f"{transport}: memory of all_gather's dropped result overwritten"


@pytest.mark.parallel(nprocs=[2])
def test_a_collective_leaves_the_callers_current_stream_current():
    """A stream the caller made current by ``Stream.use()`` is current again after every call, on
    every transport: ringcomm makes its call's stream current only around its own allocations and
    copies (arrays.on_stream). ``with stream:`` inside ringcomm would leave the null stream current
    instead (CuPy's with-stack does not hold a stream made current by use())."""
    _use_local_gpu()
    r = MPI.COMM_WORLD.rank
    mine, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    calls = (  # (each allocates on, or copies a step table in on, its call's stream)
        ("reduce_scatter", lambda comm, x: comm.reduce_scatter(x)),
        ("reduce_scatter on another stream", lambda comm, x: comm.reduce_scatter(x, stream=other)),
        ("all_gather, out=None", lambda comm, x: comm.all_gather(x[:5])),
        ("all_reduce max on another stream", lambda comm, x: comm.all_reduce(x.copy(), "max", stream=other)),
        ("broadcast", lambda comm, x: comm.broadcast(x.copy(), root=0)),
    )
    for transport in transports():
        comm = comm_with(transport)
        mine.use()
        try:
            x = cupy.full(4003, r + 1, cupy.float32)
            for name, call in calls:
                call(comm, x)
                assert cupy.cuda.get_current_stream().ptr == mine.ptr, (
                    f"{transport}, {name}: left another stream current"
                )
            other.synchronize()
            mine.synchronize()
        finally:
            cupy.cuda.Stream.null.use()


@pytest.mark.parallel(nprocs=[2])
def test_an_array_on_another_gpu_is_refused_before_any_communication():
    """x or out (or stream=) on a GPU other than the current one raises RuntimeError on the rank
    that passed it, before any communication (its kernels could not touch that memory without peer access, and a
    ring kernel launched on the current GPU would fault), also for a call like one that took a kernel
    lane before; the communicator goes on working."""
    if _ngpu < 2:
        pytest.skip("needs 2 GPUs")
    _use_local_gpu()
    r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    here = cupy.cuda.runtime.getDevice()
    calls = (  # (name, the call on comm, x and out; whether it takes an out)
        ("all_reduce", lambda comm, x, o: comm.all_reduce(x, out=o), True),
        ("reduce_scatter", lambda comm, x, o: comm.reduce_scatter(x, out=None if o is None else o[: 64 // n]), True),
        ("reduce", lambda comm, x, o: comm.reduce(x, root=0, out=o), True),
        ("broadcast", lambda comm, x, o: comm.broadcast(x, root=0), False),
    )
    for transport in transports():
        comm = comm_with(transport)
        with cupy.cuda.Device((here + 1) % _ngpu):
            far, far_out = cupy.full(64, r + 1.0, cupy.float32), cupy.zeros(64, cupy.float32)
        near = cupy.full(64, r + 1.0, cupy.float32)
        for name, call, takes_out in calls:
            call(comm, near.copy(), None)  # (first like calls on this GPU: a kernel lane exists for the next)
            refused = [("x", far, None)]
            if takes_out:
                call(comm, near.copy(), cupy.zeros(64, cupy.float32))
                refused.append(("out", near.copy(), far_out))
            for what, x, o in refused:
                try:
                    call(comm, x, o)
                    pytest.fail(f"{transport}, {name}: {what} on another GPU ran")
                except RuntimeError as e:
                    assert f"{what}: the array is on GPU {(here + 1) % _ngpu}, but the" in str(e), f"{name}: {e}"
        with cupy.cuda.Device((here + 1) % _ngpu):
            far_stream = cupy.cuda.Stream(non_blocking=True)
        for _ in range(2):  # (the second like a call that took the lane: refused too)
            comm.all_reduce(near.copy())
            try:
                comm.all_reduce(near.copy(), stream=far_stream)
                pytest.fail(f"{transport}: a stream of another GPU ran")
            except RuntimeError as e:
                assert f"stream: a stream of GPU {(here + 1) % _ngpu}, but the" in str(e), str(e)
        got = comm.all_reduce(near.copy())
        assert (host(got) == n * (n + 1) / 2).all(), f"{transport}: {host(got)[:3]}"
        comm.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_pool_trimmed_between_collectives_and_after_close(monkeypatch):
    """CuPy's pool frees cached blocks on free_all_blocks() (and before retrying an allocation that
    ran out of memory). An allocation that a neighbour still maps through CUDA IPC must not be
    freed (undefined in CUDA; the emulated GPU makes it an error): ringcomm keeps what it exported
    until the neighbour has closed its mapping, at cache eviction (forced here with a 2-entry
    cache) and at close()."""
    _use_local_gpu()
    monkeypatch.setattr(ipc, "MAX_MAPPINGS", 2)
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    pool = cupy.get_default_memory_pool()
    comm = comm_with("ipc")
    for i in range(8):
        x = cupy.full(600_000 + i, r + i, cupy.float32)  # each its own allocation (> one pool block)
        comm.all_reduce(x)
        assert (host(x) == sum(k + i for k in range(n))).all(), f"all_reduce {i}"
        del x
        if r == i % n:
            pool.free_all_blocks()
    comm.close()
    pool.free_all_blocks()
    MPI.COMM_WORLD.Barrier()


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_float32_accumulation_is_bitwise_the_hosts():
    """accumulate="float32" on half types: the GPU (each transport; its partial sums travel in
    float32) gives the host path's bits, for all_reduce (ring and gather-fold), reduce_scatter and
    reduce, every op."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    hostcomm = make_comm(small_bytes=0)
    n, r = mpi.size, mpi.rank
    for transport in transports():
        ring, small = comm_with(transport, small_bytes=0), comm_with(transport)
        for dtype in (np.dtype(np.float16), ringcomm_bfloat16):
            for op in ops_for(dtype):
                for count in sorted({1, n + 1, 16 * n + 3, 40_003}):
                    what = f"{transport} N={n} {dtype} {op} count={count}"
                    x = random_input(rng, count, dtype, op)
                    expect = hostcomm.all_reduce(x.copy(), op, accumulate="float32")
                    assert (
                        host(ring.all_reduce(dev(x, count % 2), op, accumulate="float32")).tobytes() == expect.tobytes()
                    ), f"all_reduce {what}"
                    if count * dtype.itemsize <= small.small_bytes:
                        got = host(small.all_reduce(dev(x), op, out=poisoned(count, dtype), accumulate="float32"))
                        assert got.tobytes() == expect.tobytes(), f"gather-fold all_reduce {what}"
                    lo, hi = ring.shard_bounds(count)[r]
                    shard = host(ring.reduce_scatter(dev(x), op, accumulate="float32"))
                    assert shard.tobytes() == expect[lo:hi].tobytes(), f"reduce_scatter {what}"
                    res = ring.reduce(dev(x), op, root=n - 1, out=poisoned(count, dtype), accumulate="float32")
                    want = hostcomm.reduce(x.copy(), op, root=n - 1, accumulate="float32")
                    if r == n - 1:
                        assert host(res).tobytes() == want.tobytes(), f"reduce {what}"


@pytest.mark.parallel(nprocs=[2, 3])
def test_ipc_set_up_is_reused_only_while_it_holds(monkeypatch):
    """A call on the arrays of the call before makes no driver query (what it exports lies in
    allocations it still pins) and opens no handle (its left's descriptor is the last one's and
    every mapping of it is still open). Once another communicator's calls have closed those
    mappings (evicted, even opened again: the cache holds new ones under the same handles),
    the next call opens every slot afresh, and once the exporters unpinned them (the closed mappings
    reported), it queries the driver again; results stay right throughout (a view of a closed
    mapping would read unmapped memory)."""
    _use_local_gpu()
    monkeypatch.setattr(ipc, "MAX_MAPPINGS", 2)  # (at least one per slot stays: 4)
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    queries, opens = [0], [0]
    real_allocation, real_open = ipc._Driver.allocation, ipc.IpcRecv._open

    def allocation(self, ptr):
        queries[0] += 1
        return real_allocation(self, ptr)

    def counted_open(self, row):
        opens[0] += 1
        return real_open(self, row)

    monkeypatch.setattr(ipc._Driver, "allocation", allocation)
    monkeypatch.setattr(ipc.IpcRecv, "_open", counted_open)
    transport = "ipc"
    comm, other = comm_with(transport, small_bytes=0), comm_with(transport)  # (comm's 3-element call: the ring's)
    count = 600_000  # each array its own allocation (larger than a pool block)
    x, out = cupy.full(count, r + 1, cupy.float32), cupy.empty(count, cupy.float32)
    want = n * (n + 1) / 2

    def call() -> tuple[int, int]:
        before = queries[0], opens[0]
        out.fill(-1)
        comm.all_reduce(x, out=out)
        assert (host(out) == want).all(), f"{transport}: wrong result"
        return queries[0] - before[0], opens[0] - before[1]

    def push_out() -> None:  # the other communicator's allocations push x's and out's mappings out
        for i in range(8):
            y = cupy.full(count, i + r, cupy.float32)
            other.all_reduce(y)
            assert (host(y) == sum(i + k for k in range(n))).all()

    assert call() == (2, 4)  # the first call exports x and out, and maps every slot
    assert call() == (0, 0)  # the same arrays: nothing queried nor opened
    push_out()
    other.all_reduce(x, out=out)  # x's and out's handles mapped again, as new mappings, by the other
    assert call() == (0, 4)  # the last call's descriptor, but not the mappings it was opened from
    assert call() == (0, 0)
    push_out()
    comm.all_reduce(cupy.ones(3, cupy.float32))  # its reply reports the closed mappings: their exporters unpin
    assert call() == (2, 4)  # exported and mapped anew
    assert call() == (0, 0)
    other.close()
    comm.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_small_collectives_go_through_the_host_in_stream_order(caplog):
    """Up to small_bytes, on transports that wait on the host (ipc, staged), every GPU collective
    goes through pinned host memory and the host's collective (the DEBUG log says so); as ring
    kernels they stay on the GPU. Calls alternating between two streams, none waited for: each
    call's copy into the reused stage waits on the GPU for the last call's copy out of it (on the
    emulated GPU that copy is still queued, lazily, when the next call starts), so all are right."""
    _use_local_gpu()
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    base = np.arange(1000, dtype=np.float32)
    for transport in [t for t in transports() if t != "mpi"]:
        comm = comm_with(transport)
        lo, hi = comm.shard_bounds(base.size)[r]
        a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="ringcomm"):
            with a:
                x1 = cupy.asarray(base) + r
            comm.all_reduce(x1, stream=a)
            with b:
                x2 = cupy.asarray(base) * (r + 1)
            comm.all_reduce(x2, stream=b)
            shard = comm.reduce_scatter(x1, stream=a)  # (x1 all-reduced on a before)
            with b:
                y = cupy.asarray(base - r)
            comm.broadcast(y, root=n - 1, stream=b)
            with a:
                gathered = cupy.empty(base.size, cupy.float32)
            comm.all_gather(shard, out=gathered, stream=a)
            with b:
                z = cupy.asarray(base + 2 * r)
            comm.reduce(z, root=0, stream=b)
        a.synchronize()
        b.synchronize()
        summed = base * n + n * (n - 1) // 2
        assert (host(x1) == summed).all(), f"{transport}: the first all_reduce"
        assert (host(x2) == base * (n * (n + 1) // 2)).all(), f"{transport}: the second all_reduce"
        assert (host(shard) == (summed * n)[lo:hi]).all(), f"{transport}: reduce_scatter"
        assert (host(y) == base - (n - 1)).all(), f"{transport}: broadcast"
        assert (host(gathered) == summed * n).all(), f"{transport}: all_gather"
        assert (host(z) == (base * n + n * (n - 1) if r == 0 else base + 2 * r)).all(), f"{transport}: reduce"
        via = [rec.getMessage().split(":")[0] for rec in caplog.records if "through the host" in rec.getMessage()]
        want = (
            []
            if transport == "kernel"
            else ["all_reduce", "all_reduce", "reduce_scatter", "broadcast", "all_gather", "reduce"]
        )
        assert via == want, (transport, via)
        comm.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_ranks_whose_small_bytes_differ_route_gpu_calls_alike(caplog):
    """GPU collectives have no shared-memory window in which ranks that route a call differently
    would meet: every rank routes on the smallest small_bytes of any rank (rank 0's here), so a
    buffer within one rank's limit but above another's runs the ring on all, not the host route
    on some (which would leave the others waiting for the ring's messages until the deadline)."""
    _use_local_gpu()
    r, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    for transport in ("ipc", "staged"):
        comm = comm_with(transport, small_bytes=4096 if r == 0 else 65536, timeout=5)
        for count, via in ((500, True), (5000, False)):  # 2 KB: within every limit; 20 KB: above rank 0's
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="ringcomm"):
                x = cupy.full(count, r + 1, cupy.float32)
                comm.all_reduce(x)
                shard = comm.reduce_scatter(x)
            assert (host(x) == n * (n + 1) // 2).all() and (host(shard) == n * n * (n + 1) // 2).all(), (
                transport,
                count,
            )
            routed = sum("through the host" in rec.getMessage() for rec in caplog.records)
            assert routed == (2 if via else 0), (transport, count, routed)
        comm.close()
