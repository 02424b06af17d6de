"""The CUDA kernels on a GPU (skipped without CuPy or a GPU): reduce, copy and fused Adam against numpy,
and the float32-accumulation kernels (reduce_acc, reduce_acc_final, widen) against the HostDevice.

The reduce kernel must match numpy bit for bit: it combines half types in float32 with one
rounding (the AVG division fused), exactly as the references below do. The float32-accumulation
kernels must give the HostDevice's bits, on data full of special values (tests/accumulate_values.py).
Outputs are poisoned and guarded, so unwritten elements and writes out of bounds show; views start at
odd offsets so the scalar head, the vector body and the scalar tail all run, and the fully scalar path too.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
from accumulate_values import half_values, partial_values
from accumulate_values import reference as acc_reference
from conftest import require_gpu

cupy, _ngpu = require_gpu()

from ringcomm.devices import cuda as cuda_device  # noqa: E402
from ringcomm.devices.cuda import CudaDevice, fused_adam  # noqa: E402
from ringcomm.devices.host import HostDevice  # noqa: E402
from ringcomm.ops import FLOAT_DTYPES, HALF_DTYPES, SUPPORTED_DTYPES, ReduceOp  # noqa: E402

OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
COUNTS = [1, 2, 7, 15, 16, 17, 255, 1000, 65537]
OFFSETS = [(0, 0, 0), (1, 1, 1), (3, 3, 3), (0, 1, 2)]  # (dst, a, b) element offsets: aligned, same, mixed
GUARD = 64


def to_device(a: np.ndarray):
    try:
        return cupy.asarray(a)
    except (TypeError, ValueError) as e:
        pytest.skip(f"CuPy {cupy.__version__} cannot hold {a.dtype} arrays: {e}")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def random(rng, dtype: np.dtype, n: int, op: ReduceOp) -> np.ndarray:
    if dtype in FLOAT_DTYPES:
        return (rng.standard_normal(n) * (1.5 if op is ReduceOp.PROD else 100.0)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


def reference(a: np.ndarray, b: np.ndarray, op: ReduceOp, div: int) -> np.ndarray:
    fn = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op]
    if a.dtype in HALF_DTYPES:
        r = fn(a.astype(np.float32), b.astype(np.float32))
        return (r / np.float32(div) if div != 1 else r).astype(a.dtype)
    with np.errstate(over="ignore"):
        r = fn(a, b)
    return (r / a.dtype.type(div)).astype(a.dtype) if div != 1 else r


def guarded(host: np.ndarray, offset: int, poison: int = 0x5A):
    """A device buffer of poison bytes with ``host`` copied in at element ``offset`` (+ GUARD around)."""
    item = host.dtype.itemsize
    raw = np.full((offset + host.size + GUARD) * item, poison, np.uint8)
    raw[offset * item : (offset + host.size) * item] = host.view(np.uint8)
    draw = to_device(raw)
    return draw, draw[offset * item : (offset + host.size) * item].view(host.dtype)


def outside_untouched(draw, view, poison: int = 0x5A) -> bool:
    raw = cupy.asnumpy(draw)
    lo = view.data.ptr - draw.data.ptr
    return bool((raw[:lo] == poison).all() and (raw[lo + view.nbytes :] == poison).all())


def test_reduce_every_dtype_op_and_alignment():
    rng = np.random.default_rng(20261201)
    dev = CudaDevice()
    for dtype in SUPPORTED_DTYPES:
        for op in OPS:
            for n in COUNTS:
                for offs in OFFSETS:
                    for div in [1, 3] if dtype in FLOAT_DTYPES else [1]:
                        a, b = random(rng, dtype, n, op), random(rng, dtype, n, op)
                        want = reference(a, b, op, div)
                        poison = np.zeros(n, dtype)  # the output view starts as poison bytes
                        dst_raw, dst = guarded(poison, offs[0])
                        _, av = guarded(a, offs[1])
                        _, bv = guarded(b, offs[2])
                        dev.reduce(dst, av, bv, op, div)
                        dev.stream.synchronize()
                        what = f"{dtype} {op} n={n} offsets={offs} div={div}"
                        np.testing.assert_array_equal(bits(cupy.asnumpy(dst)), bits(want), err_msg=what)
                        assert outside_untouched(dst_raw, dst), f"wrote out of bounds: {what}"
                        np.testing.assert_array_equal(bits(cupy.asnumpy(bv)), bits(b), err_msg=f"b changed: {what}")
                # in place: dst is a
                a, b = random(rng, dtype, n, op), random(rng, dtype, n, op)
                raw, av = guarded(a, 1)
                dev.reduce(av, av, to_device(b), op)
                dev.stream.synchronize()
                np.testing.assert_array_equal(
                    bits(cupy.asnumpy(av)), bits(reference(a, b, op, 1)), err_msg=f"in place {dtype} {op} n={n}"
                )
                assert outside_untouched(raw, av)


def _wave_bytes(dev: CudaDevice, source: str, name: str) -> int:
    """What one full wave of kernel ``name`` moves per grid-stride iteration: SMs x blocks x 512 x 64 bytes."""
    from ringcomm.devices import cuda as rcuda

    return rcuda.max_blocks(rcuda.kernel(source, name), name, dev.device_id) * rcuda.BLOCK * rcuda.UNROLL * 16


def test_reduce_large_buffers_take_several_grid_strides():
    """Several grid-stride iterations (sized by the device's wave), unrolled and not."""
    rng = np.random.default_rng(3)
    dev = CudaDevice()
    wave = _wave_bytes(dev, "reduce.cu", "ringcomm_reduce_sum_f32")
    for dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.int8)):
        # two waves, 5 vectors for the loop that is not unrolled and a tail; seven waves and a tail
        for n in ((2 * wave + 5 * 16) // dtype.itemsize + 3, 7 * wave // dtype.itemsize + 1):
            a, b = random(rng, dtype, n, ReduceOp.SUM), random(rng, dtype, n, ReduceOp.SUM)
            for offs in ((0, 0, 0), (1, 1, 1)):
                raw, dst = guarded(np.zeros(n, dtype), offs[0])
                dev.reduce(dst, guarded(a, offs[1])[1], guarded(b, offs[2])[1], ReduceOp.SUM)
                dev.stream.synchronize()
                np.testing.assert_array_equal(
                    bits(cupy.asnumpy(dst)),
                    bits(reference(a, b, ReduceOp.SUM, 1)),
                    err_msg=f"{dtype} n={n} offsets={offs}",
                )
                assert outside_untouched(raw, dst)
    src = rng.integers(0, 256, 5 * _wave_bytes(dev, "copy.cu", "ringcomm_copy") + 16 * 5 + 7, dtype=np.uint8)
    raw, d = guarded(np.zeros(src.size, np.uint8), 3)
    dev.copy(d, guarded(src, 3)[1])
    dev.stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(d), src)
    assert outside_untouched(raw, d)


