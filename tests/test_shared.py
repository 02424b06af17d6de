"""Host all-reduces through the shared-memory window (transports.shm, engine.SharedDirectPlan):
bitwise the ring's result on every rank, against MPI and float64 on fresh random data; ranks that
drift apart in time; mismatches and missing peers; the window's size and its freeing."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_matches, deadline_barrier, gather_all, make_comm, random_input, shared_seed
from mpi4py import MPI

import ringcomm
from ringcomm import communicator
from ringcomm.engine import SharedDirectPlan, SharedGatherFold
from ringcomm.ops import ReduceOp
from ringcomm.transports import shm

DTYPES = (np.float32, np.float16, np.dtype(ml_dtypes.bfloat16), np.float64, np.int32, np.uint8)


def _counts(n: int, small: int) -> tuple[int, ...]:
    """Empty, below N, not dividing N, both sides of small_bytes (float32), a few thousand."""
    return (0, 1, n - 1 or 1, 16 * n + 3, small // 4, small // 4 + 1, 40_003)


def _assert_the_rings_bits(
    shared: ringcomm.Communicator, ring: ringcomm.Communicator, x: np.ndarray, op: ReduceOp, reference: bool
) -> None:
    """``shared``'s all-reduce of ``x``, out of place and in place, is bitwise ``ring``'s and the same on
    every rank; with ``reference``, within float64's reduction of every rank's ``x``."""
    mpi = MPI.COMM_WORLD
    got, want = np.empty_like(x), np.empty_like(x)
    shared.all_reduce(x, op, out=got)
    ring.all_reduce(x, op, out=want)
    what = f"count {x.size} {x.dtype} {op}"
    assert got.tobytes() == want.tobytes(), what
    y = x.copy()
    shared.all_reduce(y, op)  # in place
    assert y.tobytes() == want.tobytes(), what + " in place"
    assert mpi.allgather(got.tobytes()) == [got.tobytes()] * mpi.size, what
    if reference:
        assert_matches(got, gather_all(mpi, x), op, what)


@pytest.mark.parallel(nprocs=[2, 3, 4, 5])
def test_shared_all_reduces_are_bitwise_the_ring_and_right():
    """Small (slots) and larger (inboxes) all-reduces: the ring's bits for every op and dtype,
    in and out of place, the same on every rank, and within float64's reference."""
    mpi = MPI.COMM_WORLD
    shared, ring = make_comm(small_bytes=4096), make_comm(small_bytes=0, shared_memory=False)
    assert shared._shared is not None and ring._shared is None
    ring.single_node = False  # the ring itself (no direct exchange), the reference bits
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    for count in _counts(mpi.size, 4096):
        for dtype in DTYPES:
            for op in ReduceOp:
                if op is ReduceOp.AVG and np.dtype(dtype).kind in "iu":
                    continue
                x = random_input(rng, count, np.dtype(dtype), op)
                _assert_the_rings_bits(shared, ring, x, op, bool(count) and dtype in (np.float32, np.float64, np.int32))
    kinds = {type(v) for v in shared._gathers.values()} | {type(p) for p in shared._plans.values()}
    assert kinds == {SharedGatherFold, SharedDirectPlan}, kinds
    assert all(v.algorithm == "gather-fold (shared memory)" for v in shared._gathers.values())
    shared.close()
    ring.close()


