"""accumulate="float32": float16/bfloat16 partial sums travel and are added in float32, rounded once.

Against the float64 reduction of the gathered inputs, on fresh random data at N = 1..5 with counts
that do not divide N (the ring and the small gather-fold path, in and out of place): every result
is within half an ulp of the exact result plus N·2⁻²⁴·Σ|xᵢ| (the float32 summation's bound), ranks
agree bitwise, and a run repeats bitwise. Other dtypes: the option changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_identical_on_all_ranks, gather_all, make_comm, random_input, reference
from mpi4py import MPI

import ringcomm
from ringcomm.ops import HALF_DTYPES, ReduceOp

OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD)


def ulp(dtype: np.dtype, values: np.ndarray) -> np.ndarray:
    """The spacing of the half type at |values| (its subnormal spacing below the normal range)."""
    finfo = {np.dtype(np.float16): (10, -14), np.dtype(ringcomm.bfloat16): (7, -126)}[np.dtype(dtype)]
    mant, emin = finfo
    e = np.floor(np.log2(np.maximum(np.abs(values), 2.0**emin)))
    return 2.0 ** (e - mant)


def assert_within_bound(got: np.ndarray, inputs: list[np.ndarray], op: ReduceOp, what: str) -> None:
    """|got - exact| <= ulp/2 + N·2⁻²⁴·Σ|xᵢ| (sum, avg: /N), exactly for min/max,
    (N+1)·2⁻²⁴·|exact| + ulp/2 for prod."""
    exact = reference(inputs, op)
    g = got.astype(np.float64)
    n = len(inputs)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        bad = np.flatnonzero(g != exact)
        assert bad.size == 0, f"{what}: {bad.size} wrong, first at {bad[:5]}: {g[bad[:5]]} vs {exact[bad[:5]]}"
        return
    half_ulp = 0.5 * ulp(got.dtype, np.maximum(np.abs(exact), np.abs(g)))
    if op is ReduceOp.PROD:
        tol = half_ulp + (n + 1) * 2.0**-24 * np.abs(exact)
    else:
        scale = np.sum([np.abs(a.astype(np.float64)) for a in inputs], axis=0)
        tol = half_ulp + n * 2.0**-24 * (scale / n if op is ReduceOp.AVG else scale)
    err = np.abs(g - exact)
    bad = np.flatnonzero(~(err <= tol * (1 + 1e-12)))
    assert bad.size == 0, (
        f"{what}: {bad.size} of {got.size} outside the bound, first at {bad[:5]}: got {g[bad[:5]]}, exact "
        f"{exact[bad[:5]]}, error {err[bad[:5]]}, bound {tol[bad[:5]]}"
    )


@pytest.mark.parallel(nprocs=[1, 2, 3, 4, 5])
def test_float32_accumulation_within_the_bound_on_every_rank(seed):
    mpi = MPI.COMM_WORLD
    rng = np.random.default_rng([seed, mpi.rank])
    ring, small = make_comm(small_bytes=0), make_comm()
    n, r = ring.size, ring.rank
    for dtype in HALF_DTYPES:
        for op in OPS:
            for count in sorted({0, 1, n + 1, 16 * n + 3, 1001, 40_003}):
                what = f"N={n} {dtype} {op} count={count}"
                x = random_input(rng, count, dtype, op)
                inputs = gather_all(mpi, x)
                for comm, path in ((ring, "ring"), (small, "small")):
                    out = np.full(count, np.nan, dtype)
                    comm.all_reduce(x, op, out=out, accumulate="float32")
                    assert_within_bound(out, inputs, op, f"all_reduce {path} {what}")
                    assert_identical_on_all_ranks(mpi, out, f"all_reduce {path} {what}")
                    again = x.copy()
                    comm.all_reduce(again, op, accumulate="float32")  # in place, a second run: the same bits
                    assert again.tobytes() == out.tobytes(), f"all_reduce {path} {what}: in place or rerun differs"
                lo, hi = ring.shard_bounds(count)[r]
                shard = ring.reduce_scatter(x, op, accumulate="float32")
                assert shard.tobytes() == out[lo:hi].tobytes(), f"reduce_scatter {what}"
                root = count % n
                res = ring.reduce(x.copy(), op, root=root, accumulate="float32")
                if r == root:
                    assert_within_bound(res, inputs, op, f"reduce {what}")
                else:
                    assert res is None


@pytest.mark.parallel(nprocs=[3])
def test_the_option_changes_nothing_for_other_dtypes_and_is_checked(seed, monkeypatch):
    mpi = MPI.COMM_WORLD
    rng = np.random.default_rng([seed, mpi.rank])
    comm = make_comm()
    for dtype in (np.float32, np.float64, np.int32):
        x = random_input(rng, 5003, dtype, ReduceOp.SUM)
        plain = comm.all_reduce(x, out=np.empty_like(x))
        wide = comm.all_reduce(x, out=np.empty_like(x), accumulate="float32")
        assert plain.tobytes() == wide.tobytes(), dtype
    with pytest.raises(ValueError, match="accumulate='float64' is not valid"):
        comm.all_reduce(np.ones(4, np.float16), accumulate="float64")
    # the environment overrides the argument (both ways); a bad value is an error at creation
    x = (rng.standard_normal(4003) * 100).astype(np.float16)
    exact = reference(gather_all(mpi, x), ReduceOp.SUM)
    wide = comm.all_reduce(x, out=np.empty_like(x), accumulate="float32")
    monkeypatch.setenv("RINGCOMM_ACCUMULATE", "none")
    forced_off = make_comm().all_reduce(x, out=np.empty_like(x), accumulate="float32")
    monkeypatch.setenv("RINGCOMM_ACCUMULATE", "float32")
    forced_on = make_comm().all_reduce(x, out=np.empty_like(x))
    assert forced_on.tobytes() == wide.tobytes()
    assert forced_off.tobytes() == comm.all_reduce(x, out=np.empty_like(x)).tobytes()
    assert np.abs(wide - exact).max() <= np.abs(forced_off - exact).max()
    monkeypatch.setenv("RINGCOMM_ACCUMULATE", "fp64")
    with pytest.raises(ValueError, match="RINGCOMM_ACCUMULATE"):
        make_comm()


@pytest.mark.parallel(nprocs=[4])
def test_the_reduce_scatter_phase_moves_float32(seed):
    """All-reduce bytes: the reduce-scatter phase's partial sums in float32 (twice), the all-gather
    phase in the half type: 1.5x the bytes of the default, not 2x as with a float32 copy."""
    comm = make_comm(small_bytes=0)
    x = np.ones(16 * 4 * 1000, np.float16)
    before = comm.bytes_sent
    comm.all_reduce(x.copy())
    plain = comm.bytes_sent - before
    comm.all_reduce(x.copy(), accumulate="float32")
    wide = comm.bytes_sent - before - plain
    assert wide == 1.5 * plain, (plain, wide)


@pytest.mark.parallel(nprocs=[2, 3])
def test_ranks_that_disagree_on_the_option_raise(seed):
    """The option is part of the call's identity (its messages' tags, check=True's agreement): a rank
    that folds in float32 while its peers do not never returns normally with other bits."""
    mpi = MPI.COMM_WORLD
    for count in (64, 40_003):  # the gather-fold path, where the bytes on the wire are the same, and the ring
        comm = make_comm(timeout=5.0)
        x = np.ones(count, np.float16)
        with pytest.raises(ringcomm.RingcommError):
            comm.all_reduce(x, accumulate="float32" if mpi.rank == 0 else None)
        mpi.Barrier()
    checked = make_comm(timeout=5.0, check=True)
    with pytest.raises(ringcomm.MismatchError, match="accumulate=float32"):
        checked.all_reduce(np.ones(64, np.float16), accumulate="float32" if mpi.rank == 0 else None)