def test_reduce_empty_and_errors():
    dev = CudaDevice()
    e = cupy.empty(0, np.float32)
    dev.reduce(e, e, e, ReduceOp.SUM)
    x = cupy.ones(4, np.int32)
    with pytest.raises(TypeError, match="float dtype"):
        dev.reduce(x, x, x, ReduceOp.SUM, 2)
    with pytest.raises(ValueError, match="lengths differ"):
        dev.reduce(x, x, x[:3], ReduceOp.SUM)
    with pytest.raises(TypeError, match="dtypes differ"):
        dev.reduce(x, x, cupy.ones(4, np.float32), ReduceOp.SUM)


def test_reduce_nan_propagates_like_numpy():
    dev = CudaDevice()
    for dtype in FLOAT_DTYPES:
        a = np.array([np.nan, 1, np.nan, -np.inf, 0.5] * 7, dtype)
        b = np.array([2, np.nan, np.nan, 5, 0.25] * 7, dtype)
        for op in OPS:
            d = to_device(np.zeros_like(a))
            dev.reduce(d, to_device(a), to_device(b), op)
            got = cupy.asnumpy(d).astype(np.float64)
            want = reference(a, b, op, 1).astype(np.float64)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{dtype} {op}")
            np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)], err_msg=f"{dtype} {op}")


# (dst, a, b) element offsets: all at the same element of their vectors (aligned, shifted alike, a in
# another 8-byte word), and mixed (the scalar path)
ACC_OFFSETS = [(0, 0, 0), (1, 1, 1), (3, 3, 3), (1, 5, 1), (0, 1, 2)]


def _acc_run(dev, kind: str, dst, a, b, op: ReduceOp, div: int) -> None:
    if kind == "acc":
        dev.reduce_acc(dst, a, b, op)
    elif kind == "final":
        dev.reduce_acc_final(dst, a, b, op, div)
    else:
        dev.widen(dst, a)


