"""The schedule alone, in one process: partitions, step lists, and a simulator for N = 1..9."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcomm import schedule
from ringcomm.schedule import ALIGN, partition, simulate

ranks = st.integers(1, 9)
counts = st.integers(0, 700)
OPS = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}


@given(counts, ranks)
def test_partition_covers_the_buffer_in_aligned_balanced_ranges(count, n):
    bounds = partition(count, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
        assert a <= b == c
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) < 2 * ALIGN
    for a, _ in bounds:
        assert a % ALIGN == 0 or a == count
    # sizes never grow with the rank: empty shards (small counts) are the last ranks'
    assert sizes == sorted(sizes, reverse=True)


def test_partition_examples_and_errors():
    assert partition(100, 5) == ((0, 32), (32, 64), (64, 80), (80, 96), (96, 100))
    assert partition(3, 4) == ((0, 3), (3, 3), (3, 3), (3, 3))
    assert partition(0, 2) == ((0, 0), (0, 0))
    with pytest.raises(ValueError):
        partition(-1, 2)
    with pytest.raises(ValueError):
        partition(4, 0)


def run(collective: str, n: int, count: int, rng: np.random.Generator, op: str = "sum", root: int = 0, nchunks=None):
    inputs = [rng.integers(-9, 10, count).astype(np.float64) for _ in range(n)]
    k = nchunks or n
    bounds = partition(count, k if collective in ("broadcast", "reduce") else n)
    steps = [schedule.steps_for(collective, n, r, root, k) for r in range(n)]
    return inputs, bounds, simulate(steps, inputs, bounds, op)


@settings(max_examples=60, deadline=None)
@given(ranks, counts, st.sampled_from(["sum", "prod", "min", "max", "avg"]), st.integers(0, 2**32 - 1))
def test_all_reduce_reduce_scatter_all_gather_simulated(n, count, op, seed):
    rng = np.random.default_rng(seed)
    inputs, bounds, out = run("all_reduce", n, count, rng, op)
    fn = OPS.get(op, np.sum)
    want = fn(np.stack(inputs), axis=0) if n else None
    if op == "avg":
        want = want / n
    for r in range(n):
        np.testing.assert_allclose(out[r], want, rtol=1e-12)
        assert out[r].tobytes() == out[0].tobytes(), "ranks differ"
    _, _, rs = run("reduce_scatter", n, count, np.random.default_rng(seed), op)
    for r, (lo, hi) in enumerate(bounds):
        assert rs[r][lo:hi].tobytes() == out[r][lo:hi].tobytes(), "reduce_scatter shard differs from all_reduce"
    # all-gather: rank r starts with only its own chunk; everybody ends with everything
    ag_in = [np.where(np.isin(np.arange(count), np.arange(*bounds[r])), out[0], np.nan) for r in range(n)]
    steps = [schedule.all_gather(n, r) for r in range(n)]
    for res in simulate(steps, ag_in, bounds):
        assert res.tobytes() == out[0].tobytes()


@settings(max_examples=60, deadline=None)
@given(ranks, counts, st.data())
def test_broadcast_and_reduce_simulated(n, count, data):
    root = data.draw(st.integers(0, n - 1))
    nchunks = data.draw(st.integers(1 if n <= 2 else n, 3 * n))  # (two ranks' chains have one piece)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    inputs, _, out = run("broadcast", n, count, rng, root=root, nchunks=nchunks)
    for r in range(n):
        assert out[r].tobytes() == inputs[root].tobytes()
    inputs, _, out = run("reduce", n, count, rng, root=root, nchunks=nchunks)
    np.testing.assert_allclose(out[root], np.sum(np.stack(inputs), axis=0), rtol=1e-12)


def test_chain_pieces():
    """A chain pipelines pieces of about piece_bytes, at least N, at most 8N; two ranks' one hop has
    nothing to overlap: at least one piece (a buffer up to piece_bytes is one step)."""
    assert [schedule.chain_chunks(n, 1 << 18, 4, 1 << 20) for n in (1, 2, 3, 4)] == [1, 1, 3, 4]
    assert [schedule.chain_chunks(n, 16, 4, 1 << 20) for n in (2, 3, 5)] == [1, 3, 5]
    assert [schedule.chain_chunks(n, 1 << 30, 1, 1 << 20) for n in (2, 3)] == [16, 24]
    assert len(schedule.broadcast(2, 1, 0, schedule.chain_chunks(2, 1 << 20, 4, 4 << 20))) == 1


@given(ranks)
def test_step_counts_and_volume(n):
    for r in range(n):
        ar = schedule.all_reduce(n, r)
        assert len(ar) == 2 * (n - 1)
        # each rank sends and receives every chunk but one in each phase: 2(N-1)/N of the buffer
        assert sorted(s.send for s in ar[: n - 1]) == sorted(set(range(n)) - {r})
        assert sorted(s.recv for s in ar[: n - 1]) == sorted(set(range(n)) - {(r - 1) % n})
        if n > 1:
            assert ar[n - 2].recv == r and ar[n - 2].final  # reduce-scatter ends owning chunk r
        assert sum(s.final for s in ar) == (1 if n > 1 else 0)


def test_mismatched_schedules_are_caught_by_the_simulator():
    bounds = partition(32, 2)
    bad = [schedule.all_reduce(2, 0), schedule.all_reduce(2, 0)]  # rank 1 runs rank 0's steps
    with pytest.raises(AssertionError, match="expects chunk"):
        simulate(bad, [np.zeros(32), np.zeros(32)], bounds)


def test_printed_table(capsys):
    assert schedule.main(["--ranks", "5", "--collective", "all_reduce", "--count", "100"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "all_reduce on a ring of 5 ranks (place r sends to r+1, receives from r-1)"
    assert lines[2].split() == ["step", "phase", "rank", "0", "rank", "1", "rank", "2", "rank", "3", "rank", "4"]
    assert lines[3].split() == ["0", "reduce-scatter", "s4", "r3+", "s0", "r4+", "s1", "r0+", "s2", "r1+", "s3", "r2+"]
    assert lines[7].split() == ["4", "all-gather", "s0", "r4=", "s1", "r0=", "s2", "r1=", "s3", "r2=", "s4", "r3="]
    assert [line.split()[0] for line in lines if line[:1].isdigit()] == [str(k) for k in range(8)]
    assert "chunk 4: [96, 100)  4 elements" in text
    with pytest.raises(SystemExit):
        schedule.main(["--ranks", "3", "--root", "3", "--collective", "broadcast"])


@given(ranks)
def test_fold_order_is_the_order_reduce_scatter_combines_each_chunk(n):
    for c in range(n):
        order = schedule.fold_order(n, c)
        steps = [schedule.reduce_scatter(n, r) for r in range(n)]
        first = [r for r in range(n) if steps[r] and steps[r][0].send == c]
        reducers = [r for s in range(n - 1) for r in range(n) if steps[r][s].recv == c]
        assert list(order) == first + reducers if n > 1 else order == (0,)


@pytest.mark.parametrize(
    "nodes, ring",
    [
        ("a,a,b,b", (0, 1, 2, 3)),
        ("a,b,a,b", (0, 2, 1, 3)),
        ("a,b,c", (0, 1, 2)),
        ("a,a,a,b,b", (0, 1, 2, 3, 4)),
        ("b,a,b,a,b", (0, 2, 4, 1, 3)),
        ("x", (0,)),
    ],
)
def test_ring_order_groups_each_node_once(nodes, ring):
    labels = nodes.split(",")
    assert schedule.ring_order(labels) == ring
    # every node's ranks are one run of the ring, in MPI order, so the ring leaves each node once
    runs = [labels[r] for i, r in enumerate(ring) if i == 0 or labels[ring[i - 1]] != labels[r]]
    assert len(runs) == len(set(labels))
    for label in set(labels):
        mine = [r for r in ring if labels[r] == label]
        assert mine == sorted(mine)


@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=12))
def test_ring_order_is_a_permutation_crossing_each_boundary_once(labels):
    ring = schedule.ring_order(labels)
    assert sorted(ring) == list(range(len(labels)))
    crossings = sum(labels[ring[p - 1]] != labels[ring[p]] for p in range(len(ring)))
    nodes = len(set(labels))
    assert crossings == (nodes if nodes > 1 else 0)
    if nodes == 1:
        assert ring == tuple(range(len(labels)))


def test_in_ring_order_gives_place_p_the_shard_of_rank_ring_p():
    bounds = partition(100, 4)
    ring = (0, 2, 1, 3)
    chunks = schedule.in_ring_order(bounds, ring)
    assert chunks == (bounds[0], bounds[2], bounds[1], bounds[3])
    # the reduce-scatter schedule ends place p with chunk p: rank ring[p] with its own shard
    for p, r in enumerate(ring):
        assert chunks[schedule.reduce_scatter(4, p)[-1].recv] == bounds[r]


def test_printed_ring(capsys):
    assert schedule.main(["--nodes", "a,b,a,b"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ring for nodes a,b,a,b: 0 -> 2 -> 1 -> 3 -> (0)"
    assert "  edge 0 -> 2: inside node a" in out
    assert "  edge 2 -> 1: node a -> node b" in out
    assert out[-1] == "2 of 4 edges leave a node"


def test_the_printed_schedule_is_all_a_new_user_sees():
    """`python -m ringcomm.schedule` (the README's first command) prints its table and nothing else:
    no runpy warning about the package having imported the module first."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", "ringcomm.schedule", "--ranks", "5", "--collective", "all_reduce"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("all_reduce on a ring of 5 ranks"), done.stdout
    assert len(done.stdout.splitlines()) == 3 + 2 * (5 - 1) + 1, done.stdout  # legend, header, steps, last line
