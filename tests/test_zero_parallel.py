"""ZeRO stages 0-3 on 1-4 ranks (mpi-pytest): parity, memory, communication, loss scaling, checkpoints.

Each test function is one mpiexec launch per process count, so the stages are looped inside.
Assertions are collected per rank and agreed at the end (a failure on one rank must not leave its
peers waiting inside a collective); communicators get the tests' short deadline (conftest). The
data are drawn fresh for each run (conftest's ``seed``, printed; RINGCOMM_TEST_SEED replays one).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import shutil

import numpy as np
import pytest
from conftest import make_comm
from mpi4py import MPI

import ringcomm
from ringcomm.zero import CheckpointError, ZeroShardManager, consolidate, estimate_memory

SHAPES = [(20, 24), (24,), (24, 5), (5,)]  # 629 elements: divisible by none of 2, 3, 4
BATCH = 12  # rows of the global batch, split evenly over 1, 2, 3 or 4 ranks
STEPS = 20
HYPER = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
#: Half-precision tracking tolerance: max over the 20 steps of |loss - loss_float64| / loss_float64,
#: the float64 run being stage 0's. Worst seen over 40 seeds: 1.3e-2 (float16 parameters and
#: gradients, static loss scale 1024) and 1.1e-2 (bfloat16); the unit roundoffs are 4.9e-4 and 3.9e-3.
HALF_TOL = {"float16": 3e-2, "bfloat16": 5e-2}


def problem(seed: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SHAPES[0][0]))
    y = rng.standard_normal((BATCH, SHAPES[2][1]))
    return x, y, [rng.standard_normal(s) * 0.3 for s in SHAPES]


def loss_and_grads(params, x, y):
    """Mean-over-rows 0.5·||tanh(x W1 + b1) W2 + b2 - y||², and its gradients, in float64."""
    w1, b1, w2, b2 = (np.asarray(p, np.float64) for p in params)
    h = np.tanh(x @ w1 + b1)
    d = h @ w2 + b2 - y
    n = x.shape[0]
    do = d / n
    dh = do @ w2.T * (1.0 - h * h)
    return 0.5 * float(np.sum(d * d)) / n, [x.T @ dh, dh.sum(0), h.T @ do, do.sum(0)]


def reference_adamw(p0, x, y, steps, max_norm, lr, betas, eps, weight_decay):
    """Single-process full-batch AdamW with global-norm clipping, written as torch.optim.AdamW's
    loop (step_size = lr / bc1, denom = sqrt(v) / sqrt(bc2) + eps) and clip_grad_norm_."""
    b1, b2 = betas
    p = [q.copy() for q in p0]
    m = [np.zeros_like(q) for q in p]
    v = [np.zeros_like(q) for q in p]
    losses, clipped = [], 0
    for t in range(1, steps + 1):
        loss, g = loss_and_grads(p, x, y)
        losses.append(loss)
        norm = math.sqrt(sum(float(np.sum(gi * gi)) for gi in g))
        coef = min(1.0, max_norm / (norm + 1e-6))
        clipped += coef < 1.0
        for i in range(len(p)):
            gi = g[i] * coef
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            p[i] = p[i] * (1 - lr * weight_decay)
            denom = np.sqrt(v[i]) / math.sqrt(1 - b2**t) + eps
            p[i] = p[i] - (lr / (1 - b1**t)) * m[i] / denom
    return p, losses, clipped


def rel(a, b) -> float:
    """max |a - b| / max |b| (norm-wise relative error)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def agree(comm: ringcomm.Communicator, errors: list[str]) -> None:
    """Fail on every rank if any rank collected an error (after all collectives are done)."""
    everyone = comm.mpi.allgather(errors)
    flat = [f"rank {r}: {e}" for r, errs in enumerate(everyone) for e in errs]
    assert not flat, "\n".join(flat[:40])


