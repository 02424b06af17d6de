"""ringcomm.zero in one process: Adam math, layout, memory formulas, estimator CLI, validation,
loss scaler, checkpoint format and errors, stage-3 access, the example's gradients and command."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import make_comm
from hypothesis import given, settings
from hypothesis import strategies as st

import ringcomm
from ringcomm.schedule import ALIGN, partition
from ringcomm.zero import (
    CheckpointError,
    FlatLayout,
    LossScaler,
    ZeroShardManager,
    adam_update,
    consolidate,
    estimate_memory,
    formula,
    memory_breakdown,
    parse_count,
)
from ringcomm.zero.__main__ import main as cli_main
from ringcomm.zero.adam import HOST_CHUNK

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def comm():
    return make_comm()


def load_example():
    spec = importlib.util.spec_from_file_location("train_zero", ROOT / "examples" / "train_zero.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------ Adam
def torch_adamw(p, g, m, v, t, lr, b1, b2, eps, wd):
    """torch.optim.AdamW's single-tensor loop, in float64 (independent of ringcomm's formulation)."""
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v) / math.sqrt(1 - b2**t) + eps
    return p - (lr / (1 - b1**t)) * m / denom, m, v


def test_adam_update_matches_torch_formula(seed):
    rng = np.random.default_rng(seed)
    n = 3 * HOST_CHUNK + 5  # several chunks and a ragged tail
    hp = dict(lr=3e-3, b1=0.8, b2=0.95, eps=1e-6, wd=0.1)
    p, m, v = rng.standard_normal(n), np.zeros(n), np.zeros(n)
    master, exp_avg, exp_avg_sq = p.copy(), m.copy(), v.copy()
    for t in range(1, 6):
        g = rng.standard_normal(n) * 1e3
        scale = 1e-3 * (0.5 if t % 2 else 1.0)
        p, m, v = torch_adamw(p, g * scale, m, v, t, **hp)
        out = np.full(n, np.nan)
        adam_update(
            master,
            g,
            exp_avg,
            exp_avg_sq,
            lr=hp["lr"],
            beta1=hp["b1"],
            beta2=hp["b2"],
            eps=hp["eps"],
            weight_decay=hp["wd"],
            step=t,
            grad_scale=scale,
            out=out,
        )
        np.testing.assert_allclose(master, p, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(exp_avg, m, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(exp_avg_sq, v, rtol=1e-13, atol=1e-15)
        np.testing.assert_array_equal(out, master)


@pytest.mark.parametrize("gdt", [np.float16, ringcomm.bfloat16, np.float32])
def test_adam_update_float32_master_half_grads(gdt, seed):
    """float32 states, half/float32 gradients: the gradient is converted before any arithmetic
    (65504 * 2 would overflow in float16), out receives the master rounded to out's dtype."""
    rng = np.random.default_rng(seed)
    n = HOST_CHUNK + 100
    g = rng.uniform(-6e4, 6e4, n).astype(gdt)  # near float16 max: times 4 overflows in float16
    master = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    v = (rng.random(n) * 1e-3).astype(np.float32)
    want = torch_adamw(
        master.astype(np.float64),
        g.astype(np.float64) * 4.0,
        m.astype(np.float64),
        v.astype(np.float64),
        7,
        1e-2,
        0.9,
        0.999,
        1e-8,
        0.01,
    )
    out = np.zeros(n, gdt)
    adam_update(
        master, g, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=7, grad_scale=4.0, out=out
    )
    assert np.isfinite(master).all()
    for got, ref in zip((master, m, v), want):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-7)
    np.testing.assert_array_equal(out, master.astype(gdt))


def test_adam_update_validation():
    a = np.zeros(8)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="step"):
        adam_update(a, a.copy(), a.copy(), a.copy(), step=0, **kw)
    with pytest.raises(ValueError, match="elements"):
        adam_update(a, np.zeros(7), a.copy(), a.copy(), step=1, **kw)
    with pytest.raises(TypeError, match="master"):
        adam_update(
            a.astype(np.float16), a.astype(np.float16), a.astype(np.float16), a.astype(np.float16), step=1, **kw
        )
    with pytest.raises(TypeError, match="exp_avg"):
        adam_update(a, a.copy(), a.astype(np.float32), a.copy(), step=1, **kw)


