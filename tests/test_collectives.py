"""Every collective, op and dtype on 1..5 ranks, against MPI's own collectives and float64 numpy.

One parallel test per family loops over dtypes, ops and counts inside a single mpiexec launch.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    DTYPES,
    assert_identical_on_all_ranks,
    assert_matches,
    gather_all,
    make_comm,
    ops_for,
    random_input,
    shared_seed,
)
from mpi4py import MPI

from ringcomm.ops import HALF_DTYPES, ReduceOp

NPROCS = [1, 2, 3, 4, 5]
MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX}


def counts(n: int) -> list[int]:
    """0, 1, N-1, N+1, around the 16-element alignment and 16·N, and a large odd count."""
    return sorted({0, 1, max(n - 1, 0), n + 1, 15, 16, 17, 16 * n - 1, 16 * n + 1, 1001, 40_003})


def poison(a: np.ndarray) -> np.ndarray:
    """Fill with a value no collective produces here, so unwritten elements show."""
    a[...] = 77 if a.dtype.kind in "iu" else np.nan
    return a


def mpi_reference_ok(dtype: np.dtype, op: ReduceOp) -> bool:
    return dtype not in HALF_DTYPES and op in MPI_OPS


def assert_like_mpi(ours: np.ndarray, theirs: np.ndarray, inputs: list[np.ndarray], op: ReduceOp, what: str) -> None:
    """Exactly MPI's result for integers and MIN/MAX; for float sums and products, both within the
    summation bound of the float64 reference (so within twice that bound of each other)."""
    if ours.dtype.kind in "iu" or op in (ReduceOp.MIN, ReduceOp.MAX):
        assert ours.tobytes() == theirs.tobytes(), what
    else:
        assert_matches(ours, inputs, op, what)
        assert_matches(theirs, inputs, op, f"{what} (MPI's own result)")


@pytest.mark.parallel(nprocs=NPROCS)
def test_all_reduce_reduce_scatter_all_gather():
    check_ring_family()


def check_ring_family() -> None:
    """all_reduce (both algorithms), reduce_scatter and all_gather over every dtype, op and count
    class, against MPI and float64 numpy (also run by test_topology under node layouts)."""
    mpi = MPI.COMM_WORLD
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    # small slices so large counts travel as many pipelined messages; two thresholds for the small
    # all-reduce path so both algorithms run on every size class
    ring = make_comm(slice_bytes=4096, small_bytes=0)
    small = make_comm(small_bytes=1 << 16)
    n, r = ring.size, ring.rank
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for count in counts(n):
                what = f"N={n} {dtype} {op} count={count}"
                x = random_input(rng, count, dtype, op)
                inputs = gather_all(mpi, x)

                # all_reduce: in place and out of place, both algorithms, bitwise the same
                inplace = x.copy()
                assert ring.all_reduce(inplace, op) is inplace
                assert_matches(inplace, inputs, op, f"all_reduce {what}")
                assert_identical_on_all_ranks(mpi, inplace, f"all_reduce {what}")
                out = poison(np.empty_like(x))
                assert ring.all_reduce(x, op, out=out) is out
                assert out.tobytes() == inplace.tobytes(), f"out-of-place all_reduce {what}"
                assert np.array_equal(x, inputs[r]), f"all_reduce out= modified x, {what}"
                via_small = small.all_reduce(x.copy(), op)
                assert via_small.tobytes() == inplace.tobytes(), f"small-buffer all_reduce {what}"
                if mpi_reference_ok(x.dtype, op):
                    theirs = np.empty_like(x)
                    mpi.Allreduce(x, theirs, op=MPI_OPS[op])
                    assert_like_mpi(inplace, theirs, inputs, op, f"all_reduce vs MPI_Allreduce {what}")

                # reduce_scatter: this rank's shard, x untouched, equal to the all_reduce's shard
                bounds = ring.shard_bounds(count)
                lo, hi = bounds[r]
                shard = ring.reduce_scatter(x, op)
                assert shard.shape == (hi - lo,) and shard.dtype == x.dtype
                assert shard.tobytes() == inplace[lo:hi].tobytes(), f"reduce_scatter vs all_reduce {what}"
                assert np.array_equal(x, inputs[r]), f"reduce_scatter modified x, {what}"
                out_shard = poison(np.empty(hi - lo, x.dtype))
                assert ring.reduce_scatter(x, op, out=out_shard) is out_shard
                assert out_shard.tobytes() == shard.tobytes()
                if mpi_reference_ok(x.dtype, op):
                    theirs = np.empty(hi - lo, x.dtype)
                    mpi.Reduce_scatter(x, theirs, [b - a for a, b in bounds], op=MPI_OPS[op])
                    assert_like_mpi(shard, theirs, [a[lo:hi] for a in inputs], op, f"vs MPI_Reduce_scatter {what}")

                # all_gather(reduce_scatter(x)) == all_reduce(x), with out= and without, and in place
                gathered = poison(np.empty_like(x))
                assert ring.all_gather(shard, out=gathered) is gathered
                assert gathered.tobytes() == inplace.tobytes(), f"all_gather(reduce_scatter) {what}"
                assert ring.all_gather(shard).tobytes() == inplace.tobytes(), f"all_gather out=None {what}"
                in_place = poison(np.empty_like(x))
                in_place[lo:hi] = shard
                ring.all_gather(in_place[lo:hi], out=in_place)
                assert in_place.tobytes() == inplace.tobytes(), f"in-place all_gather {what}"
            # all_gather of unequal, arbitrary shard sizes (out=None) against MPI_Allgatherv
            mine = random_input(rng, int(rng.integers(0, 40)), dtype, ReduceOp.SUM)
            sizes = mpi.allgather(mine.size)
            theirs = np.empty(sum(sizes), mine.dtype)
            mpi.Allgatherv(mine.view(np.uint8), [theirs.view(np.uint8), [k * mine.itemsize for k in sizes]])
            got = ring.all_gather(mine)
            assert got.tobytes() == theirs.tobytes(), f"all_gather of ragged shards N={n} {dtype}"
    reshaped = np.arange(24, dtype=np.float32).reshape(2, 3, 4) + mpi.rank
    assert ring.all_reduce(reshaped).shape == (2, 3, 4)
    assert_matches(reshaped.ravel(), [np.arange(24, dtype=np.float32) + k for k in range(n)], ReduceOp.SUM, "3-D")


@pytest.mark.parallel(nprocs=NPROCS)
def test_broadcast_and_reduce():
    check_chain_family()


def check_chain_family() -> None:
    """broadcast and reduce over every dtype, op, count class and several roots, against MPI."""
    mpi = MPI.COMM_WORLD
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    comm = make_comm(slice_bytes=2048)
    n, r = comm.size, comm.rank
    for dtype in DTYPES:
        for count in counts(n):
            for root in sorted({0, n - 1, n // 2}):
                what = f"N={n} {dtype} count={count} root={root}"
                x = random_input(rng, count, dtype, ReduceOp.SUM)
                inputs = gather_all(mpi, x)
                b = x.copy()
                assert comm.broadcast(b, root=root) is b
                theirs = x.copy()
                mpi.Bcast(theirs.view(np.uint8), root=root)
                assert b.tobytes() == theirs.tobytes() == inputs[root].tobytes(), f"broadcast vs MPI_Bcast {what}"
                for op in ops_for(dtype):
                    y = random_input(rng, count, dtype, op)
                    ys = gather_all(mpi, y)
                    out = poison(np.empty_like(y))
                    res = comm.reduce(y, op, root=root, out=out)
                    assert np.array_equal(y, ys[r]), f"reduce modified its input, {what}"
                    if r == root:
                        assert res is out
                        assert_matches(out, ys, op, f"reduce {op} {what}")
                        # in place at the root gives the same bits
                        z = y.copy()
                        assert comm.reduce(z, op, root=root) is z
                        assert z.tobytes() == out.tobytes()
                        if mpi_reference_ok(y.dtype, op):
                            theirs = np.empty_like(y)
                            mpi.Reduce(y, theirs, op=MPI_OPS[op], root=root)
                            assert_like_mpi(out, theirs, ys, op, f"reduce vs MPI_Reduce {what}")
                    else:
                        assert res is None
                        assert out.tobytes() == poison(np.empty_like(out)).tobytes(), (
                            f"reduce wrote out off root {what}"
                        )
                        assert comm.reduce(y.copy(), op, root=root) is None
                        if mpi_reference_ok(y.dtype, op):
                            mpi.Reduce(y, None, op=MPI_OPS[op], root=root)


@pytest.mark.parallel(nprocs=[2, 4])
def test_bytes_sent_and_bitwise_agreement_of_avg():
    """Each rank sends 2(N-1)/N of the buffer in a ring all-reduce; AVG is identical on all ranks."""
    mpi = MPI.COMM_WORLD
    comm = make_comm(small_bytes=0)
    n = comm.size
    count = 16 * n * 1000
    x = np.random.default_rng([shared_seed(mpi), mpi.rank]).standard_normal(count).astype(np.float16)
    before = comm.bytes_sent
    comm.all_reduce(x, "avg")
    assert comm.bytes_sent - before == 2 * (n - 1) * count // n * x.itemsize
    assert_identical_on_all_ranks(mpi, x, "avg float16")
    before = comm.bytes_sent
    comm.reduce_scatter(x)
    assert comm.bytes_sent - before == (n - 1) * count // n * x.itemsize


@pytest.mark.parallel(nprocs=[2, 3])
def test_many_small_all_reduces_with_many_slices():
    """Hundreds of small all-reduces of changing sizes, each of several slices: the persistent
    requests of the small path are created, reused and evicted between calls, never during one."""
    mpi = MPI.COMM_WORLD
    comm = make_comm(slice_bytes=4096, small_bytes=65536)
    n = comm.size
    for k in range(300):
        count = 4100 + k % 97 * 13
        x = (np.arange(count, dtype=np.int32) * (mpi.rank + 1) + k) % 1000
        want = sum((np.arange(count, dtype=np.int64) * (r + 1) + k) % 1000 for r in range(n))
        assert np.array_equal(comm.all_reduce(x), want), f"call {k}, count {count}"


@pytest.mark.parallel(nprocs=[2])
def test_gpu_calls_route_on_what_every_rank_agrees():
    """Whether a small GPU call goes through the host (Communicator._via_host) must be the same on
    every rank, or some would wait for the ring's messages: it follows the smallest small_bytes of
    any rank (0 on any: never), and whether the ring runs as kernels (Link.kernel, agreed at set-up;
    never through the host). The host keeps each rank's own small_bytes (its window sorts differing
    ones out)."""
    from types import SimpleNamespace

    r = MPI.COMM_WORLD.rank
    comm = make_comm(small_bytes=4096 if r == 0 else 65536)
    assert comm._small("host") == comm.small_bytes and comm._small("cuda") == 4096
    link = SimpleNamespace(kernel=True)  # (a stand-in Link: no GPU here)
    comm._transports["cuda"] = link
    assert not comm._via_host("cuda", 8)  # a ring kernel's call: on the GPU
    link.kernel = False
    assert comm._via_host("cuda", 4096) and not comm._via_host("cuda", 4097) and not comm._via_host("host", 8)
    comm._transports.clear()
    comm.close()
    never = make_comm(small_bytes=0 if r == 1 else 65536)
    never._transports["cuda"] = link
    assert not never._via_host("cuda", 0)  # not even an empty buffer
    never._transports.clear()
    never.close()