def _acc_case(
    rng, dev, host, kind: str, dtype, op: ReduceOp, n: int, offs, div: int, in_place: bool, plain: bool = False
) -> None:
    """One CudaDevice call against the HostDevice's (and the numpy reference's) bits; ``plain``: ordinary
    values with a few specials (cheaper to make, for large buffers)."""
    if plain:
        a = (rng.standard_normal(n, np.float32) * np.float32(100)).astype(dtype)
        b = rng.standard_normal(n, np.float32) * np.float32(100)
        a[::1009], b[::997], b[5::1013] = np.nan, np.inf, 2.0**-140
    else:
        a = half_values(rng, dtype, n)
        b = partial_values(rng, a, div)
    b = b if kind != "widen" else None
    out_dtype = np.dtype(dtype) if kind == "final" else np.dtype(np.float32)
    ha, hb = a.copy(), (b.copy() if b is not None else None)
    hd = (hb if kind == "acc" else ha) if in_place else np.empty(n, out_dtype)
    with np.errstate(all="ignore"):
        _acc_run(host, kind, hd, ha, hb, op, div)
        want = acc_reference(kind, a, b, op.value, div)
    a_raw, av = guarded(a, offs[1])
    b_raw, bv = guarded(b, offs[2]) if b is not None else (None, None)
    if in_place:
        d_raw, dv = (b_raw, bv) if kind == "acc" else (a_raw, av)
    else:
        d_raw, dv = guarded(np.zeros(n, out_dtype), offs[0])
    _acc_run(dev, kind, dv, av, bv, op, div)
    dev.stream.synchronize()
    what = f"{kind} {dtype} {op} n={n} offsets={offs} div={div} in_place={in_place}"
    got = bits(cupy.asnumpy(dv))
    np.testing.assert_array_equal(got, bits(hd), err_msg=f"CudaDevice vs HostDevice: {what}")
    np.testing.assert_array_equal(got, bits(want), err_msg=f"CudaDevice vs reference: {what}")
    assert outside_untouched(d_raw, dv), f"wrote out of bounds: {what}"
    if not (in_place and kind == "final"):
        np.testing.assert_array_equal(bits(cupy.asnumpy(av)), bits(a), err_msg=f"a changed: {what}")
    if b is not None and not (in_place and kind == "acc"):
        np.testing.assert_array_equal(bits(cupy.asnumpy(bv)), bits(b), err_msg=f"b changed: {what}")


def test_accumulate_kernels_match_the_host_device():
    """reduce_acc / reduce_acc_final / widen: every half dtype, op (AVG as SUM, its division in the final
    kernel), div 1 and 3, count and alignment path, in place and not, bit for bit the HostDevice's."""
    rng = np.random.default_rng(20260611)
    dev, host = CudaDevice(), HostDevice()
    for dtype in HALF_DTYPES:
        for op in OPS + [ReduceOp.AVG]:
            for div in (1, 3):
                for n in COUNTS:
                    for offs in ACC_OFFSETS:
                        for kind in ("acc", "final"):
                            _acc_case(rng, dev, host, kind, dtype, op, n, offs, div, False)
                        if op is ReduceOp.SUM and div == 1:
                            _acc_case(rng, dev, host, "widen", dtype, op, n, offs, 1, False)
                    for kind in ("acc", "final"):  # in place: reduce_acc into b, reduce_acc_final into a
                        _acc_case(rng, dev, host, kind, dtype, op, n, (1, 1, 1), div, True)


def test_accumulate_large_buffers_take_several_grid_strides():
    """Several grid-stride iterations (a full wave moves SMs x blocks x 512 x 16 elements), unrolled and not."""
    from ringcomm.devices import cuda as rcuda

    rng = np.random.default_rng(31)
    dev, host = CudaDevice(), HostDevice()
    name = "ringcomm_reduce_acc_final_sum_f16"
    wave = rcuda.max_blocks(rcuda.kernel("accumulate.cu", name), name, dev.device_id) * rcuda.BLOCK * rcuda.UNROLL * 4
    n = 3 * wave + 4 * 5 + 3  # three full waves, then 5 units left for the loop that is not unrolled, and a tail
    for dtype in HALF_DTYPES:
        for kind in ("acc", "final", "widen"):
            for offs in ((0, 0, 0), (1, 1, 1)):
                _acc_case(rng, dev, host, kind, dtype, ReduceOp.AVG, n, offs, 4, False, plain=True)