@pytest.fixture(scope="module")
def kernel_on_host(harness_libraries):
    """csrc/optimizer.cu's adam_thread compiled for the CPU through tests/csrc_harness.cpp (the CUDA
    engineer's harness, conftest's build); skipped without a C++ compiler. x86-64 without -mfma: no
    FMA contraction."""
    import ctypes

    lib = ctypes.CDLL(str(harness_libraries["plain"].result()))
    lib.rc_host_adam.argtypes = (
        [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64]
    )
    return lib


@pytest.mark.parametrize(
    "mdt,gdt",
    [(np.float32, np.float16), (np.float32, ringcomm.bfloat16), (np.float32, np.float32), (np.float64, np.float64)],
    ids=str,
)
def test_host_adam_bitwise_equals_kernel_arithmetic(kernel_on_host, mdt, gdt, seed):
    """The host loop and the fused kernel implement one formula in one order: bitwise equal results
    (on the GPU too: every kernel operation is rounded once, with no flush to zero and no FMA)."""
    codes = {np.dtype(np.float16): 0, ringcomm.bfloat16: 1, np.dtype(np.float32): 2, np.dtype(np.float64): 3}
    ptr = lambda a: a.__array_interface__["data"][0]  # noqa: E731
    rng = np.random.default_rng(seed)
    n = 2 * HOST_CHUNK + 77
    state = [
        rng.standard_normal(n).astype(mdt),
        (rng.standard_normal(n) * 1e-2).astype(mdt),
        (rng.random(n) * 1e-3).astype(mdt),
    ]
    mine = [a.copy() for a in state]
    for step, (wd, scale) in enumerate([(0.0, 1.0), (0.05, 0.37), (0.1, 1.0 / 3.0)], start=1):
        lr, b1, b2, eps = 3e-3, 0.9, 0.999, 1e-8
        g = (rng.standard_normal(n) * 10).astype(gdt)
        out_k, out_h = np.empty(n, gdt), np.empty(n, gdt)
        s = np.array([lr, b1, b2, eps, 1 - lr * wd, 1 - b1**step, 1 - b2**step, scale], np.float64)
        assert (
            kernel_on_host.rc_host_adam(
                codes[np.dtype(mdt)],
                codes[np.dtype(gdt)],
                codes[np.dtype(gdt)],
                *(ptr(a) for a in (state[0], g, state[1], state[2], out_k)),
                n,
                ptr(s),
                64,
            )
            == 0
        )
        adam_update(
            mine[0],
            g,
            mine[1],
            mine[2],
            lr=lr,
            beta1=b1,
            beta2=b2,
            eps=eps,
            weight_decay=wd,
            step=step,
            grad_scale=scale,
            out=out_h,
        )
        for k, h in zip(state, mine):
            np.testing.assert_array_equal(h.view(f"u{h.itemsize}"), k.view(f"u{k.itemsize}"))
        np.testing.assert_array_equal(out_h.view(f"u{out_h.itemsize}"), out_k.view(f"u{out_k.itemsize}"))


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_layout_padding_partition_pack(n):
    shapes = [(5, 7), (3,), (0,), (11, 2, 2), (1,)]
    lay = FlatLayout.of(shapes, n)
    assert lay.count == 35 + 3 + 0 + 44 + 1
    assert lay.padded % (16 * n) == 0 and lay.padded >= lay.count and lay.padded - lay.count < 16 * n
    assert partition(lay.padded, n) == tuple(lay.shard(r) for r in range(n))  # equal, nonempty, as the ring cuts
    rng = np.random.default_rng(n)
    arrays = [rng.standard_normal(s) for s in shapes]
    flat = np.full(lay.padded, np.nan)
    lay.pack([a.reshape(-1) for a in arrays], 0, lay.padded, flat)
    assert np.array_equal(flat[: lay.count], np.concatenate([a.ravel() for a in arrays]))
    assert not flat[lay.count :].any()
    for a, view in zip(arrays, lay.views(flat)):
        assert np.array_equal(a, view) and np.shares_memory(view, flat) or a.size == 0
    # any window, e.g. one that cuts parameters in the middle
    for lo, hi in [(3, 40), (0, 1), (36, lay.padded), (lay.count - 1, lay.padded)]:
        part = np.full(hi - lo, np.nan)
        lay.pack([a.reshape(-1) for a in arrays], lo, hi, part)
        assert np.array_equal(part, flat[lo:hi])
    assert lay.runs([3, 0]) == [(0, 35), (38, 82)]
    assert lay.runs([3, 0, 1]) == [(0, 82)]  # the zero-size parameter 2 leaves no gap
    assert lay.runs([1, 2, 3]) == [(35, 82)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 7), max_size=3), min_size=1, max_size=6), st.integers(1, 6), st.data())