@pytest.mark.parallel(nprocs=[2, 3, 4, 5])
def test_all_reduces_beyond_the_inbox_run_in_pieces_bitwise_the_ring(monkeypatch):
    """All-reduces larger than the inbox (one element more; two and a half inboxes, not dividing N)
    run in the window in pieces: the ring's bits (every op for float32; sums, and averages or
    maxima, for the other types), in and out of place, the same on every rank, and (float32) within
    float64's reference. (An inbox of 1 MiB and runs of 64 KiB: the defaults' layout at a quarter
    of their size, so that the buffers, 10 MiB at most, are too.)"""
    monkeypatch.setattr(communicator, "SHARED_BYTES", 1 << 20)
    monkeypatch.setattr(communicator, "SHARED_PIECE_BYTES", 64 << 10)
    mpi = MPI.COMM_WORLD
    shared, ring = make_comm(), make_comm(small_bytes=0, shared_memory=False)
    ring.single_node = False  # the ring itself (no direct exchange), the reference bits
    inbox = shared.shared_memory()[1]
    if inbox // mpi.size < communicator.SHARED_PIECE_BYTES:  # (every rank alike: a small /dev/shm shrank the window)
        pytest.skip(f"the window's inbox ({inbox} B) holds no {mpi.size} runs of SHARED_PIECE_BYTES")
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank, 2])
    for dtype in map(np.dtype, DTYPES[:5]):
        for count in (inbox // dtype.itemsize + 1, 5 * inbox // dtype.itemsize // 2 + 7):
            ops = (
                ReduceOp
                if dtype == np.float32
                else (ReduceOp.SUM, ReduceOp.MAX if dtype.kind in "iu" else ReduceOp.AVG)
            )
            for op in ops:
                _assert_the_rings_bits(shared, ring, random_input(rng, count, dtype, op), op, dtype == np.float32)
    pieces = sorted(p.steps // 2 for p in shared._plans.values() if isinstance(p, SharedDirectPlan))
    assert len(pieces) == 10 and pieces[0] == 2 and pieces[-1] >= 3, pieces  # (every call in the window, in pieces)
    shared.close()
    ring.close()


@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_ranks_that_drift_apart_never_read_a_place_being_rewritten():
    """Back-to-back calls of random sizes (small and direct in turn: both slots and the inbox
    reused) with random delays on one rank at a time, nothing else between them: every result is
    exact. (Every rank knows every rank's input, so the expected sums need no communication that
    would resynchronize the ranks.)"""
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    comm = make_comm(small_bytes=2048)
    rng = np.random.default_rng([shared_seed(mpi), 7])  # the same plan of calls on every rank
    calls = []
    for i in range(300):
        count = int(rng.choice([1, 17, 300, 512, 513, 5000, 70_000]))
        inputs = [np.random.default_rng([i, rank]).integers(-1000, 1000, count) for rank in range(n)]
        delay = float(rng.random()) * 1e-3 if rng.random() < 0.3 else 0.0
        calls.append((inputs[r], sum(inputs), bool(rng.random() < 0.5), int(rng.integers(n)), delay))
    got = []
    for x, _, in_place, slow, delay in calls:
        if delay and r == slow:
            time.sleep(delay)
        got.append(comm.all_reduce(x.copy()) if in_place else comm.all_reduce(x, out=np.empty_like(x)))
    for i, (result, (_, want, *_)) in enumerate(zip(got, calls)):
        assert np.array_equal(result, want), f"call {i}, count {want.size}"
    comm.close()


@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_shared_broadcasts_are_the_roots_buffer():
    """Broadcasts in the window (a slot up to its size, the inbox above, up to the inbox's size):
    every root, 5 dtypes, counts 0, 1, below N, not dividing N, both sides of the slots and the
    inbox's size, checked against MPI's own broadcast, bitwise; the chain beyond the window."""
    mpi = MPI.COMM_WORLD
    n = mpi.size
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    comm = make_comm(small_bytes=1024)
    small, direct = comm.shared_memory()
    kinds, inbox = set(), False
    for dtype in (np.float32, np.float16, np.dtype(ml_dtypes.bfloat16), np.float64, np.uint8):
        size = np.dtype(dtype).itemsize
        for count in sorted(
            {0, 1, n - 1 or 1, 16 * n + 3, small // size, small // size + 1, direct // size, direct // size + 1}
        ):
            for root in range(n):
                x = rng.integers(0, 100, count).astype(dtype)
                want = mpi.bcast(x if mpi.rank == root else None, root)
                comm.broadcast(x, root)
                assert x.tobytes() == want.tobytes(), f"{dtype} count={count} root={root}"
                plans = comm._plans.values()  # (the cache is emptied when full: looked at after each call)
                kinds |= {type(p).__name__ for p in plans}
                inbox |= any(type(p).__name__ == "SharedPlacesPlan" and p.shared.twice for p in plans)
    assert "SharedPlacesPlan" in kinds and "Plan" in kinds, kinds  # the window, and the chain beyond it
    assert inbox == (n > 2)  # at 2 ranks beyond the slots the chain runs
    comm.close()


@pytest.mark.parallel(nprocs=[2, 3, 4, 5])
def test_shared_reduce_scatters_reduces_and_all_gathers_are_bitwise_the_ring_and_right(monkeypatch):
    """Reduce-scatters (every op, 5 dtypes; out apart from x, and out this rank's shard of x),
    reduces (every op and dtype, roots in turn by count; out apart, and in place) and all-gathers (out
    given, in place, and out=None with shards of any size) in the window, a slot up to its size
    and the inbox above: counts 0, 1, below N, not dividing N, both sides of the slots' and of the
    inbox's size. The ring's (the chain's) bits on every rank, MPI's reduce-scatter, reduce and
    all-gather within float64's reference (bitwise for the gathers), and the ring (chain) beyond
    the window. (What is wrong is collected and agreed on at the
    end: a rank that failed at once would leave the others in this test's MPI calls.)"""
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    rng = np.random.default_rng([shared_seed(mpi), r])
    monkeypatch.setattr(communicator, "SHARED_BYTES", 256 << 10)  # a small inbox: buffers beyond it stay small
    comm, ring = make_comm(small_bytes=1024), make_comm(shared_memory=False)
    small, direct = comm.shared_memory()
    kinds = set()  # which kinds of place the calls of one count used
    wrong: list = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            wrong.append(f"rank {r}: {what}")

    for dtype in (np.float32, np.float16, np.dtype(ml_dtypes.bfloat16), np.float64, np.int32):
        size = np.dtype(dtype).itemsize
        beyond = n * (direct // size) + 1  # a shard beyond the inbox: the ring
        for count in sorted(
            {
                0,
                1,
                n - 1 or 1,
                16 * n + 3,
                small // size,
                small // size + 1,
                n * (small // size) + 1,
                direct // size,
                direct // size + 1,
                beyond,
            }
        ):
            bounds = comm.shard_bounds(count)
            lo, hi = bounds[r]
            root = count % n  # (one reduce plan per count in the cache)
            for op in ReduceOp:
                if op is ReduceOp.AVG and np.dtype(dtype).kind in "iu":
                    continue
                x = random_input(rng, count, np.dtype(dtype), op)
                got, want = comm.reduce_scatter(x, op), ring.reduce_scatter(x, op)
                what = f"reduce_scatter count {count} {np.dtype(dtype)} {op}"
                check(got.tobytes() == want.tobytes(), what)
                y = x.copy()
                check(comm.reduce_scatter(y, op, out=y[lo:hi]).tobytes() == want.tobytes(), what + ", out aliasing x")
                total, chain = (c.reduce(x, op, root, out=np.empty_like(x)) for c in (comm, ring))
                y = x.copy()
                mine = comm.reduce(y, op, root)  # (in place)
                what_r = f"reduce count {count} {np.dtype(dtype)} {op} root {root}"
                if r == root:
                    check(total.tobytes() == chain.tobytes() == mine.tobytes(), what_r)
                else:
                    check(total is None and mine is None and y.tobytes() == x.tobytes(), what_r + ", not the root")
                if count and dtype in (np.float32, np.float64, np.int32):
                    every = gather_all(mpi, x)
                    try:
                        assert_matches(got, [a[lo:hi] for a in every], op, what)
                        if r == root:
                            assert_matches(total, every, op, what_r)
                    except AssertionError as e:
                        check(False, str(e))
            shard = random_input(rng, hi - lo, np.dtype(dtype), ReduceOp.SUM)
            want = np.concatenate(gather_all(mpi, shard))
            out = comm.all_gather(shard, out=np.empty(count, dtype))
            check(out.tobytes() == want.tobytes() == ring.all_gather(shard).tobytes(), f"all_gather {count} {dtype}")
            whole = np.empty(count, dtype)
            whole[lo:hi] = shard
            check(comm.all_gather(whole[lo:hi], out=whole).tobytes() == want.tobytes(), f"in place {count} {dtype}")
            mine = random_input(rng, int(rng.integers(0, count + 1)), np.dtype(dtype), ReduceOp.SUM)  # any sizes
            check(
                comm.all_gather(mine).tobytes() == np.concatenate(gather_all(mpi, mine)).tobytes(), f"out=None {count}"
            )
            windowed = {
                key[0]: plan.shared.twice
                for key, plan in comm._plans.items()  # (emptied when full)
                if key[2] == np.dtype(dtype) and key[3][-1][1] == count and key[-1] == "shared"
            }
            if count == beyond:
                check(windowed == {}, f"beyond the inbox: {windowed}")
            elif count:
                kinds.add(tuple(sorted(windowed.items())))
    assert sum(mpi.allgather(wrong), []) == []
    slots, inboxes = (False,) * 3, (True,) * 3
    assert {
        tuple(zip(("all_gather", "reduce", "reduce_scatter"), twice))  # in slots, in inboxes
        for twice in (slots, (False, True, True), inboxes)
    } <= kinds, kinds
    comm.close()
    ring.close()


@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_shared_places_are_never_rewritten_while_a_rank_still_reads_them(monkeypatch):
    """Reduce-scatters, all-gathers, broadcasts, reduces and all-reduces back to back, in slots and in inboxes,
    with every rank but rank 0 slow, at random, to read the others' places (its copies out and folds) and to
    write its reduced chunk into the others' inboxes, and no other handshake between them: every call gets
    its own call's data."""
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    comm = make_comm(small_bytes=4096)
    inbox = comm.shared_memory()[1] // 8 - 8  # float64 elements: a whole buffer just within the inbox
    host, slow = comm._host, np.random.default_rng(r + 1)

    def late(method):
        def call(*args, **kw):
            if r != 0 and slow.random() < 0.3:
                time.sleep(0.002)
            return method(*args, **kw)

        return call

    monkeypatch.setattr(host, "copy", late(host.copy))
    monkeypatch.setattr(host, "fold", late(host.fold))
    plan = np.random.default_rng([shared_seed(mpi), 3])  # the same calls on every rank
    for call in range(60):
        count = int(plan.choice([100, inbox]))  # slots, inboxes
        x = np.full(count, call * n + r, np.float64)
        lo, hi = comm.shard_bounds(count)[r]
        kind = int(plan.integers(5))
        if kind == 0:
            assert (comm.reduce_scatter(x) == sum(call * n + q for q in range(n))).all(), f"reduce_scatter {call}"
        elif kind == 1:
            got = comm.all_gather(x[lo:hi], out=np.empty(count))
            assert all((got[a:b] == call * n + q).all() for q, (a, b) in enumerate(comm.shard_bounds(count))), call
        elif kind == 2:
            comm.broadcast(x, call % n)
            assert (x == call * n + call % n).all(), f"broadcast {call}"
        elif kind == 3:
            got = comm.reduce(x, "sum", call % n)
            assert got is None if r != call % n else (got == sum(call * n + q for q in range(n))).all(), (
                f"reduce {call}"
            )
        else:  # (beyond the slots: two and a half inboxes, in 3 pieces)
            x = x if count == 100 else np.full(5 * inbox // 2, call * n + r, np.float64)
            got = comm.all_reduce(x) if call % 2 else comm.all_reduce(x, out=np.empty_like(x))
            assert (got == sum(call * n + q for q in range(n))).all(), f"all_reduce {call}"
    comm.close()


@pytest.mark.parallel(nprocs=[3, 4])
def test_a_root_never_rewrites_its_inbox_while_a_rank_still_copies_it_out(monkeypatch):
    """Broadcasts from one root back to back, with the other ranks slow to copy the data out of the
    root's inbox (and all-reduces between them): each gets its own call's data. (With a single
    publication the root would overwrite its inbox with the next call's data first.)"""
    mpi = MPI.COMM_WORLD
    comm = make_comm(small_bytes=0)
    count = comm.shared_memory()[1] // 8  # the inbox, whole (3 or more ranks)
    copy = comm._host.copy
    slow = np.random.default_rng(mpi.rank + 1)

    def late_copy(dst, src):
        if mpi.rank != 0 and slow.random() < 0.5:
            time.sleep(0.005)
        copy(dst, src)

    monkeypatch.setattr(comm._host, "copy", late_copy)
    for call in range(12):
        x = np.full(count, call if mpi.rank == 0 else -1, np.float64)
        comm.broadcast(x, 0)
        assert (x == call).all(), f"broadcast {call}: {np.unique(x)}"
        if call % 4 == 3:
            assert (comm.all_reduce(np.ones(count // 2)) == mpi.size).all()
    comm.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_mismatch_in_shared_memory_is_an_error_on_every_rank():
    """The headers catch another dtype of the same size, another op, another count, a rank in the
    other kind of shared call (its buffer above small_bytes), a broadcast from another root, and a
    broadcast against an all-reduce; every rank raises."""
    mpi = MPI.COMM_WORLD
    r = mpi.rank
    cases = (
        (lambda c: c.all_reduce(np.ones(8, np.int32 if r == 0 else np.float32))),
        (lambda c: c.all_reduce(np.ones(5000, np.float32), "max" if r == 0 else "sum")),
        (lambda c: c.all_reduce(np.ones(5000 if r == 0 else 5001, np.float32))),
        (lambda c: c.all_reduce(np.ones(100 if r == 0 else 5000, np.float32))),  # slots against the inbox
        (lambda c: c.broadcast(np.ones(100, np.float32), 0 if r == 0 else 1)),  # another root
        (lambda c: c.broadcast(np.ones(100, np.float32)) if r == 0 else c.all_reduce(np.ones(100, np.float32))),
    )
    for call in cases:
        comm = make_comm(small_bytes=1024)
        assert (comm.all_reduce(np.ones(4000, np.float32)) == mpi.size).all()
        with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError)) as info:
            call(comm)
        seen = mpi.allgather(type(info.value).__name__)
        assert "MismatchError" in seen, seen
        if isinstance(info.value, ringcomm.MismatchError):
            assert "in shared memory): the ranks did not make the same call" in str(info.value)
            if call is cases[3]:  # each rank's header says which kind of call it is in
                assert ", in slots" in str(info.value) and ", in inboxes" in str(info.value), info.value
        comm.close()  # an aborted communicator keeps its window (a late peer may still read it)


@pytest.mark.parallel(nprocs=[2, 3])
def test_an_abort_sent_to_a_closed_communicator_does_not_abort_the_next():
    """Ranks that all raise MismatchError abort and tell each other, and close before reading those
    notes; MPI gives the next communicator the freed one's context, so the notes reach it. They
    name their communicator and are dropped (a late rank 0 makes the others' wait look for them)."""
    mpi = MPI.COMM_WORLD
    comm = make_comm(timeout=5)
    with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError)):
        comm.all_reduce(np.ones(8, np.int32 if mpi.rank == 0 else np.float32))
    comm.close()
    mpi.Barrier()
    for _ in range(2):
        comm = make_comm(timeout=5)
        if mpi.rank == 0:
            time.sleep(0.2)
        assert (comm.all_reduce(np.ones(10)) == mpi.size).all()
        comm.close()


@pytest.mark.parallel(nprocs=[2])
def test_ranks_whose_small_bytes_differ_meet_in_the_window_and_mismatch():
    """With a window, what its slots cannot hold goes to the inbox, never to an MPI gather: a
    buffer that one rank gathers (small_bytes above it) and the other reduces directly is a
    MismatchError (or both run the direct all-reduce and agree), not a timeout."""
    mpi = MPI.COMM_WORLD
    cases = (
        ((65536, 0), 1000),  # slots against the inbox: MismatchError on both
        ((2 << 20, 65536), 300_000),
    )  # beyond the slots (1 MiB) on both: the inbox on both
    for small, count in cases:
        comm = make_comm(timeout=5, small_bytes=small[mpi.rank])
        start = time.monotonic()
        x = np.ones(count, np.float32)
        if count * 4 <= comm.shared_memory()[0]:
            with pytest.raises(ringcomm.MismatchError, match=", in slots"):
                comm.all_reduce(x)
        else:
            assert (comm.all_reduce(x) == mpi.size).all()
        assert time.monotonic() - start < 2
        comm.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_call_in_the_window_on_one_rank_and_outside_it_on_another_is_a_mismatch(monkeypatch):
    """Counts that put the same call on both sides of a window size (the inbox's, an all-reduce's
    in a window too small for its pieces; a broadcast at 2 ranks, the slots'), and an all-reduce
    against a reduce in the window: a rank
    outside sees the other's header in the window (the only sign when the ranks outside wait for
    a message that nobody sends: a broadcast whose root is in the window), one inside a message of
    its call; all raise at once (a MismatchError, or the AbortError it sends), not after the timeout. (A chain's
    rank whose sends complete at once may return. See README, "What only check=True catches".)"""
    mpi = MPI.COMM_WORLD
    r, n = mpi.rank, mpi.size

    def across(c, size, outside=0):  # a count just within the window, on every rank but ``outside`` beyond it
        return np.ones(size // 4 + (64 if r == outside else 0), np.float32)

    def gather_in_place(c, out):
        lo, hi = c.shard_bounds(out.size)[r]
        return c.all_gather(out[lo:hi], out=out)

    cases = (
        ("all_reduce", lambda c, d, s: c.all_reduce(across(c, c._window_limit("all_reduce")))),
        ("broadcast", lambda c, d, s: c.broadcast(across(c, c._window_limit("broadcast")), 0)),
        (
            "broadcast",
            lambda c, d, s: c.broadcast(across(c, c._window_limit("broadcast"), outside=1), 0),
        ),  # (nothing is sent)
        ("reduce_scatter", lambda c, d, s: c.reduce_scatter(across(c, d))),
        ("all_gather", lambda c, d, s: gather_in_place(c, across(c, n * c._window_limit("all_gather")))),
        ("reduce", lambda c, d, s: c.reduce(across(c, d))),  # (the root outside)
        ("reduce", lambda c, d, s: c.reduce(across(c, d, outside=1))),
        ("reduce", lambda c, d, s: c.reduce(np.ones(100, np.float32)) if r else c.all_reduce(np.ones(100, np.float32))),
    )
    inbox = communicator.SHARED_BYTES
    for name, call in cases:
        # (an all-reduce stays in the window at every size while the inbox holds N runs of SHARED_PIECE_BYTES)
        monkeypatch.setattr(communicator, "SHARED_BYTES", 256 << 10 if name == "all_reduce" else inbox)
        comm = make_comm(timeout=10, small_bytes=1024)
        small, direct = comm.shared_memory()
        start = time.monotonic()
        try:
            call(comm, direct, small)
            raised = None
        except ringcomm.RingcommError as e:  # (a timeout too: every rank then fails below, none waits)
            raised = type(e).__name__
        took = time.monotonic() - start
        seen = mpi.allgather(raised)
        assert "MismatchError" in seen and "TimeoutError" not in seen, (name, seen)
        # (ranks of a chain whose sends completed at once may return: the root of a broadcast, the
        # senders of a reduce, which receive nothing or what they expected)
        assert all(
            s or (rank == 0) == (name == "broadcast") and name in ("broadcast", "reduce") for rank, s in enumerate(seen)
        ), (name, seen)
        assert max(mpi.allgather(took)) < 5, (name, took)
        with contextlib.suppress(ringcomm.RingcommError):
            comm.close()  # (a chain's first rank learns of the abort here)
        mpi.Barrier()


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_missing_peer_in_shared_memory_times_out_naming_it():
    mpi = MPI.COMM_WORLD
    late = mpi.size - 1
    for count in (100, 100_000):  # a slot, the inbox
        comm = make_comm(timeout=0.5)
        if mpi.rank != late:
            with pytest.raises((ringcomm.TimeoutError, ringcomm.AbortError)) as info:
                comm.all_reduce(np.ones(count, np.float32))
            e = info.value
            assert e.collective == "all_reduce" and e.step == 0
            if isinstance(e, ringcomm.TimeoutError):
                assert e.peer == late and f"rank {late}'s whole buffer in shared memory" in str(e)
        mpi.Barrier()


@pytest.mark.parallel(nprocs=[2])
def test_close_frees_the_window_and_a_missing_peer_in_close_times_out():
    mpi = MPI.COMM_WORLD
    comm = make_comm()
    window = comm._shared
    comm.all_reduce(np.ones(10))
    comm.close()
    assert comm._shared is None and window.regions == []
    comm = make_comm(timeout=0.5)
    window = comm._shared
    if mpi.rank == 0:
        with pytest.raises(ringcomm.TimeoutError, match=r"close\(\): rank 0 waited 0.5 s.*close\(\)"):
            comm.close()
    else:
        # late: its first barrier completes against rank 0's abandoned one; it must not then hang
        # in MPI_Win_free (which rank 0 never calls) but learn that rank 0 gave up
        time.sleep(1.0)
        start = time.monotonic()
        with pytest.raises((ringcomm.AbortError, ringcomm.TimeoutError)) as info:
            comm.close()
        assert time.monotonic() - start < 5 and info.value.collective == "close()"
    assert comm._aborted and window.regions  # kept mapped: a peer that gave up never frees it
    with pytest.raises(ringcomm.RingcommError, match="aborted|closed"):
        comm.all_reduce(np.ones(10))
    deadline_barrier(mpi)


@pytest.mark.parallel(nprocs=[2, 3])
def test_an_error_in_a_with_block_goes_on_and_the_others_do_not_wait_for_it():
    """A rank whose ``with`` block raises closes without waiting (its peers would never come):
    its exception goes on, and the peers' close() raises AbortError at once, not after the timeout."""
    mpi = MPI.COMM_WORLD
    start = time.monotonic()
    if mpi.rank == 1:
        with pytest.raises(KeyError, match="local"):
            with make_comm(timeout=30) as comm:
                comm.all_reduce(np.ones(10))
                raise KeyError("local")
    else:
        with pytest.raises(ringcomm.AbortError, match="rank 1.*KeyError") as info:
            with make_comm(timeout=30) as comm:
                comm.all_reduce(np.ones(10))
        assert info.value.collective == "close()"
    assert time.monotonic() - start < 10
    assert comm._aborted
    deadline_barrier(mpi)


@pytest.mark.parallel(nprocs=[2])
def test_sys_exit_0_in_a_with_block_closes_with_the_others():
    mpi = MPI.COMM_WORLD
    with pytest.raises(SystemExit) if mpi.rank == 1 else contextlib.nullcontext():
        with make_comm(timeout=30) as comm:
            comm.all_reduce(np.ones(10))
            if mpi.rank == 1:
                sys.exit(0)
    assert comm._aborted == communicator._CLOSED and comm._shared is None  # freed together, no abort
    deadline_barrier(mpi)


@pytest.mark.parallel(nprocs=[2])
def test_no_window_when_turned_off_or_without_room():
    off = make_comm(shared_memory=False)
    assert off._shared is None
    x = np.ones(100)
    assert (off.all_reduce(x) == 2).all()
    assert all(v.algorithm == "gather-fold (MPI_Allgather_init)" for v in off._gathers.values())
    off.close()


def test_window_sizes_fit_the_budget():
    """Slots of small_bytes and an inbox of SHARED_BYTES, shrunk to fit a quarter
    of /dev/shm's free space and SHARED_TOTAL_BYTES, then dropped."""
    big = 1 << 40
    assert communicator._window_bytes(4, 65536, big) == (65536, communicator.SHARED_BYTES)
    assert communicator._window_bytes(2, 65536, big) == (65536, communicator.SHARED_BYTES)
    assert communicator._window_bytes(4, 1 << 30, big)[0] == communicator.SHARED_SMALL_BYTES
    small, direct = communicator._window_bytes(64, 65536, big)
    assert small == 65536 and 0 < direct < communicator.SHARED_BYTES
    assert 64 * shm.region_bytes(64, small, direct) <= communicator.SHARED_TOTAL_BYTES
    assert communicator._window_bytes(4, 65536, 4 * 4 * shm.region_bytes(4, 65536, 0)) == (65536, 0)
    assert communicator._window_bytes(4, 65536, 1000) is None
    assert communicator._window_bytes(4, 0, 1000) is None


@pytest.mark.parallel(nprocs=[2])
def test_the_fast_lane_refuses_what_the_full_path_refuses(caplog):
    """Once a small all-reduce is cached, a bad op is still the full path's ValueError, raised
    before any communication (an unhashable op must not reach the lane's dictionary); a smaller
    small_bytes set later sends it to the ring, as the full path does."""
    comm = make_comm()
    x = np.ones(16, np.float32)
    comm.all_reduce(x)
    for bad in (["sum"], {"op": "sum"}, 3, "median"):
        with pytest.raises(ValueError, match="unsupported op"):
            comm.all_reduce(x, bad)
    with pytest.raises(TypeError, match="would silently floor"):
        comm.all_reduce(np.ones(16, np.int32), "avg")
    assert (comm.all_reduce(x) == 4).all()  # nothing moved: the ranks are still in step
    comm.small_bytes = 0  # no gather from now on, though it is cached
    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        assert (comm.all_reduce(x) == 8).all()
    assert "algorithm=direct (shared memory)" in caplog.text, caplog.text
    comm.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_the_fast_lane_checks_overlap_on_every_call_and_numbers_its_calls():
    """The lane remembers the last pair of arrays it found apart (Communicator._apart), never a
    verdict on other arrays: a new out that partly overlaps x is the full path's ValueError, on
    views of the same buffer as a pair found apart before, also after the arrays that pair held
    are gone. Its reused Context names each call's own number: ranks in different ops of cached
    lanes raise a MismatchError naming that call."""
    comm = make_comm()
    n = comm.size
    buf = np.zeros(64, np.float32)
    a, b = buf[:16], buf[16:32]
    for _ in range(3):
        a[...] = 1
        assert comm.all_reduce(a, out=b) is b and (b == n).all() and (a == 1).all()
    assert comm._apart is not None and comm._apart[0]() is a and comm._apart[1]() is b
    for x, out in ((buf[8:24], b), (a, buf[8:24]), (buf[16:32], buf[24:40])):
        with pytest.raises(ValueError, match="partly overlaps"):
            comm.all_reduce(x, out=out)
    del a, b
    c, d = buf[:16], buf[8:24]  # (may take the ids of the pair that is gone)
    with pytest.raises(ValueError, match="partly overlaps"):
        comm.all_reduce(c, out=d)
    x = np.ones(16, np.float32)
    assert (comm.all_reduce(x.copy(), "max") == 1).all()  # both lanes made: calls 4 and 5
    assert (comm.all_reduce(x.copy(), "sum") == n).all()
    assert comm._calls == 5 and set(next(iter(comm._gathers.values())).lanes) == {ReduceOp.SUM, ReduceOp.MAX}
    with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError), match=r"call 6\b"):
        comm.all_reduce(x.copy(), "sum" if comm.rank == 0 else "max")


@pytest.mark.parallel(nprocs=[2, 3])
def test_all_reduces_stay_in_the_window_in_pieces_and_other_calls_leave_it_where_the_ring_is_faster(
    caplog, monkeypatch
):
    """An all-reduce runs in the window at every size while an inbox holds N runs of
    SHARED_PIECE_BYTES: in one piece (2 waits) up to the inbox, in two beyond it; in a smaller
    window it leaves it beyond the inbox (the ring at 2 ranks, the direct exchange at 3 or more).
    Reduce-scatters run there up to the inbox at every N; all-gathers at 2 ranks up to shards of
    their pair limit (the single-copy ring beyond: in place twice as fast), at 3 or more up to the
    inbox; broadcasts at 2 ranks up to the slots and their pair limit (the chain's one message
    beyond), at 3 or more up to the inbox."""
    default = communicator.SHARED_BYTES
    for size in (
        256 << 10,
        default,
    ):  # (the smaller inbox does not hold N runs of SHARED_PIECE_BYTES, the default does)
        monkeypatch.setattr(communicator, "SHARED_BYTES", size)
        comm = make_comm()
        n, inbox = comm.size, comm.shared_memory()[1]
        pieces = inbox // n >= communicator.SHARED_PIECE_BYTES
        assert pieces == (size == default) and comm._window_limit("all_reduce") == (math.inf if pieces else inbox)
        beyond = (
            ("direct (shared memory)", 4) if pieces else ("direct" if n > 2 else "ring", 2 if n > 2 else 2 * (n - 1))
        )
        for nbytes, (algorithm, steps) in ((inbox, ("direct (shared memory)", 2)), (inbox + 64, beyond)):
            x = np.ones(nbytes // 4, np.float32)
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="ringcomm"):
                assert (comm.all_reduce(x) == n).all()
            assert f"algorithm={algorithm} transport" in caplog.text and f"steps={steps} " in caplog.text, (
                nbytes,
                caplog.text,
            )
        if not pieces:
            comm.close()
    # counts a header cannot carry (shm.COUNT_LIMIT, 2**31) leave the window: here a limit of 20000 elements
    monkeypatch.setattr(shm, "COUNT_LIMIT", 20_000)
    for count, algorithm in ((19_999, "direct (shared memory)"), (20_000, "direct" if n > 2 else "ring")):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="ringcomm"):
            assert (comm.all_reduce(np.ones(count, np.float32)) == n).all()
        assert f"algorithm={algorithm} transport" in caplog.text, (count, caplog.text)
    monkeypatch.undo()
    x = np.ones(inbox // 4, np.float32)  # a reduce-scatter's buffer fills the inbox at every N
    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        comm.reduce_scatter(x)
    assert "(shared memory)" in caplog.text.splitlines()[-1], caplog.text
    shard_limit = comm._window_limit("all_gather")  # all-gathers: at 2 ranks shards up to the pair limit
    pair = communicator.SHARED_PAIR_LIMITS
    assert shard_limit == (min(inbox, pair["all_gather"]) if n == 2 else inbox)
    for shard_bytes, shared in ((shard_limit, True), (shard_limit + 64, False)):
        shard = np.full(shard_bytes // 4, comm.rank, np.float32)
        with caplog.at_level(logging.DEBUG, logger="ringcomm"):
            out = comm.all_gather(shard)
        assert ("(shared memory)" in caplog.text.splitlines()[-1]) == shared, (shard_bytes, caplog.text)
        assert (out == np.repeat(np.arange(n, dtype=np.float32), shard.size)).all()
    bcast = comm._window_limit("broadcast")  # broadcasts: at 2 ranks up to the slots and their pair limit
    assert bcast == (min(comm.shared_memory()[0], pair["broadcast"]) if n == 2 else inbox)
    for nbytes, shared in ((bcast, True), (bcast + 64, False)):
        x = np.full(nbytes // 4, comm.rank, np.float32)
        with caplog.at_level(logging.DEBUG, logger="ringcomm"):
            comm.broadcast(x, 1)
        line = caplog.text.splitlines()[-1]
        assert ("(shared memory)" in line) == shared, (nbytes, caplog.text)
        assert shared or "algorithm=chain transport" in line, (nbytes, caplog.text)  # beyond: the chain
        assert (x == 1).all()
    comm.close()


@pytest.mark.parallel(nprocs=[2, 3])
def test_the_broadcast_lane_is_the_roots_buffer_and_refuses_what_the_full_path_refuses(caplog):
    """Once a count, dtype and root ran in the window, the next such broadcast takes the lane
    (collectives.broadcast): the root's buffer on every rank, every root in turn, in calls
    numbered as the full path numbers them; what the full path refuses it still refuses, with
    the full path's message (a bool root, a read-only or non-contiguous x off the root, stream=);
    ranks in different roots' lanes raise a MismatchError naming the call; the lanes go with
    the plans."""
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    comm = make_comm()
    launched = []  # the full path's calls
    launch = comm._launch
    comm._launch = lambda ctx, *args: (launched.append(ctx.collective), launch(ctx, *args))
    rng = np.random.default_rng([shared_seed(mpi), r])
    for k in range(3 * n):
        root = k % n
        for dtype, count in ((np.float32, 13), (np.uint8, 5)):
            x = rng.integers(0, 100, count).astype(dtype)
            want = mpi.bcast(x if r == root else None, root)
            assert comm.broadcast(x, root) is x and x.tobytes() == want.tobytes(), (k, dtype)
            y = x.reshape(1, -1).copy()  # (2-D, contiguous: the lane too)
            assert comm.broadcast(y, root) is y and y.tobytes() == want.tobytes()
    assert set(comm._lanes) == {
        ("broadcast", c, np.dtype(d), q) for d, c in ((np.float32, 13), (np.uint8, 5)) for q in range(n)
    }
    assert comm._calls == 3 * n * 4 and len(launched) == 2 * n  # the first of each count, dtype and root
    x = np.ones(13, np.float32)
    with pytest.raises(ValueError, match="root must be an integer rank"):
        comm.broadcast(x, True)  # (not the lane of root 1)
    with pytest.raises(TypeError, match="stream= applies to GPU arrays only"):
        comm.broadcast(x, 0, stream=object())
    assert (comm.broadcast(x, np.int64(0)) == 1).all()  # (an integer root of numpy's: the full path)
    bad = np.ones(26, np.float32)[::2]
    ro = np.ones(13, np.float32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="not C-contiguous"):
        comm.broadcast(bad, 0)
    if r != 0:
        with pytest.raises(TypeError, match="read-only"):
            comm.broadcast(ro, 0)
    assert comm.broadcast(ro, 0) is ro if r == 0 else True  # the root's x is only read
    if r != 0:
        comm.broadcast(x, 0)  # (what the root's read-only call met)
    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        comm.broadcast(x, 0)
    assert "broadcast: rank" in caplog.text and "algorithm=copy (shared memory)" in caplog.text
    calls = comm._calls
    comm._free_plans()
    assert not comm._lanes
    comm.broadcast(x, 0)  # the full path again, then the lane
    comm.broadcast(x, 0)
    assert comm._calls == calls + 2 and comm._lanes
    comm.broadcast(x, 1)  # both lanes made
    with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError), match=rf"call {calls + 4}\b"):
        comm.broadcast(x, 0 if r == 0 else 1)


@pytest.mark.parallel(nprocs=[2, 3])
def test_the_lanes_of_reduce_scatters_reduces_and_all_gathers_are_the_full_paths(caplog):
    """Once a count, dtype (op, root) ran in the window, the next such call takes its lane
    (collectives): bitwise the full path's result (the ring's or chain's order), against MPI's
    own collectives; what the lane does not take (in place where the full path needs a scratch
    or finds the place, an out that aliases x) and what the full path refuses go the full way,
    with its results and messages; ranks in different lanes raise a MismatchError naming the call."""
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    comm = make_comm()
    launched = []
    launch = comm._launch
    comm._launch = lambda ctx, *args: (launched.append(ctx.collective), launch(ctx, *args))
    rng = np.random.default_rng([shared_seed(mpi), r])
    count = 16 * n + 16  # (equal shards)
    lo, hi = comm.shard_bounds(count)[r]
    for k in range(4):
        for op in ("sum", "max"):
            x = rng.standard_normal(count).astype(np.float32)
            everyone = gather_all(mpi, x)
            want = np.empty(count, np.float32)
            mpi.Allreduce(x, want, MPI.SUM if op == "sum" else MPI.MAX)
            assert_matches(comm.reduce_scatter(x, op), [e[lo:hi] for e in everyone], ReduceOp(op), "fresh result")
            out = np.empty(hi - lo, np.float32)
            assert comm.reduce_scatter(x, op, out=out) is out
            assert out.tobytes() == comm.reduce_scatter(x, op).tobytes()
            root = k % n
            got = comm.reduce(x, op, root, out=np.empty(count, np.float32))
            assert (got is None) == (r != root)
            if r == root:
                assert_matches(got, everyone, ReduceOp(op), "reduce")
            y = x.copy()
            assert comm.reduce(y, op, root) is (None if r != root else y)  # (in place at the root: from a copy)
            assert r != root or y.tobytes() == got.tobytes()
            y = x.copy()  # (out is x: in place too, never "apart")
            assert comm.reduce(y, op, root, out=y) is (None if r != root else y)
            assert (r != root or y.tobytes() == got.tobytes()) and (r == root or y.tobytes() == x.tobytes())
            shards = np.empty(count, np.float32)
            assert comm.all_gather(x[lo:hi].copy(), out=shards) is shards
            parts = [e[a:b] for e, (a, b) in zip(everyone, comm.shard_bounds(count))]
            assert shards.tobytes() == np.concatenate(parts).tobytes()
    kinds = {"reduce_scatter", "reduce", "all_gather"}
    assert {key[0] for key in comm._lanes} == kinds
    # the full path: the first call of each key, and the reduces with out x (8), nothing else
    assert launched.count("reduce_scatter") == 2 and launched.count("all_gather") == 1
    assert launched.count("reduce") == 2 * min(n, 4) + 8, launched.count("reduce")
    x = np.ones(count, np.float32)
    for _ in range(2):  # (out aliases x: folded apart, then copied, in the lane as in the full path, but at 2
        x[...] = 1  # ranks x's own shard is folded into at once: one op, whose last operand it is)
        assert (comm.reduce_scatter(x, out=x[lo:hi]) == n).all() and (np.delete(x, range(lo, hi)) == 1).all()
    assert launched.count("reduce_scatter") == 2
    scratches, scratch = [], comm._scratch_array
    comm._scratch_array = lambda *args: (scratches.append(args), scratch(*args))[1]
    for key in [key for key in comm._lanes if key[0] == "reduce_scatter"]:  # (the full path again)
        del comm._lanes[key]
    x[...] = 1
    assert (comm.reduce_scatter(x, out=x[lo:hi]) == n).all() and (np.delete(x, range(lo, hi)) == 1).all()
    assert len(scratches) == (n > 2), scratches
    comm._scratch_array = scratch
    ro = np.ones(count, np.float32)
    ro.flags.writeable = False
    if r == 0:
        with pytest.raises(TypeError, match="read-only"):
            comm.reduce(ro, root=0)  # (in place at the root)
    else:
        with pytest.raises(TypeError, match="dtype float64 differs"):
            comm.reduce(x, root=0, out=np.empty(count, np.float64))  # (off the root too)
    for k in range(3):  # in place: the lane, when the shard is this rank's place in out (a fresh view each time)
        whole = np.full(count, -1.0, np.float32)
        whole[lo:hi] = x[lo:hi] + k
        assert comm.all_gather(whole[lo:hi], out=whole) is whole
        assert (whole == n + k).all()  # (every rank's shard, reduced in place above)
    assert launched.count("all_gather") == 1
    buf = np.zeros(count + 8, np.float32)
    whole = buf[4 : count + 4]
    elsewhere = (lo + 4) % (count - (hi - lo) + 1)  # another place in out, or over it from out's start
    for shard in (buf[lo + 3 : hi + 3], whole[elsewhere : elsewhere + hi - lo] if elsewhere != lo else buf[: hi - lo]):
        with pytest.raises(ValueError, match="shard overlaps out but is not out"):
            comm.all_gather(shard, out=whole)
    big = np.ones(count + 16, np.float32)
    with pytest.raises(ValueError, match="partly overlaps"):
        comm.reduce(big[:count], out=big[16:], root=0)
    with pytest.raises(TypeError, match="differs from the input's float32"):
        comm.reduce_scatter(x, out=np.empty(hi - lo, np.float64))
    with pytest.raises(ValueError, match="out: has"):
        comm.reduce_scatter(x, out=np.empty(hi - lo + 1, np.float32))
    with pytest.raises(ValueError, match="shard: has"):
        comm.all_gather(np.ones(hi - lo + 1, np.float32), out=np.empty(count, np.float32))
    with pytest.raises(ValueError, match="unsupported op"):
        comm.reduce_scatter(x, "median")
    with pytest.raises(TypeError, match="not C-contiguous"):
        comm.reduce(np.ones(2 * count, np.float32)[::2], root=0)
    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        comm.reduce_scatter(x)
    assert "reduce_scatter: rank" in caplog.text
    calls = comm._calls
    with pytest.raises((ringcomm.MismatchError, ringcomm.AbortError), match=rf"call {calls + 1}\b"):
        comm.reduce_scatter(x, "sum" if r == 0 else "max")


def test_the_hosts_bound_fold_is_its_fold():
    """HostDevice.folder (the small all-reduce lane's fold, bound once) gives fold's bits for every
    op, dtype and divisor, whether it is the one ufunc call (one chunk, two views) or fold itself."""
    from ringcomm.devices import HostDevice
    from ringcomm.engine import Fold
    from ringcomm.schedule import partition

    host, rng = HostDevice(), np.random.default_rng(7)
    for n, count in ((2, 5), (2, 40), (3, 5), (5, 100)):
        for dtype in DTYPES:
            for op in ReduceOp:
                if op is ReduceOp.AVG and np.dtype(dtype).kind in "iu":
                    continue
                blocks = [random_input(rng, count, np.dtype(dtype), op) for _ in range(n)]
                pieces = Fold(blocks, partition(count, n), n).pieces
                div = n if op is ReduceOp.AVG else 1
                want, got = np.empty(count, dtype), np.empty(count, dtype)
                host.fold(want, pieces, op, div)
                host.folder(pieces, op, div)(out=got)
                assert got.tobytes() == want.tobytes(), (n, count, np.dtype(dtype), op)


@pytest.mark.parallel(nprocs=[2, 3, 5])
def test_the_lanes_at_every_count_are_exact_and_the_same_everywhere():
    """Empty, one element, below N, not dividing N, and larger: the first call of each count runs the
    full path, the next ones the lanes; every result is exact (small integers) against MPI's data,
    and the same on every rank that holds it."""
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    comm = make_comm()
    rng = np.random.default_rng([shared_seed(mpi), r])
    for count in (0, 1, n - 1 or 1, 16 * n + 3, 1000):
        lo, hi = comm.shard_bounds(count)[r]
        for k in range(3):
            x = rng.integers(0, 50, count).astype(np.float32)
            everyone = gather_all(mpi, x)
            total = np.sum(everyone, axis=0).astype(np.float32) if count else np.zeros(0, np.float32)
            assert comm.reduce_scatter(x).tobytes() == total[lo:hi].tobytes(), (count, k)
            root = k % n
            got = comm.reduce(x, "sum", root, out=np.empty(count, np.float32))
            assert (got is None) == (r != root) and (got is None or got.tobytes() == total.tobytes()), (count, k)
            b = x.copy()
            comm.broadcast(b, root)
            assert b.tobytes() == everyone[root].tobytes(), (count, k)
            out = np.empty(count, np.float32)
            comm.all_gather(x[lo:hi].copy(), out=out)
            parts = [e[a:c] for e, (a, c) in zip(everyone, comm.shard_bounds(count))]
            assert out.tobytes() == np.concatenate(parts).tobytes(), (count, k)
            assert mpi.allgather(out.tobytes()) == [out.tobytes()] * n
    assert {key[0] for key in comm._lanes} == {"reduce_scatter", "reduce", "broadcast", "all_gather"}
    comm.close()
