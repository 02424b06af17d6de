"""Cached plans on the host: ring plans found by address, small all-reduces on a persistent
MPI_Allgather, both bounded, both freed by close(); results checked against MPI and float64.
(The shared-memory window's all-reduces would take these all-reduces: the tests that pin the MPI
plans turn it off, ``shared_memory=False``; tests/test_shared.py tests the window.)"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import gather_all, make_comm, reference, shared_seed
from mpi4py import MPI

import ringcomm
from ringcomm import communicator, engine
from ringcomm.ops import ReduceOp


def _ring_count(n: int) -> int:
    return 16 * n * 300 + 7  # above small_bytes (float32), not a multiple of N, well below PLAN_BYTES


@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_a_plan_follows_the_address_not_the_array():
    """Fresh views at one address run one plan; other addresses get their own; every result is exact."""
    mpi = MPI.COMM_WORLD
    comm = make_comm(small_bytes=1024, shared_memory=False)
    count = _ring_count(comm.size)
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    pool = np.zeros(3 * count + 64, np.int64)
    out = np.zeros(count, np.int64)
    for k in range(12):
        off = (k % 3) * count
        x = pool[off : off + count]  # a new view object every call; three addresses in turn
        x[...] = rng.integers(-1000, 1000, count)
        want = reference(gather_all(mpi, x), ReduceOp.SUM)
        comm.all_reduce(x, out=out)
        assert np.array_equal(out, want), f"call {k} out of place"
        comm.all_reduce(x)  # in place: another pair of addresses
        assert np.array_equal(x, want), f"call {k} in place"
    ring = [key for key in comm._plans if key[0] == "all_reduce"]
    assert len(ring) == 6, ring  # (out, x) and (x, x) for each of the three addresses
    comm.close()
    assert not comm._plans and not comm._gathers


@pytest.mark.parallel(nprocs=[2, 3])
def test_every_collective_runs_a_plan_and_the_cache_is_bounded(monkeypatch):
    mpi = MPI.COMM_WORLD
    monkeypatch.setattr(communicator, "PLAN_LIMIT", 5)
    comm = make_comm(small_bytes=0)
    n, r, count = comm.size, comm.rank, _ring_count(comm.size)
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    for k in range(4):
        x = rng.standard_normal(count)
        xs = gather_all(mpi, x)
        lo, hi = comm.shard_bounds(count)[r]
        assert np.allclose(comm.reduce_scatter(x), reference(xs, ReduceOp.SUM)[lo:hi], rtol=1e-12, atol=1e-12)
        full = comm.all_gather(x[lo:hi].copy())
        assert (
            full.tobytes()
            == np.concatenate([xs[i][b[0] : b[1]] for i, b in enumerate(comm.shard_bounds(count))]).tobytes()
        )
        b = x.copy()
        comm.broadcast(b, root=k % n)
        assert b.tobytes() == xs[k % n].tobytes()
        got = comm.reduce(x, "max", root=k % n)
        if r == k % n:
            assert np.array_equal(got, np.max(xs, axis=0))
        assert len(comm._plans) <= 5 and comm._plan_bytes <= communicator.PLAN_CACHE_BYTES
    assert {key[0] for key in comm._plans} <= {"reduce_scatter", "all_gather", "broadcast", "reduce"}
    big = np.ones(communicator.PLAN_BYTES // 8 + 16)  # above PLAN_BYTES: no plan bound to its addresses is kept
    before = set(comm._plans)
    assert (comm.all_reduce(big) == n).all()  # (in the window, in pieces: a plan bound to the window, no memory)
    made = set(comm._plans) - before
    assert len(made) == 1, made
    plan = comm._plans[made.pop()]
    assert isinstance(plan, engine.SharedDirectPlan) and plan.steps > 2 and plan.nbytes == 0, plan
    comm.close()
    comm = make_comm(small_bytes=0, shared_memory=False)  # without the window: the engine's loop
    assert (comm.all_reduce(np.ones_like(big)) == n).all() and not comm._plans
    comm.close()


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_broadcasts_and_all_gathers_take_a_plans_lane_where_its_arrays_lie(shared, monkeypatch):
    """Once a broadcast or an all-gather ran a Plan (bound to its buffers' addresses), the next such
    call whose arrays lie at those addresses takes its lane (collectives._lane_address; no _launch);
    one elsewhere takes the full path, which finds or makes the plan there, and the lane follows it;
    an all-gather in place takes it too, a shard that is not this rank's place in out is the full
    path's ValueError. Every result is MPI's data, every root."""
    mpi = MPI.COMM_WORLD
    monkeypatch.setattr(communicator, "SHARED_BYTES", 256 << 10)  # a small inbox: buffers beyond it stay small
    comm = make_comm(small_bytes=1024, shared_memory=shared)
    n, r = comm.size, comm.rank
    launched = []
    launch = comm._launch
    comm._launch = lambda ctx, *args: (launched.append(ctx.collective), launch(ctx, *args))
    count = (communicator.SHARED_BYTES // 8 if shared else 4096) * n + 5  # beyond the window when there is one
    rng = np.random.default_rng([shared_seed(mpi), r])
    pool = np.zeros(2 * count + 8)
    lo, hi = comm.shard_bounds(count)[r]
    for k in range(8):
        at = pool[(k // 4) * count :][:count]  # two addresses, four calls each, a fresh view every call
        for root in range(n):
            at[...] = rng.standard_normal(count)
            want = gather_all(mpi, at)[root]
            assert comm.broadcast(at, root) is at and at.tobytes() == want.tobytes(), (k, root)
        shard = rng.standard_normal(hi - lo)
        want = np.concatenate(gather_all(mpi, shard))
        assert comm.all_gather(shard, out=at) is at and at.tobytes() == want.tobytes(), k
        at[...] = 0
        at[lo:hi] = shard
        assert comm.all_gather(at[lo:hi], out=at) is at and at.tobytes() == want.tobytes(), k
    assert all(isinstance(plan, engine.Plan) for plan in comm._plans.values()), comm._plans
    # the full path: the first call of each root and of the all-gather at each address, nothing else
    assert launched == (["broadcast"] * n + ["all_gather"]) * 2, launched
    with pytest.raises(ValueError, match="shard overlaps out but is not out"):
        comm.all_gather(at[lo + 1 : hi + 1] if lo == 0 else at[lo - 1 : hi - 1], out=at)
    strided = np.zeros(2 * count)[::2]  # (the lane's key: out's count and dtype; its address unreadable)
    for shard in (np.ones(hi - lo), strided[lo:hi]):
        with pytest.raises(TypeError, match="not C-contiguous"):
            comm.all_gather(shard, out=strided)
    comm.close()


@pytest.mark.parallel(nprocs=[2, 4])
def test_small_all_reduces_gather_with_mpi_and_fold_in_ring_order():
    """The persistent MPI_Allgather path is bitwise the ring's result, on every op and rank."""
    mpi = MPI.COMM_WORLD
    fast, ring = make_comm(shared_memory=False), make_comm(small_bytes=0, shared_memory=False)
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    for count in (0, 1, 5, 16 * mpi.size + 3, 1000):
        for op in ("sum", "prod", "min", "max", "avg"):
            x = rng.standard_normal(count).astype(np.float32)
            a, b = comm_result(fast, x, op), comm_result(ring, x, op)
            assert a.tobytes() == b.tobytes(), (count, op)
            assert mpi.allgather(a.tobytes()) == [a.tobytes()] * mpi.size
    assert all(key[0] == "host" for key in fast._gathers) and fast._gathers
    fast.close()
    ring.close()


def comm_result(comm: ringcomm.Communicator, x: np.ndarray, op: str) -> np.ndarray:
    out = np.empty_like(x)
    comm.all_reduce(x, op, out=out)
    return out


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_small_all_reduce_mismatch_is_an_error_on_every_rank(shared):
    """A collective carries no tag: the gathered blocks' headers (MPI's gather, or the shared
    window's slots) catch ranks in different calls."""
    mpi = MPI.COMM_WORLD
    r = mpi.rank
    for x, match in (
        (np.ones(8, np.int32 if r == 0 else np.float32), "did not make the same call"),  # same size, other dtype
        (np.ones(8 if r == 0 else 6, np.float32), "did not make the same call|longer block"),  # other count
    ):
        comm = make_comm(shared_memory=shared)
        comm.all_reduce(np.ones(4, np.float32))
        with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError), match=match + "|aborted") as info:
            comm.all_reduce(x)
        seen = mpi.allgather(type(info.value).__name__)
        assert "MismatchError" in seen, seen