def test_layout_property(shapes, n, data):
    """Any shapes, any N: equal shards as the ring partitions them; any window packs as the flat slice."""
    lay = FlatLayout.of(shapes, n)
    assert partition(lay.padded, n) == tuple(lay.shard(r) for r in range(n)) and lay.shard_size % 16 == 0
    flats = [np.arange(lay.offsets[i], lay.offsets[i] + lay.sizes[i], dtype=np.float64) + 1 for i in range(len(shapes))]
    want = np.concatenate([np.arange(1, lay.count + 1, dtype=np.float64), np.zeros(lay.padded - lay.count)])
    lo = data.draw(st.integers(0, lay.padded))
    hi = data.draw(st.integers(lo, lay.padded))
    got = np.full(hi - lo, np.nan)
    lay.pack(flats, lo, hi, got)
    assert np.array_equal(got, want[lo:hi])
    idx = data.draw(st.lists(st.integers(0, len(shapes) - 1), max_size=6))
    covered = np.zeros(lay.count, bool)
    for a, b in lay.runs(idx):
        covered[a:b] = True
    expect = np.zeros(lay.count, bool)
    for i in idx:
        expect[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]] = True
    assert np.array_equal(covered, expect)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 8), st.integers(1, 1 << 14))
def test_bucket_rounds_cut_as_the_ring_cuts(count, n, bucket):
    """The bucketed reduce-scatter's rounds: a multiple of ALIGN elements per rank, the largest whose
    N copies fit the bucket (or the whole shard when N shards fit), and every round's N·m elements
    partition into N equal pieces of m (the manager relies on this without checking it at run time)."""
    lay = FlatLayout.of([(count,)], n)
    S = lay.shard_size
    c = lay.bucket(bucket)
    assert 0 < c <= S and c % ALIGN == 0
    if n * S <= bucket:
        assert c == S
    else:
        assert (n * c <= bucket or c == ALIGN) and (c == S or n * (c + ALIGN) > bucket)
    rounds = [min(c, S - o) for o in range(0, S, c)]
    assert sum(rounds) == S
    for m in set(rounds):
        assert partition(n * m, n) == tuple((r * m, (r + 1) * m) for r in range(n))
    for bad in (0, -16, True, 16.0):
        with pytest.raises(ValueError, match="bucket_elements"):
            lay.bucket(bad)


def test_layout_straddles_shards():
    lay = FlatLayout.of([(100,), (50,)], 4)  # padded 192, shards of 48: parameter 0 spans 3 shards
    assert lay.padded == 192 and lay.shard_size == 48
    assert [i for i, *_ in lay.pieces(*lay.shard(2))] == [0, 1]
    assert lay.pieces(*lay.shard(3)) == [(1, 44, 50)]


