"""ringcomm.zero on CuPy arrays (skipped without CuPy or a GPU): the fused Adam kernel against the
host formula, and the manager on GPU arrays against the manager on numpy arrays (one rank)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_gpu

cupy, _ngpu = require_gpu()

import ringcomm  # noqa: E402
from ringcomm.zero import ZeroShardManager, adam_update, consolidate  # noqa: E402

HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


@pytest.mark.parametrize(
    "mdt,gdt,tol", [(np.float32, np.float16, 2e-6), (np.float32, np.float32, 2e-6), (np.float64, np.float64, 1e-13)]
)
def test_fused_adam_matches_host(mdt, gdt, tol):
    from ringcomm.devices.cuda import fused_adam

    rng = np.random.default_rng(0)
    n = 1_000_003  # not a multiple of any vector width
    host = [
        rng.standard_normal(n).astype(mdt),
        (rng.standard_normal(n) * 1e-2).astype(mdt),
        (rng.random(n) * 1e-3).astype(mdt),
    ]
    dev = [cupy.asarray(a) for a in host]
    for t in (1, 2, 3):
        g = (rng.standard_normal(n) * 100).astype(gdt)
        out_h, out_d = np.empty(n, gdt), cupy.empty(n, gdt)
        adam_update(*host[:1], g, *host[1:], step=t, grad_scale=0.25, out=out_h, **HP)
        fused_adam(dev[0], cupy.asarray(g), dev[1], dev[2], step=t, grad_scale=0.25, out=out_d, **HP)
        for h, d in zip(host, dev):
            np.testing.assert_allclose(d.get(), h, rtol=tol, atol=tol * 1e-2)
        np.testing.assert_array_equal(out_d.get(), dev[0].get().astype(gdt))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_manager_on_gpu_matches_host(stage, tmp_path):
    comm = ringcomm.init(timeout=60.0)
    rng = np.random.default_rng(stage)
    shapes = [(300, 17), (17,), (17, 5)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    kw = dict(stage=stage, lr=1e-2, weight_decay=0.01, max_grad_norm=5.0, loss_scale="dynamic")
    on_host = ZeroShardManager(comm, params, **kw)
    on_gpu = ZeroShardManager(comm, [cupy.asarray(p) for p in params], **kw)
    assert on_gpu.memory_report() == on_host.memory_report()
    for _ in range(5):
        grads = [(rng.standard_normal(s) * on_host.loss_scale).astype(np.float32) for s in shapes]
        assert on_host.step(grads) and on_gpu.step([cupy.asarray(g) for g in grads])
    with on_host.gathered() as a, on_gpu.gathered() as b:
        for x, y in zip(a, b):
            assert isinstance(y, cupy.ndarray)
            np.testing.assert_allclose(y.get(), x, rtol=1e-5, atol=1e-6)
    on_gpu.save(tmp_path / "gpu")
    back = ZeroShardManager(comm, params, **kw)
    back.load(tmp_path / "gpu")
    with back.gathered() as a, on_gpu.gathered() as b:
        assert all(np.array_equal(x, y.get()) for x, y in zip(a, b))
    assert consolidate(tmp_path / "gpu")["step"] == 5