@pytest.mark.parallel(nprocs=[3, 4, 5])
def test_direct_all_reduce_is_bitwise_the_ring():
    """On one node, 3+ ranks: two rounds of direct messages, folded in the ring's order
    (engine.DirectPlan); a reduce-scatter the first round alone, bitwise the ring's too."""
    from ringcomm.engine import DirectPlan, Plan

    mpi = MPI.COMM_WORLD
    direct, ring = make_comm(small_bytes=0, shared_memory=False), make_comm(small_bytes=0, shared_memory=False)
    ring.single_node = False  # as if the ring left the node: the ring plan runs
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    for count in (1, 5, 16 * mpi.size - 1, 40003):
        for dtype in (np.float32, np.float16):
            for op in ("sum", "prod", "min", "max", "avg"):
                x = rng.standard_normal(count).astype(dtype)
                a, b = comm_result(direct, x, op), comm_result(ring, x, op)
                assert a.tobytes() == b.tobytes(), (count, dtype, op)
                y = x.copy()
                direct.all_reduce(y, op)  # in place
                assert y.tobytes() == a.tobytes(), (count, dtype, op, "in place")
                assert mpi.allgather(a.tobytes()) == [a.tobytes()] * mpi.size
                shard = direct.reduce_scatter(x, op)
                assert shard.tobytes() == ring.reduce_scatter(x, op).tobytes(), (count, dtype, op, "reduce_scatter")
                lo, hi = direct.shard_bounds(count)[direct.rank]
                assert shard.tobytes() == a[lo:hi].tobytes(), (count, dtype, op, "reduce_scatter's shard")
    assert all(isinstance(p, DirectPlan) for p in direct._plans.values()) and direct._plans
    assert all(isinstance(p, Plan) for p in ring._plans.values()) and ring._plans
    want = sum(np.arange(1000.0) * (r + 1) for r in range(mpi.size))
    before = direct.bytes_sent
    got = direct.all_reduce(np.arange(1000.0) * (mpi.rank + 1))
    assert np.array_equal(got, want)
    lo, hi = direct.shard_bounds(1000)[direct.rank]
    assert direct.bytes_sent - before == (1000 - (hi - lo) + (mpi.size - 1) * (hi - lo)) * 8
    before = direct.bytes_sent
    assert np.array_equal(direct.reduce_scatter(np.arange(1000.0) * (mpi.rank + 1)), want[lo:hi])
    assert direct.bytes_sent - before == (1000 - (hi - lo)) * 8  # (the ring's bytes: every other chunk once)
    assert {key[0] for key in direct._plans} == {"all_reduce", "reduce_scatter"}
    direct.close()
    ring.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_warm_plan_still_names_the_op_in_its_messages():
    """Plans made by earlier calls (every call number mod 4) are per op: a rank that reduces with
    another op on the same buffers sees a message it did not expect, not wrong data."""
    mpi = MPI.COMM_WORLD
    comm = make_comm(small_bytes=0, shared_memory=False)
    x = np.ones(_ring_count(comm.size), np.float32)
    out = np.empty_like(x)
    for op in ("sum", "max", "sum", "max", "sum", "max", "sum", "max"):
        comm.all_reduce(x, op, out=out)  # the plan at these addresses, prepared for both ops
    assert len(comm._plans) == 1
    with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError)) as info:
        comm.all_reduce(x, "max" if mpi.rank == 0 else "sum", out=out)
    seen = mpi.allgather(type(info.value).__name__)
    assert "MismatchError" in seen, seen