# ------------------------------------------------------------------------------------------ memory
def test_estimate_memory_paper_figure_1():
    phi, n = 7.5e9, 64
    got = [estimate_memory(phi, n, s) for s in range(4)]
    assert got == [16 * phi, 4 * phi + 12 * phi / n, 2 * phi + 14 * phi / n, 16 * phi / n]
    assert [f"{g / 1e9:.1f}" for g in got] == ["120.0", "31.4", "16.6", "1.9"]
    assert [formula(s) for s in range(4)] == ["16Φ", "4Φ + 12Φ/N", "2Φ + 14Φ/N", "16Φ/N"]
    assert formula(2, param_bytes=4, grad_bytes=4, k=12) == "4Φ + 16Φ/N"
    assert memory_breakdown(1000, 4, 2, param_bytes=4, grad_bytes=4, k=12) == {
        "params": 4000,
        "grads": 1000,
        "optimizer": 3000,
    }
    assert estimate_memory(1000, 1, 3) == estimate_memory(1000, 1, 0) == 16000
    for bad in (dict(stage=4), dict(stage=True), dict(world_size=0)):
        with pytest.raises(ValueError):
            estimate_memory(**{"num_params": 10, "world_size": 2, "stage": 1, **bad})


def test_parse_count():
    assert parse_count("7.5B") == 7_500_000_000
    assert parse_count("125m") == 125_000_000
    assert parse_count("1.5e9") == parse_count("1.5G") == 1_500_000_000
    assert parse_count("1T") == 10**12 and parse_count(42) == 42
    for bad in ("7.5X", "-3", "1.5", "", "B"):
        with pytest.raises(ValueError):
            parse_count(bad)