def test_accumulate_empty_and_errors():
    dev = CudaDevice()
    e16, e32 = cupy.empty(0, np.float16), cupy.empty(0, np.float32)
    dev.reduce_acc(e32, e16, e32, ReduceOp.SUM)
    dev.reduce_acc_final(e16, e16, e32, ReduceOp.AVG, 3)
    dev.widen(e32, e16)
    h, f = cupy.ones(4, np.float16), cupy.ones(4, np.float32)
    with pytest.raises(ValueError, match="lengths differ"):
        dev.reduce_acc(f, h, f[:3], ReduceOp.SUM)
    with pytest.raises(ValueError, match="lengths differ"):
        dev.reduce_acc_final(h[:3], h, f, ReduceOp.SUM)
    with pytest.raises(ValueError, match="lengths differ"):
        dev.widen(f, h[:3])
    with pytest.raises(TypeError, match="float16, bfloat16"):
        dev.reduce_acc(f, f, f, ReduceOp.SUM)
    with pytest.raises(TypeError, match="float32"):
        dev.reduce_acc_final(h, h, h, ReduceOp.SUM)
    with pytest.raises(TypeError, match="dst"):
        dev.reduce_acc(h, h, f, ReduceOp.SUM)
    with pytest.raises(TypeError, match="dst"):
        dev.widen(h, h)


def test_copy_every_relative_alignment():
    rng = np.random.default_rng(5)
    dev = CudaDevice()
    for nbytes in (1, 5, 16, 17, 31, 4097, 1_000_001):
        for do in range(0, 16, 3):
            for so in range(0, 16, 5):
                src = rng.integers(0, 256, nbytes, dtype=np.uint8)
                draw, d = guarded(np.zeros(nbytes, np.uint8), do)
                _, s = guarded(src, so)
                dev.copy(d, s)
                dev.stream.synchronize()
                np.testing.assert_array_equal(cupy.asnumpy(d), src, err_msg=f"{nbytes} bytes, dst+{do} src+{so}")
                assert outside_untouched(draw, d)


def test_work_follows_the_stream():
    """Queued on the given stream, after the work already there; nothing runs on another stream."""
    rng = np.random.default_rng(9)
    s = cupy.cuda.Stream(non_blocking=True)
    dev = CudaDevice(s)
    assert dev.stream is s
    n = 1 << 22
    a = rng.standard_normal(n).astype(np.float32)
    with s:
        da = to_device(a)
        db = da * 2  # queued on s before the reduce
        out = cupy.empty_like(da)
    dev.reduce(out, da, db, ReduceOp.SUM)
    dev.copy(da, out)
    dev.stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(da), a + a * 2)
    assert CudaDevice().stream.ptr == cupy.cuda.get_current_stream().ptr