def _two_rank_script(name: str, nbytes: str) -> str:
    """Run benchmarks/``name`` (an mpi4py-only script for exactly 2 ranks) on ``nbytes`` under
    mpiexec -n 2, assert that it succeeded and that it refuses 3 ranks; return its stdout."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / name
    run = subprocess.run(
        ["mpiexec", "-n", "2", sys.executable, str(script), nbytes], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    bad = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "run with 2 ranks" in bad.stderr
    return run.stdout


def test_inplace_replica_runs_and_checks_its_results():
    """benchmarks/inplace_replica.py (the README's in-place table): every variant's result is checked."""
    out = _two_rank_script("inplace_replica.py", "4096")
    rows = {line.split()[0] for line in out.splitlines() if line and not line.startswith("#")}
    assert {"direct", "mpiop", "tmp", "sendtmp", "MPI"} <= rows, out


def test_cross_core_probe_runs_and_checks_what_it_reads():
    """benchmarks/cross_core.py (the README's cross-core line costs): both ranks' six timings (written
    and read, handed back, alone), the reads checked (a wrong byte exits non-zero), and a refusal of
    any other number of ranks."""
    out = _two_rank_script("cross_core.py", "65536")
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"], out
    assert all(len(row) == 7 and all(float(v) > 0 for v in row[1:]) for row in rows), out


@pytest.mark.parallel(nprocs=[2, 3])
def test_after_an_agreement_mismatch_small_all_reduces_still_match():
    """check=True: the ranks of a mismatched call each made the small all-reduce of their own count;
    persistent collectives match in init order, so they start afresh and the next calls agree."""
    mpi = MPI.COMM_WORLD
    r, n = mpi.rank, mpi.size
    comm = make_comm(check=True)
    for bad in (
        lambda: comm.all_reduce(np.ones(11 if r == 0 else 10, np.float32)),
        lambda: comm.barrier() if r == 0 else comm.all_reduce(np.ones(6, np.float32)),
    ):
        with pytest.raises(ringcomm.MismatchError):
            bad()
        for count in (10, 6, 4, 10):
            assert (comm.all_reduce(np.ones(count, np.float32)) == n).all()
    comm.close()