def test_estimate_cli(capsys):
    out = subprocess.run(
        [sys.executable, "-m", "ringcomm.zero", "estimate", "--params", "7.5B", "--world-size", "64"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    gb = re.findall(r"(\d+\.\d) GB", out)
    assert gb == ["120.0", "31.4", "16.6", "1.9"], out
    for f in ("16Φ ", "4Φ + 12Φ/N", "2Φ + 14Φ/N", "16Φ/N"):
        assert f in out
    assert (
        cli_main(
            [
                "estimate",
                "--params",
                "1B",
                "--world-size",
                "8",
                "--param-bytes",
                "4",
                "--grad-bytes",
                "4",
                "--k",
                "12",
                "--stage",
                "3",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "20Φ/N" in text and "2.5 GB" in text and "stage" in text and "\n0 " not in text
    assert cli_main(["estimate", "-p", "1B", "-n", "4", "--precision", "fp32"]) == 0
    assert "4Φ + 16Φ/N" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["estimate", "--params", "lots", "--world-size", "8"])
    assert "invalid parameter count" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ manager
def small_params(dtype=np.float64):
    rng = np.random.default_rng(5)  # any values: these tests check validation and bookkeeping
    return [rng.standard_normal((4, 3)).astype(dtype), rng.standard_normal(5).astype(dtype)]


def test_constructor_validation(comm):
    p = small_params()
    cases = [
        (dict(stage=4), ValueError, "unknown ZeRO stage"),
        (dict(stage=True), ValueError, "unknown ZeRO stage"),
        (dict(stage="2"), ValueError, "unknown ZeRO stage"),
        (dict(loss_scale=-1.0), ValueError, "loss_scale"),
        (dict(loss_scale=float("inf")), ValueError, "loss_scale"),
        (dict(loss_scale="static"), ValueError, "loss_scale"),
        (dict(loss_scale=[2.0]), TypeError, "loss_scale"),
        (dict(lr=-1e-3), ValueError, "lr"),
        (dict(betas=(0.9, 1.0)), ValueError, "betas"),
        (dict(betas=0.9), ValueError, "betas"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
        (dict(accumulate="float64"), ValueError, "accumulate='float64' is not valid"),
    ]
    for kw, exc, words in cases:
        with pytest.raises(exc, match=words):
            ZeroShardManager(comm, p, **kw)
    with pytest.raises(TypeError, match="several dtypes"):
        ZeroShardManager(comm, [p[0], p[1].astype(np.float32)])
    with pytest.raises(TypeError, match="working precision"):
        ZeroShardManager(comm, [np.zeros(3, np.int32)])
    with pytest.raises(TypeError, match="non-empty list"):
        ZeroShardManager(comm, [])
    with pytest.raises(TypeError, match="numpy array"):
        ZeroShardManager(comm, [[1.0, 2.0]])
    with pytest.raises(TypeError, match="Communicator"):
        ZeroShardManager(comm.mpi, p)

    class NoBucket(ZeroShardManager):
        bucket_elements = 0

    with pytest.raises(ValueError, match="bucket_elements must be an integer >= 1"):
        NoBucket(comm, p)


def test_step_validation_before_communication(comm):
    for stage in range(4):
        mgr = ZeroShardManager(comm, small_params(np.float32), stage=stage)
        good = [np.ones((4, 3), np.float32), np.ones(5, np.float32)]
        with pytest.raises(ValueError, match="got 1 arrays, expected 2"):
            mgr.step(good[:1])
        with pytest.raises(ValueError, match=r"shape \(3, 4\)"):
            mgr.step([np.ones((3, 4), np.float32), good[1]])
        with pytest.raises(TypeError, match="dtype float64"):
            mgr.step([good[0], np.ones(5)])
        with pytest.raises(TypeError, match="list of arrays"):
            mgr.step(np.ones(17, np.float32))
        with pytest.raises(IndexError):
            with mgr.gathered([2]):
                pass
        with pytest.raises(TypeError):
            with mgr.gathered([0.5]):
                pass
        assert mgr.step_count == 0 and mgr.comm_bytes == 0
        assert mgr.step(good) and mgr.step_count == 1


def test_zero_copy_grads_and_noncontiguous(comm):
    """Stage 0/1 accept their own gradient views without a copy; any stage accepts strided grads."""
    ref = None
    for stage in range(4):
        mgr = ZeroShardManager(comm, small_params(), stage=stage, lr=0.1)
        g = [np.asfortranarray(np.arange(12.0).reshape(4, 3)), np.arange(10.0)[::2]]
        if mgr.grads is not None:
            for v, gi in zip(mgr.grads, g):
                v[...] = gi
            mgr.step(mgr.grads)
        else:
            mgr.step(g)
        with mgr.gathered() as p:
            got = [q.copy() for q in p]
        ref = ref or got
        assert all(np.array_equal(a, b) for a, b in zip(got, ref))


def test_stage3_access_and_subsets(comm):
    params = small_params()
    mgr = ZeroShardManager(comm, params, stage=3)
    with pytest.raises(RuntimeError, match="not gathered"):
        mgr.params[0]
    assert mgr.gathered_bytes == 0
    with mgr.gathered([1]) as (b,):
        assert np.array_equal(b, params[1]) and mgr.gathered_bytes == b.nbytes
        with pytest.raises(RuntimeError):
            mgr.params[0]
        with mgr.gathered() as both:
            assert np.array_equal(both[0], params[0]) and both[1] is b
        assert mgr.gathered_bytes == b.nbytes
    assert mgr.gathered_bytes == 0 and mgr.memory_report()["params"] == 8 * mgr.layout.shard_size
    mgr0 = ZeroShardManager(comm, params, stage=0)
    with mgr0.gathered([1, 0]) as (b, w):  # stages 0-2: the views, no copy
        assert b is mgr0.params[1] and w is mgr0.params[0]


def test_bucketed_reduction_and_small_bucket(comm, monkeypatch, seed):
    """Bucket rounds (stages 1-3) give the same result as one reduce-scatter."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal((37, 5)), rng.standard_normal(11)]
    grads = [rng.standard_normal((37, 5)), rng.standard_normal(11)]
    results = {}
    for bucket in (1 << 25, 16, 48):
        monkeypatch.setattr(ZeroShardManager, "bucket_elements", bucket)
        for stage in (1, 2, 3):
            mgr = ZeroShardManager(comm, params, stage=stage, max_grad_norm=1.0)
            mgr.step(grads)
            with mgr.gathered() as p:
                results[bucket, stage] = [q.copy() for q in p]
    for key, value in results.items():
        assert all(np.array_equal(a, b) for a, b in zip(value, results[1 << 25, 1])), key


def test_loss_scaler_rules():
    s = LossScaler("dynamic")
    assert s.enabled and s.scale == 65536.0
    s.growth_interval = 2
    s.update(False)
    assert s.scale == 65536.0
    s.update(False)
    assert s.scale == 131072.0 and s.good_steps == 0
    s.update(False)
    s.update(True)
    assert s.scale == 65536.0 and s.good_steps == 0
    static = LossScaler(128.0)
    static.update(True)
    assert static.scale == 128.0 and static.mode == "static"
    assert not LossScaler(None).enabled and LossScaler(None).scale == 1.0
    fresh = LossScaler("dynamic")
    fresh.load_state_dict(s.state_dict())
    assert fresh.scale == s.scale


def test_overflow_single_rank(comm):
    mgr = ZeroShardManager(comm, small_params(np.float16), stage=2, loss_scale="dynamic")
    g = [np.ones((4, 3), np.float16), np.ones(5, np.float16)]
    g[1][2] = np.inf
    with mgr.gathered() as p:
        before = [q.copy() for q in p]
    assert mgr.step(g) is False
    assert mgr.step_count == 0 and mgr.skipped_steps == 1 and mgr.loss_scale == 32768.0
    with mgr.gathered() as p:
        assert all(np.array_equal(a, b) for a, b in zip(p, before))
    g[1][2] = 1.0
    assert mgr.step(g) is True and mgr.step_count == 1


def test_clipping_single_rank(comm):
    """last_grad_norm is the unscaled averaged gradient's norm; clipping scales it to max_grad_norm."""
    params = small_params()
    grads = [np.full((4, 3), 2.0), np.full(5, -2.0)]
    norm = math.sqrt(17 * 4.0)
    for stage in range(4):
        mgr = ZeroShardManager(comm, params, stage=stage, lr=0.5, betas=(0.0, 0.0), max_grad_norm=1.0, loss_scale=4.0)
        mgr.step([g * 4.0 for g in grads])  # loss-scaled by 4
        assert mgr.last_grad_norm == pytest.approx(norm, rel=1e-14)
        # with beta1 = beta2 = 0 Adam's step is lr * g / (|g| + eps): the clip factor cancels but the
        # eps term shows it: the step is lr * c|g| / (c|g| + eps) with c = 1 / (norm + 1e-6)
        c = 1.0 / (norm + 1e-6)
        step = 0.5 * (2.0 * c) / (2.0 * c + 1e-8)
        with mgr.gathered() as p:
            np.testing.assert_allclose(p[0], params[0] - step, rtol=1e-13)
            np.testing.assert_allclose(p[1], params[1] + step, rtol=1e-13)


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_roundtrip_and_errors(comm, tmp_path, seed):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal((6, 5)).astype(np.float16), rng.standard_normal(3).astype(np.float16)]
    mgr = ZeroShardManager(comm, params, stage=2, loss_scale="dynamic")
    for _ in range(3):
        mgr.step([rng.standard_normal(p.shape).astype(np.float16) for p in params])
    mgr.save(tmp_path / "ck")
    files = sorted(os.listdir(tmp_path / "ck"))
    assert (
        files[0] == "meta.json"
        and len(files) == 2
        and re.fullmatch(r"shard-00000-of-00001-[0-9a-f]{12}\.bin", files[1])
    )
    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["master_dtype"] == "<f4" and meta["shapes"] == [[6, 5], [3]]
    state = consolidate(tmp_path / "ck")
    assert state["step"] == 3 and [a.shape for a in state["params"]] == [(6, 5), (3,)]
    assert state["params"][0].dtype == np.float32
    with mgr.gathered() as p:
        assert all(np.array_equal(a.astype(np.float16), b) for a, b in zip(state["params"], p))
    mgr.save(tmp_path / "ck")  # saving again replaces the files (no stale shards left)
    assert len(os.listdir(tmp_path / "ck")) == 2

    other = ZeroShardManager(comm, params, stage=0, loss_scale="dynamic")
    other.load(tmp_path / "ck")
    assert other.step_count == 3 and other.loss_scale == mgr.loss_scale
    g = [rng.standard_normal(p.shape).astype(np.float16) for p in params]
    mgr.step(g)
    other.step(g)
    with mgr.gathered() as a, other.gathered() as b:
        assert all(np.array_equal(x, y) for x, y in zip(a, b))

    shard = next(f for f in os.listdir(tmp_path / "ck") if f.startswith("shard"))
    shutil.copytree(tmp_path / "ck", tmp_path / "bad")
    with open(tmp_path / "bad" / shard, "r+b") as f:
        f.truncate(10)
    before = [np.array(x, copy=True) for x in (other._master, other._exp_avg, other._exp_avg_sq, other._param_flat)]
    with pytest.raises(CheckpointError, match="truncated"):
        other.load(tmp_path / "bad")
    with pytest.raises(CheckpointError, match="truncated"):
        consolidate(tmp_path / "bad")
    (tmp_path / "bad" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        other.load(tmp_path / "bad")
    with pytest.raises(CheckpointError, match="shapes differ"):
        ZeroShardManager(comm, [params[1], params[0]]).load(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="float32 master states, this manager float64"):
        ZeroShardManager(comm, [p.astype(np.float64) for p in params]).load(tmp_path / "ck")
    after = [other._master, other._exp_avg, other._exp_avg_sq, other._param_flat]
    assert all(np.array_equal(a, b) for a, b in zip(before, after)) and other.step_count == 4


#: (what is broken, how, words the error must contain): every field read from meta.json, missing or
#: of the wrong type, raises CheckpointError (never KeyError/TypeError) and loads nothing.
MALFORMED = [
    ("shard file", lambda m: m["shards"][0].pop("file"), "shards[0] has no 'file'"),
    ("shard nbytes", lambda m: m["shards"][0].pop("nbytes"), "shards[0] has no 'nbytes'"),
    ("shard crc32", lambda m: m["shards"][0].pop("crc32"), "shards[0] has no 'crc32'"),
    ("shard start", lambda m: m["shards"][0].pop("start"), "shards[0] has no 'start'"),
    ("shard stop", lambda m: m["shards"][0].pop("stop"), "shards[0] has no 'stop'"),
    ("crc32 as text", lambda m: m["shards"][0].update(crc32="123"), "shards[0].crc32"),
    ("crc32 too large", lambda m: m["shards"][0].update(crc32=1 << 32), "shards[0].crc32"),
    ("nbytes negative", lambda m: m["shards"][0].update(nbytes=-1), "shards[0].nbytes"),
    ("file name type", lambda m: m["shards"][0].update(file=7), "bad shard file name"),
    ("shard not an object", lambda m: m.update(shards=[[0, 33]]), "shards[0] must be an object"),
    ("shards not a list", lambda m: m.update(shards={"0": {}}), "'shards' must be a list"),
    ("no shards", lambda m: m.pop("shards"), "has no 'shards'"),
    ("no shapes", lambda m: m.pop("shapes"), "has no 'shapes'"),
    ("shape entry", lambda m: m["shapes"].__setitem__(0, [6, "5"]), "shapes[0][1]"),
    ("no count", lambda m: m.pop("count"), "has no 'count'"),
    ("no step", lambda m: m.pop("step"), "has no 'step'"),
    ("step as text", lambda m: m.update(step="3"), "step must be an integer"),
    ("skipped_steps", lambda m: m.update(skipped_steps=None), "skipped_steps"),
    ("no master_dtype", lambda m: m.pop("master_dtype"), "has no 'master_dtype'"),
    ("master_dtype null", lambda m: m.update(master_dtype=None), "master_dtype"),
    ("master_dtype int", lambda m: m.update(master_dtype="<i4"), "master_dtype"),
    ("master_dtype nonsense", lambda m: m.update(master_dtype="quux"), "malformed"),
    ("loss_scaler type", lambda m: m.update(loss_scaler="dynamic"), "loss_scaler must be an object"),
    ("loss scale", lambda m: m["loss_scaler"].update(scale=None), "loss_scaler.scale"),
    ("good_steps", lambda m: m["loss_scaler"].pop("good_steps"), "loss_scaler has no 'good_steps'"),
]


def test_malformed_meta_is_a_checkpoint_error(comm, tmp_path, seed):
    """A meta.json with a field missing or of the wrong type: CheckpointError from load (which
    changes nothing: not the states, the parameters, the step count nor the loss scale) and from
    consolidate, naming the field."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal((6, 5)).astype(np.float16), rng.standard_normal(3).astype(np.float16)]
    saved = ZeroShardManager(comm, params, stage=1, loss_scale="dynamic")
    saved.scaler.growth_interval = 1  # the saved scale differs from a fresh manager's
    saved.step([rng.standard_normal(p.shape).astype(np.float16) for p in params])
    saved.save(tmp_path / "ck")
    good = json.loads((tmp_path / "ck" / "meta.json").read_text())
    assert good["loss_scaler"]["mode"] == "dynamic" and len(good["shards"]) == 1

    mgr = ZeroShardManager(comm, params, stage=2, loss_scale="dynamic")
    mgr.step([rng.standard_normal(p.shape).astype(np.float16) for p in params])
    assert mgr.loss_scale != saved.loss_scale
    before = [np.array(a, copy=True) for a in (mgr._master, mgr._exp_avg, mgr._exp_avg_sq, mgr._param_flat)]
    for what, mutate, words in MALFORMED:
        bad = tmp_path / what.replace(" ", "_")
        shutil.copytree(tmp_path / "ck", bad)
        meta = json.loads(json.dumps(good))
        mutate(meta)
        (bad / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match="malformed checkpoint metadata") as info:
            mgr.load(bad)
        assert words in str(info.value), (what, str(info.value))
        with pytest.raises(CheckpointError, match=re.escape(words)):
            consolidate(bad)
        after = [mgr._master, mgr._exp_avg, mgr._exp_avg_sq, mgr._param_flat]
        assert all(np.array_equal(a, b) for a, b in zip(before, after)), what
        assert mgr.step_count == 1 and mgr.skipped_steps == 0 and mgr.loss_scale == 65536.0, what
    mgr.load(tmp_path / "ck")  # the intact checkpoint still loads
    assert mgr.step_count == 1 and mgr.loss_scale == saved.loss_scale


# ------------------------------------------------------------------------------------------ example
def test_example_backward_matches_finite_differences(seed):
    ex = load_example()
    rng = np.random.default_rng(seed)
    widths = [4, 6, 5, 3]
    params = ex.init_params(widths, np.float64, rng)
    for i in range(1, len(params), 2):
        params[i][:] = rng.standard_normal(params[i].shape) * 0.1
    x, y = rng.standard_normal((7, 4)), rng.standard_normal((7, 3))

    def layer_of(p):
        import contextlib

        return lambda i: contextlib.nullcontext((p[2 * i], p[2 * i + 1]))

    def loss(p):
        out = ex.forward(np, layer_of(p), 3, x)[-1]
        return 0.5 * float(np.sum((out - y) ** 2))

    acts = ex.forward(np, layer_of(params), 3, x)
    grads = ex.backward(layer_of(params), 3, acts, acts[-1] - y)
    for i, p in enumerate(params):
        for j in rng.choice(p.size, 3, replace=False):
            e = np.zeros(p.size)
            e[j] = 1e-6
            plus = [q + (e.reshape(q.shape) if k == i else 0) for k, q in enumerate(params)]
            minus = [q - (e.reshape(q.shape) if k == i else 0) for k, q in enumerate(params)]
            fd = (loss(plus) - loss(minus)) / 2e-6
            assert fd == pytest.approx(grads[i].ravel()[j], rel=1e-6, abs=1e-8)


def test_example_command_matches_one_process(comm):
    """`mpiexec -n 4 python examples/train_zero.py --stage 3` prints the losses of stage 0 in one process."""
    cmd = [
        "mpiexec",
        "-n",
        "4",
        sys.executable,
        str(ROOT / "examples" / "train_zero.py"),
        "--stage",
        "3",
        "--steps",
        "4",
        "--device",
        "cpu",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    printed = [float(v) for v in re.findall(r"step +\d+ +loss ([0-9.]+)", out.stdout)]
    assert len(printed) == 4 and "memory report" in out.stdout and "exp_avg_sq" in out.stdout
    one = load_example().main(["--stage", "0", "--steps", "4", "--device", "cpu"], comm=comm)
    assert printed == pytest.approx(one, rel=1e-5)