def _f64_to_bf16_exact(x: np.ndarray) -> np.ndarray:
    b = x.view(np.uint64)
    r = b + np.uint64((1 << 44) - 1) + ((b >> np.uint64(45)) & np.uint64(1))
    sign = (r >> np.uint64(48)) & np.uint64(0x8000)
    exp = ((r >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64) - 1023 + 127
    return (sign | (exp.astype(np.uint64) << np.uint64(7)) | ((r >> np.uint64(45)) & np.uint64(0x7F))).astype(np.uint16)


def test_fused_adam_every_dtype_combination():
    rng = np.random.default_rng(17)
    lr, b1, b2, eps, wd, scale = 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5
    n = 100_003
    for pdt in (np.dtype(np.float32), np.dtype(np.float64)):
        for gdt in FLOAT_DTYPES:
            for odt in [None, *FLOAT_DTYPES]:
                p0 = rng.standard_normal(n).astype(pdt)
                m0 = (rng.standard_normal(n) * 0.01).astype(pdt)
                v0 = (rng.random(n) * 1e-3).astype(pdt)
                g = (rng.standard_normal(n) * 0.1).astype(gdt)
                p, m, v = to_device(p0), to_device(m0), to_device(v0)
                out_raw, out = guarded(np.zeros(n, odt) if odt is not None else np.full(n, 0x5A, np.uint8), 1)
                for step in (1, 2):
                    res = fused_adam(
                        p,
                        to_device(g),
                        m,
                        v,
                        lr=lr,
                        beta1=b1,
                        beta2=b2,
                        eps=eps,
                        weight_decay=wd,
                        step=step,
                        grad_scale=scale,
                        out=out if odt is not None else None,
                    )
                    assert res is (out if odt is not None else p)
                    gg = g.astype(np.float64) * scale
                    m0 = b1 * m0.astype(np.float64) + (1 - b1) * gg
                    v0 = b2 * v0.astype(np.float64) + (1 - b2) * gg * gg
                    p0 = p0.astype(np.float64) * (1 - lr * wd) - lr * (m0 / (1 - b1**step)) / (
                        np.sqrt(v0 / (1 - b2**step)) + eps
                    )
                u = 2.0**-24 if pdt == np.float32 else 2.0**-53  # unit roundoff; atol: a few ulps of the inputs
                what = f"master {pdt} grad {gdt} out {odt}"
                got = cupy.asnumpy(p)
                np.testing.assert_allclose(got, p0, rtol=64 * u, atol=16 * u, err_msg=what)
                np.testing.assert_allclose(cupy.asnumpy(m), m0, rtol=64 * u, atol=16 * u * 0.1, err_msg=what)
                np.testing.assert_allclose(cupy.asnumpy(v), v0, rtol=64 * u, atol=16 * u * 1e-3, err_msg=what)
                if odt is None:
                    assert (cupy.asnumpy(out_raw) == 0x5A).all()
                    continue
                assert outside_untouched(out_raw, out)
                if odt == ml_dtypes.bfloat16 and pdt == np.float64:
                    want = _f64_to_bf16_exact(got)
                else:
                    want = bits(got.astype(odt))
                np.testing.assert_array_equal(bits(cupy.asnumpy(out)), want, err_msg=what)


def test_fused_adam_validates():
    p = cupy.zeros(8, np.float32)
    g, m, v = cupy.zeros(8, np.float32), cupy.zeros(8, np.float32), cupy.zeros(8, np.float32)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(TypeError, match="master"):
        fused_adam(p.astype(np.float16), g, m, v, step=1, **hp)
    with pytest.raises(TypeError, match="exp_avg"):
        fused_adam(p, g, m.astype(np.float64), v, step=1, **hp)
    with pytest.raises(ValueError, match="elements"):
        fused_adam(p, g[:7], m, v, step=1, **hp)
    with pytest.raises(ValueError, match="overlap"):
        fused_adam(p, g, p, v, step=1, **hp)
    with pytest.raises(ValueError, match="step"):
        fused_adam(p, g, m, v, step=0, **hp)
    with pytest.raises(TypeError, match="out"):
        fused_adam(p, g, m, v, step=1, out=cupy.zeros(8, np.int32), **hp)
    with pytest.raises(TypeError, match="host"):
        fused_adam(np.zeros(8, np.float32), g, m, v, step=1, **hp)


def test_warm_up_compiles_every_kernel_for_the_current_device(monkeypatch):
    """cuda.warm_up() compiles every module ringcomm loads (each csrc file, and the 48 ring kernels,
    compiled one at a time), in threads of its own, each for the caller's current device (a new
    thread's is device 0: here the last device, where there are several), so that no later call
    compiles. (Where a GPU is, CuPy's disk cache keeps the binaries: benchmarks/gpu_check.sh's
    compile step runs it once, before the tests.)"""
    device = cupy.cuda.runtime.getDeviceCount() - 1
    monkeypatch.setattr(cuda_device, "_modules", {})
    monkeypatch.setattr(cuda_device, "_kernels", {})
    threads, kernel = set(), cuda_device.kernel

    def recorded(file: str, name: str):
        threads.add(threading.get_ident())
        return kernel(file, name)

    monkeypatch.setattr(cuda_device, "kernel", recorded)
    with cupy.cuda.Device(device):
        cuda_device.warm_up(jobs=4)
    names = [name for _, name in cuda_device.every_kernel()]
    assert len(names) == 4 + 4 * len(cuda_device.SUFFIX) and sorted(cuda_device._kernels) == sorted(names)
    assert len(cuda_device._modules) == len(names) and threads and threading.get_ident() not in threads
    if getattr(cupy, "_emulated", False):  # (the stand-in's modules say which devices they were loaded for)
        assert all(mod.loaded == {device} for mod, _ in cuda_device._modules.values())