def rows(comm):
    n, r = comm.size, comm.rank
    return slice(r * BATCH // n, (r + 1) * BATCH // n)


def train(mgr, x, y, steps, sl, dtype, expect_comm=None, errors=None, inject=None):
    """``steps`` steps: forward (one gathered()), backward (another gathered()), step. Returns the
    full-batch losses. ``expect_comm``: bytes each step must send; ``inject(t, grads)`` may edit grads."""
    losses = []
    for t in range(steps):
        with mgr.gathered() as p:  # forward: the loss of the global batch (local, no communication)
            losses.append(loss_and_grads(p, x, y)[0])
        with mgr.gathered() as p:  # backward: this rank's rows
            g = loss_and_grads(p, x[sl], y[sl])[1]
        grads = [(gi * mgr.loss_scale).astype(dtype) for gi in g]
        if inject is not None:
            inject(t, grads)
        mgr.step(grads)
        if expect_comm is not None and mgr.comm_bytes != expect_comm:
            errors.append(f"stage {mgr.stage} step {t}: comm_bytes {mgr.comm_bytes}, expected {expect_comm}")
    return losses


def full_params(mgr):
    with mgr.gathered() as p:
        return [np.array(q, np.float64) for q in p]


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
def test_stages_match_reference_memory_and_communication(seed):
    """Parity (float64, 20 steps): stage 0 = single-process full-batch AdamW with clipping; stages
    1-3 = stage 0 within 1e-12 relative, with the default bucket (one reduce-scatter) and with a
    bucket smaller than the shard (rounds of reduce-scatters, the last one ragged). Per stage on
    every rank: memory_report equals the formulas with Φ padded, exactly; comm_bytes per step
    equals the ring volumes; stage 3 keeps no full parameter outside gathered(). Ranks constructed
    with different bucket_elements raise on every rank. float16/bfloat16 losses track float64
    within HALF_TOL."""
    comm = make_comm(small_bytes=4096)  # the model's buffers (8·Φ bytes) must take the ring path
    n, errors = comm.size, []
    x, y, p0 = problem(seed)
    sl = rows(comm)
    norm0 = math.sqrt(sum(float(np.sum(g * g)) for g in loss_and_grads(p0, x, y)[1]))
    max_norm = 0.5 * norm0  # clips the early steps, not the late ones
    ref, ref_losses, clipped = reference_adamw(p0, x, y, STEPS, max_norm, **HYPER)
    if not 0 < clipped < STEPS:
        errors.append(f"the reference clipped {clipped} of {STEPS} steps; the test wants some of each")

    before = comm.bytes_sent
    comm.all_reduce(np.zeros(1))
    scalar = comm.bytes_sent - before  # the per-step float64 squared-norm all-reduce (stages 1-3)

    final, losses64 = {}, {}
    for stage in range(4):
        mgr = ZeroShardManager(comm, [p.copy() for p in p0], stage=stage, max_grad_norm=max_norm, **HYPER)
        phi, S = mgr.layout.padded, mgr.layout.shard_size
        assert phi % (16 * n) == 0 and phi >= 629 and S * n == phi
        assert 8 * phi > comm.small_bytes, "the buffer must take the ring path for the exact volumes below"
        # Ring volumes, per rank per step: (N-1)/N·Φ elements per reduce-scatter or all-gather,
        # 2(N-1)/N·Φ per all-reduce; stage 0: one all-reduce; 1-2: reduce-scatter + all-gather;
        # 3: two all-gathers (forward, backward) + reduce-scatter. I.e. the paper's 2Φ and 3Φ
        # (elements) times (N-1)/N, which tends to 1 as N grows; here exactly:
        collectives = {0: 2, 1: 2, 2: 2, 3: 3}[stage]
        ring = collectives * (n - 1) * S * 8
        assert ring == collectives * (n - 1) / n * phi * 8
        expect = ring + (scalar if stage else 0)  # clipping is on: one scalar all-reduce in stages 1-3

        # memory: exact bytes with Φ padded, float64 parameters/gradients (8 B) and master states (8 B)
        want = {0: (phi, phi, phi), 1: (phi, phi, S), 2: (phi, S, S), 3: (S, S, S)}[stage]
        report = mgr.memory_report()
        expected = dict(
            zip(
                ("params", "grads", "master", "exp_avg", "exp_avg_sq"),
                (8 * want[0], 8 * want[1], 8 * want[2], 8 * want[2], 8 * want[2]),
            )
        )
        if report != expected:
            errors.append(f"stage {stage}: memory_report {report}, expected {expected}")

        losses64[stage] = train(mgr, x, y, STEPS, sl, np.float64, expect_comm=expect, errors=errors)
        if mgr.step_count != STEPS:
            errors.append(f"stage {stage}: step_count {mgr.step_count}")
        if stage == 3:
            check_stage3_holds_shards(mgr, errors)
        final[stage] = full_params(mgr)

    for i in range(len(SHAPES)):
        e = rel(final[0][i], ref[i])
        if e > 1e-12:
            errors.append(f"stage 0 vs single-process AdamW: parameter {i} differs by {e:.2e} relative")
        for stage in (1, 2, 3):
            e = rel(final[stage][i], final[0][i])
            if e > 1e-12:
                errors.append(f"stage {stage} vs stage 0: parameter {i} differs by {e:.2e} relative")
    if rel(losses64[0], ref_losses) > 1e-12:
        errors.append("stage 0 losses differ from the reference's")
    check_small_bucket(comm, p0, x, y, sl, max_norm, scalar, final[0], errors)

    # mixed precision: float16 (static loss scale 1024) and bfloat16, every stage; plus the paper's
    # formulas in bytes for 2-byte parameters/gradients and fp32 master states (K = 12)
    # (and with the gradients reduced in float32: accumulate="float32")
    for name, dtype, scale in (("float16", np.float16, 1024.0), ("bfloat16", ringcomm.bfloat16, None)):
        for stage, accumulate in [(s, a) for s in range(4) for a in (None, "float32")]:
            mgr = ZeroShardManager(
                comm,
                [p.astype(dtype) for p in p0],
                stage=stage,
                max_grad_norm=max_norm,
                loss_scale=scale,
                accumulate=accumulate,
                **HYPER,
            )
            phi = mgr.layout.padded
            paper = {0: 16 * phi, 1: 4 * phi + 12 * phi // n, 2: 2 * phi + 14 * phi // n, 3: 16 * phi // n}[stage]
            total = sum(mgr.memory_report().values())
            if total != paper or total != estimate_memory(phi, n, stage):
                errors.append(f"{name} stage {stage}: {total} bytes, the paper's formula gives {paper}")
            losses = train(mgr, x, y, STEPS, sl, dtype)
            worst = max(abs(a - b) / b for a, b in zip(losses, losses64[0]))
            if worst > HALF_TOL[name] or mgr.skipped_steps:
                errors.append(
                    f"{name} stage {stage} accumulate={accumulate}: losses off by {worst:.2e} relative (tolerance "
                    f"{HALF_TOL[name]}), {mgr.skipped_steps} skipped steps"
                )
    check_loss_scaling(comm, p0, x, y, sl, max_norm, errors)
    agree(comm, errors)


def check_small_bucket(comm, p0, x, y, sl, max_norm, scalar, want, errors):
    """Stages 1-3 with a bucket of 48 elements per rank (Φ/N is 160 to 640 here): each step
    reduce-scatters the gradients in rounds of N·48 elements and a ragged last round (counted on
    the communicator), sends the same bytes as one reduce-scatter, and ends within 1e-12 of stage
    0 (``want``). Then a bucket_elements that differs between ranks is an error on every rank."""
    n = comm.size

    class Bucketed(ZeroShardManager):
        bucket_elements = 48 * n

    sizes = []
    plain = comm.reduce_scatter

    def counted(x, *args, **kwargs):
        sizes.append(x.size)
        return plain(x, *args, **kwargs)

    comm.reduce_scatter = counted
    try:
        for stage in (1, 2, 3):
            mgr = Bucketed(comm, [p.copy() for p in p0], stage=stage, max_grad_norm=max_norm, **HYPER)
            S = mgr.layout.shard_size
            rounds = [n * min(48, S - o) for o in range(0, S, 48)]
            assert len(rounds) >= 3 and S % 48, "the test wants several rounds and a ragged last one"
            if mgr.scratch_bytes != 8 * n * 48:
                errors.append(f"bucketed stage {stage}: staging of {mgr.scratch_bytes} bytes, expected {8 * n * 48}")
            expect = {1: 2, 2: 2, 3: 3}[stage] * (n - 1) * S * 8 + scalar
            sizes.clear()
            train(mgr, x, y, STEPS, sl, np.float64, expect_comm=expect, errors=errors)
            if sizes != rounds * STEPS:
                errors.append(
                    f"bucketed stage {stage}: reduce-scatters of {sizes[: len(rounds) + 1]}... elements, "
                    f"expected {rounds} per step"
                )
            got = full_params(mgr)
            for i in range(len(SHAPES)):
                e = rel(got[i], want[i])
                if e > 1e-12:
                    errors.append(f"bucketed stage {stage} vs stage 0: parameter {i} differs by {e:.2e} relative")
    finally:
        del comm.reduce_scatter  # the class's method again
    if n == 1:
        return

    class Uneven(ZeroShardManager):
        bucket_elements = 48 * n if comm.rank == 0 else 1 << 25

    try:
        Uneven(comm, [p.copy() for p in p0], stage=2)
        errors.append("ranks with different bucket_elements: construction did not raise")
    except ValueError as e:
        if f"ranks {list(range(1, n))} differ from rank 0 in bucket_elements" not in str(e):
            errors.append(f"ranks with different bucket_elements: unclear error: {e}")


def check_stage3_holds_shards(mgr, errors):
    """Outside gathered() the stage-3 manager holds no full parameter: no array larger than a
    shard (the gradient staging buffer holds gradients), params[i] raises, nothing is gathered."""
    S, layout = mgr.layout.shard_size, mgr.layout
    for name, value in vars(mgr).items():
        size = getattr(value, "size", None)
        if isinstance(value, np.ndarray) and name != "_staging" and size > S:
            errors.append(f"stage 3 holds {name} of {size} elements (> shard {S}) outside gathered()")
    if mgr.gathered_bytes != 0 or mgr._gathered_arrays:
        errors.append("stage 3: parameters still gathered after the contexts closed")
    for i in range(len(SHAPES)):
        try:
            mgr.params[i]
            errors.append(f"stage 3: params[{i}] readable outside gathered()")
        except RuntimeError:
            pass
    full = full_params(mgr)
    with mgr.gathered([2, 0]) as (w2, w1):  # a subset: broadcast from the owners, only these held
        if not (np.array_equal(w2, full[2]) and np.array_equal(w1, full[0])):
            errors.append("stage 3: gathered([2, 0]) differs from the full gather")
        if mgr.gathered_bytes != 8 * (layout.sizes[0] + layout.sizes[2]):
            errors.append(f"stage 3: gathered([2, 0]) holds {mgr.gathered_bytes} bytes")
        with mgr.gathered([1]) as (b1,):  # nested
            if not np.array_equal(b1, full[1]) or not np.array_equal(mgr.params[0], full[0]):
                errors.append("stage 3: nested gathered([1]) wrong")
        try:
            mgr.params[3]
            errors.append("stage 3: params[3] readable while only [0, 1, 2] are gathered")
        except RuntimeError:
            pass
    if mgr.gathered_bytes != 0:
        errors.append("stage 3: subset gathers not released")


def check_loss_scaling(comm, p0, x, y, sl, max_norm, errors):
    """An inf (or nan) on one rank only skips the step on every rank: parameters and Adam states
    unchanged bitwise, step count unchanged, dynamic scale halved (a static one kept); the next
    step applies."""
    last = comm.size - 1
    for stage in range(4):
        for mode in ("dynamic", 256.0):
            mgr = ZeroShardManager(
                comm, [p.astype(np.float16) for p in p0], stage=stage, max_grad_norm=max_norm, loss_scale=mode, **HYPER
            )
            if mode == "dynamic":
                mgr.scaler.scale = 1024.0  # start where these gradients do not overflow by themselves
            train(mgr, x, y, 2, sl, np.float16)
            state = [np.array(a, copy=True) for a in (mgr._master, mgr._exp_avg, mgr._exp_avg_sq)]
            params, scale = full_params(mgr), mgr.loss_scale

            def inject(t, grads, stage=stage):
                if comm.rank == last:
                    grads[stage % 4][-1] = np.inf if stage % 2 else np.nan

            train(mgr, x, y, 1, sl, np.float16, inject=inject)
            after = [mgr._master, mgr._exp_avg, mgr._exp_avg_sq]
            want_scale = scale / 2 if mode == "dynamic" else scale
            tag = f"loss scaling ({mode}) stage {stage}"
            if mgr.step_count != 2 or mgr.skipped_steps != 1 or mgr.loss_scale != want_scale:
                errors.append(
                    f"{tag}: step_count {mgr.step_count}, skipped {mgr.skipped_steps}, "
                    f"scale {mgr.loss_scale} (want 2, 1, {want_scale})"
                )
            if not all(np.array_equal(a, b) for a, b in zip(state, after)):
                errors.append(f"{tag}: Adam states changed by a skipped step")
            if not all(np.array_equal(a, b) for a, b in zip(params, full_params(mgr))):
                errors.append(f"{tag}: parameters changed by a skipped step")
            train(mgr, x, y, 1, sl, np.float16)
            if mgr.step_count != 3:
                errors.append(f"{tag}: the step after the overflow was not applied")


@pytest.mark.parallel(nprocs=[4])
def test_checkpoint_reshard(tmp_path, seed):
    """Save at N = 4 (stage 3) after 10 steps; reload at N = 4 (bitwise identical continuation),
    N = 2 (stage 1) and N = 3 (stage 2) via sub-communicators, continue 10 steps: identical to not
    stopping (within 1e-12 relative: the sums are taken in another order at another N).
    consolidate() gives bitwise the same state whichever N saved it (float64 model: float64 master;
    float16 model: float32 master), and within 1e-12 the state of stage 0 trained alike and saved
    at N = 4 (each rank writes its shard of the full states). Truncated, corrupt, incomplete,
    malformed (a field missing from one shard's entry: only the ranks reading that shard would
    trip on it) and mismatched checkpoints raise CheckpointError on every rank and change nothing."""
    comm = make_comm()
    errors: list[str] = []
    root = pathlib.Path(comm.mpi.bcast(str(tmp_path) if comm.rank == 0 else None, root=0))
    x, y, p0 = problem(seed)
    kw = dict(max_grad_norm=1.0, loss_scale="dynamic", **HYPER)

    def manager(c, stage, params=None, dtype=np.float64):
        mgr = ZeroShardManager(c, [p.astype(dtype) for p in (params or p0)], stage=stage, **kw)
        mgr.scaler.growth_interval = 3  # the scale changes within the run: its state must be saved
        return mgr

    mgr = manager(comm, 3)
    train(mgr, x, y, 10, rows(comm), np.float64)
    mgr.save(root / "n4")
    at10 = full_params(mgr)
    plain = manager(comm, 0)  # stage 0 keeps the whole states; it saves only its shard of them
    train(plain, x, y, 10, rows(comm), np.float64)
    plain.save(root / "z4")
    train(mgr, x, y, 10, rows(comm), np.float64)
    final, final_scale = full_params(mgr), mgr.loss_scale

    half = manager(comm, 3, dtype=np.float16)  # float16 parameters: float32 master states
    half.scaler.scale = 1024.0  # 2**16 would overflow these float16 gradients
    train(half, x, y, 3, rows(comm), np.float16)
    half.save(root / "h4")

    again = manager(comm, 3)  # the same N and stage: bitwise identical continuation
    again.load(root / "n4")
    train(again, x, y, 10, rows(comm), np.float64)
    if not all(np.array_equal(a, b) for a, b in zip(full_params(again), final)):
        errors.append("N=4 reload: continuation not bitwise identical")

    for size, stage in ((2, 1), (3, 2)):
        sub = comm.mpi.Split(0 if comm.rank < size else MPI.UNDEFINED, comm.rank)
        if sub != MPI.COMM_NULL:
            c = ringcomm.Communicator(sub, timeout=comm.timeout)
            m = manager(c, stage)
            m.load(root / "n4")
            if m.step_count != 10 or not all(np.array_equal(a, b) for a, b in zip(full_params(m), at10)):
                errors.append(f"N={size}: loaded parameters or step count differ from the saved ones")
            m.save(root / f"n{size}")
            h = manager(c, stage, dtype=np.float16)
            h.load(root / "h4")
            h.save(root / f"h{size}")
            train(m, x, y, 10, rows(c), np.float64)
            worst = max(rel(a, b) for a, b in zip(full_params(m), final))
            if worst > 1e-12 or m.loss_scale != final_scale:
                errors.append(
                    f"N={size} stage {stage}: continuation off by {worst:.2e}, scale {m.loss_scale} vs {final_scale}"
                )
            sub.Free()
        comm.barrier()

    if comm.rank == 0:
        states = {k: consolidate(root / k) for k in ("n4", "n2", "n3")}
        for k, st in states.items():
            if st["step"] != 10 or set(st) != {"params", "exp_avg", "exp_avg_sq", "step"}:
                errors.append(f"consolidate({k}): step {st['step']}, keys {sorted(st)}")
            for key in ("params", "exp_avg", "exp_avg_sq"):
                for a, b in zip(st[key], states["n4"][key]):
                    if a.dtype != np.float64 or not np.array_equal(a, b):
                        errors.append(f"consolidate({k})[{key}] differs from the N=4 save")
            if not all(np.array_equal(a, b) and a.shape == s for a, b, s in zip(st["params"], at10, SHAPES)):
                errors.append(f"consolidate({k}) params differ from the trained parameters")
        z4 = consolidate(root / "z4")
        worst = max(
            rel(a, b) for key in ("params", "exp_avg", "exp_avg_sq") for a, b in zip(z4[key], states["n4"][key])
        )
        if z4["step"] != 10 or worst > 1e-12:
            errors.append(f"consolidate(z4) (stage 0 at N=4): step {z4['step']}, off the stage 3 save by {worst:.2e}")
        halves = {k: consolidate(root / k) for k in ("h4", "h2", "h3")}
        for k, st in halves.items():
            if st["step"] != 3 or not all(
                a.dtype == np.float32 and np.array_equal(a, b)
                for key in ("params", "exp_avg", "exp_avg_sq")
                for a, b in zip(st[key], halves["h4"][key])
            ):
                errors.append(f"consolidate({k}) (float16 model) differs from the N=4 save or is not float32")
        # damaged copies of the N=4 checkpoint
        meta = (root / "n4" / "meta.json").read_text()
        shard = sorted((root / "n4").glob("shard-00002-*.bin"))[0].name
        for name in ("truncated", "corrupt", "incomplete", "nocrc"):
            shutil.copytree(root / "n4", root / name)
        with open(root / "truncated" / shard, "r+b") as f:
            f.truncate(os.path.getsize(root / "n4" / shard) - 8)
        with open(root / "corrupt" / shard, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))
        os.remove(root / "incomplete" / "meta.json")
        assert "shard-00002" in meta
        doc = json.loads(meta)
        del next(s for s in doc["shards"] if s["file"].startswith("shard-00002"))["crc32"]
        (root / "nocrc" / "meta.json").write_text(json.dumps(doc))
        for name in ("truncated", "corrupt", "incomplete", "nocrc"):
            try:
                consolidate(root / name)
                errors.append(f"consolidate({name}) did not raise")
            except CheckpointError:
                pass
    comm.barrier()
    # another model (shapes) and another precision (float32 master) saved for the mismatch cases
    manager(comm, 2, params=[np.ones((3, 3)), np.ones(4)]).save(root / "shapes")
    manager(comm, 2, dtype=np.float32).save(root / "float32")

    sub = comm.mpi.Split(0 if comm.rank < 2 else MPI.UNDEFINED, comm.rank)
    for c in [comm] + ([ringcomm.Communicator(sub, timeout=comm.timeout)] if sub != MPI.COMM_NULL else []):
        m = manager(c, 3 if c.size == 4 else 1)
        train(m, x, y, 2, rows(c), np.float64)
        snapshot = [np.array(a, copy=True) for a in (m._master, m._exp_avg, m._exp_avg_sq)] + full_params(m)
        for name, words in (
            ("truncated", "truncated"),
            ("corrupt", "CRC"),
            ("incomplete", "meta.json"),
            ("nocrc", "has no 'crc32'"),
            ("shapes", "shapes differ"),
            ("float32", "float32"),
            ("missing", "does not exist"),
        ):
            try:
                m.load(root / name)
                errors.append(f"N={c.size}: load({name}) did not raise")
            except CheckpointError as e:
                if words not in str(e):
                    errors.append(f"N={c.size}: load({name}) error does not say {words!r}: {e}")
            now = [m._master, m._exp_avg, m._exp_avg_sq] + full_params(m)
            if m.step_count != 2 or not all(np.array_equal(a, b) for a, b in zip(snapshot, now)):
                errors.append(f"N={c.size}: a failed load({name}) changed the manager")
    if sub != MPI.COMM_NULL:
        sub.Free()
    agree(comm, errors)


@pytest.mark.parallel(nprocs=[4])
def test_example_same_losses_every_stage():
    """examples/train_zero.py at N = 4: the same losses for stages 0-3 (float32: within 1e-5
    relative, the rounding of sums taken in another order; float64: within 1e-12), decreasing."""
    spec = importlib.util.spec_from_file_location(
        "train_zero", pathlib.Path(__file__).parents[1] / "examples" / "train_zero.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    comm = make_comm()
    errors = []
    for dtype, tol in (("float32", 1e-5), ("float64", 1e-12)):
        runs = {
            s: example.main(["--stage", str(s), "--steps", "8", "--dtype", dtype, "--device", "cpu"], comm=comm)
            for s in range(4)
        }
        for s in (1, 2, 3):
            worst = max(abs(a - b) / b for a, b in zip(runs[s], runs[0]))
            if worst > tol:
                errors.append(f"{dtype}: stage {s} losses differ from stage 0's by {worst:.2e}")
        if not runs[0][-1] < 0.5 * runs[0][0]:
            errors.append(f"{dtype}: the loss did not decrease: {runs[0]}")
    agree(comm, errors)
