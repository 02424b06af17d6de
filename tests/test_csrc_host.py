"""The kernels' arithmetic and indexing, run on the CPU against numpy (no GPU, no nvcc).

tests/csrc_harness.cpp includes csrc/*.cu with the host C++ compiler and runs every "thread" of a
grid in turn; the grids here are small so the unrolled, remainder, head and tail paths of the
grid-stride loops all run. Guard bytes around each output catch writes out of bounds. Skipped
when no C++ compiler is found. (On the GPU the 16-bit conversions are PTX cvt instructions; here
the integer versions in common.cuh run, checked below against numpy and ml_dtypes.)

The harness is also built with -DRC_HOST_CUPY_OPTIONS (fixture ``lib_cupy``): optimizer.cu's and
accumulate.cu's plain float and double arithmetic then behaves as under CuPy's NVRTC options (-ftz=true
appended by CuPy, -fmad=true by default: subnormals flushed, a*b+c fused), while common.cuh's PTX wrappers
stay IEEE, as on the GPU. The fused Adam must equal ringcomm.zero.adam.adam_update bit for bit in both
builds, and the float32-accumulation kernels (accumulate.cu) numpy and ringcomm's HostDevice.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from accumulate_values import CANONICAL_NAN_BITS, F16, HALVES, half_values, midpoint_f16, partial_values
from accumulate_values import reference as acc_reference

DTYPES = [
    np.dtype(t)
    for t in (
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.float64,
        np.int8,
        np.uint8,
        np.int16,
        np.uint16,
        np.int32,
        np.uint32,
        np.int64,
        np.uint64,
    )
]
OPS = ["sum", "prod", "min", "max"]
FLOATS = DTYPES[:4]
u64 = ctypes.c_uint64


def _load(path: Path) -> ctypes.CDLL:
    """A build of the harness (conftest's harness_libraries), its entry points typed."""
    so = ctypes.CDLL(str(path))
    so.rc_host_reduce.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        u64,
        ctypes.c_int,
        ctypes.c_double,
        u64,
    ]
    so.rc_host_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, u64, u64]
    so.rc_host_adam.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5 + [u64, ctypes.c_void_p, u64]
    so.rc_host_convert.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, u64]
    so.rc_host_misaligned.restype = u64
    so.rc_host_probe.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_double]
    so.rc_host_probe.restype = ctypes.c_double
    so.rc_host_reduce_acc.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        u64,
        u64,
    ]
    so.rc_host_reduce_acc_final.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        u64,
        ctypes.c_int,
        ctypes.c_float,
        u64,
    ]
    so.rc_host_widen.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, u64, u64]
    return so


@pytest.fixture(scope="module")
def lib(harness_libraries):
    return _load(harness_libraries["plain"].result())


@pytest.fixture(scope="module")
def lib_cupy(harness_libraries):
    """optimizer.cu's float and double as CuPy's NVRTC options make them (tests/csrc_harness.cpp)."""
    return _load(harness_libraries["cupy options"].result())


def ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.itemsize}")


def random(rng: np.random.Generator, dtype: np.dtype, n: int, op: str = "sum") -> np.ndarray:
    if dtype in FLOATS:
        x = rng.standard_normal(n) * (1.5 if op == "prod" else 100.0)
        return x.astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


def reference(a: np.ndarray, b: np.ndarray, op: str, div: int) -> np.ndarray:
    """float64-free reference: the op in the accumulation type (float32 for half types), one rounding."""
    fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    if a.dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        r = fn(a.astype(np.float32), b.astype(np.float32))
        if div != 1:
            r = r / np.float32(div)
        return r.astype(a.dtype)
    with np.errstate(over="ignore"):
        r = fn(a, b)
    if div != 1:
        r = (r / a.dtype.type(div)).astype(a.dtype)
    return r


def guarded(dtype: np.dtype, n: int, offset: int, fill: int = 0xA5, shift: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes, view of n elements starting ``offset`` elements (+ ``shift`` bytes) into it), guard bytes all
    around."""
    item = dtype.itemsize
    raw = np.full((n + offset + 64) * item + 64, fill, np.uint8)
    base = (-ptr(raw)) % 64 + shift  # a 64-byte aligned start, so offsets are what the test says
    view = raw[base + offset * item : base + (offset + n) * item].view(dtype)
    return raw, view


def check_guards(raw: np.ndarray, view: np.ndarray, fill: int = 0xA5) -> None:
    lo = ptr(view) - ptr(raw)
    hi = lo + view.nbytes
    assert (raw[:lo] == fill).all() and (raw[hi:] == fill).all(), "kernel wrote outside its output"


COUNTS = [0, 1, 2, 7, 15, 16, 17, 33, 127, 1000, 4099]
# (dst, a, b) element offsets from a 64-byte boundary: aligned, all shifted alike, mixed
OFFSETS = [(0, 0, 0), (1, 1, 1), (3, 3, 3), (0, 1, 0), (2, 0, 5)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_matches_numpy(lib, dtype):
    rng = np.random.default_rng(1234 + DTYPES.index(dtype))
    code = DTYPES.index(dtype)
    for op in OPS:
        for n in COUNTS:
            for offs in OFFSETS:
                divs = [1, 3] if dtype in FLOATS else [1]
                for div in divs:
                    for in_place in (False, True):
                        nthreads = int(rng.choice([16, 32, 96]))
                        a = random(rng, dtype, n, op)
                        b = random(rng, dtype, n, op)
                        want = reference(a, b, op, div)
                        raw_d, d = guarded(dtype, n, offs[0])
                        raw_b, bv = guarded(dtype, n, offs[2])
                        bv[...] = b
                        if in_place:
                            d[...] = a
                            av = d
                        else:
                            raw_a, av = guarded(dtype, n, offs[1])
                            av[...] = a
                        rc = lib.rc_host_reduce(
                            code, OPS.index(op), ptr(d), ptr(av), ptr(bv), n, int(div != 1), float(div), nthreads
                        )
                        assert rc == 0
                        where = f"{dtype} {op} n={n} offsets={offs} div={div} in_place={in_place}"
                        np.testing.assert_array_equal(bits(d), bits(want), err_msg=where)
                        check_guards(raw_d, d)
                        np.testing.assert_array_equal(bits(bv), bits(b), err_msg=f"b changed: {where}")
                        assert lib.rc_host_misaligned() == 0, f"misaligned vector access: {where}"


def test_reduce_nan_propagates(lib):
    for dtype in FLOATS:
        a = np.array([np.nan, 1, np.nan, -np.inf], dtype)
        b = np.array([2, np.nan, np.nan, 5], dtype)
        for op in ("min", "max", "sum"):
            d = np.zeros(4, dtype)
            lib.rc_host_reduce(DTYPES.index(dtype), OPS.index(op), ptr(d), ptr(a), ptr(b), 4, 0, 1.0, 16)
            assert np.isnan(d[:3].astype(np.float64)).all(), (dtype, op, d)


def test_copy_every_alignment(lib):
    rng = np.random.default_rng(7)
    for nbytes in (0, 1, 5, 15, 16, 17, 31, 64, 200, 4097, 20011):
        for do in range(0, 16, 3):
            for so in range(0, 16, 5):
                raw_d, d = guarded(np.dtype(np.uint8), nbytes, do)
                raw_s, s = guarded(np.dtype(np.uint8), nbytes, so, fill=0x3C)
                s[...] = rng.integers(0, 256, nbytes, dtype=np.uint8)
                lib.rc_host_copy(ptr(d), ptr(s), nbytes, int(rng.choice([16, 64])))
                np.testing.assert_array_equal(d, s, err_msg=f"nbytes={nbytes} dst+{do} src+{so}")
                check_guards(raw_d, d)
                assert lib.rc_host_misaligned() == 0, f"misaligned word access: nbytes={nbytes} dst+{do} src+{so}"


# ------------------------------------------------------------------ float32 accumulation (accumulate.cu)
ACC_COUNTS = [0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 33, 127, 1000, 4099]
# (dst, a, b) element offsets from a 64-byte boundary, and b's extra byte shift: the vector path needs the
# float32 pointers 16-byte aligned at the element where the half pointers are 8-byte aligned
ACC_OFFSETS = [
    (0, 0, 0, 0),
    (1, 1, 1, 0),
    (2, 2, 2, 0),
    (3, 3, 3, 0),
    (1, 5, 1, 0),
    (3, 7, 7, 0),
    (0, 1, 0, 0),
    (2, 0, 5, 0),
    (1, 1, 1, 2),
]  # the last: float32 at an address that is not a multiple of 4


def _host_acc(kind: str, dst: np.ndarray, a: np.ndarray, b: np.ndarray | None, op: str, div: int) -> None:
    from ringcomm.devices.host import HostDevice
    from ringcomm.ops import ReduceOp

    dev = HostDevice()
    with np.errstate(all="ignore"):
        if kind == "acc":
            dev.reduce_acc(dst, a, b, ReduceOp(op))
        elif kind == "final":
            dev.reduce_acc_final(dst, a, b, ReduceOp(op), div)
        else:
            dev.widen(dst, a)


@pytest.mark.parametrize("build", ["ieee", "cupy_options"])
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_accumulate_kernels_match_numpy_and_the_host_device(request, build, dtype):
    """reduce_acc / reduce_acc_final / widen: every op, div 1 and 3, in place and not, every alignment path,
    data full of special values (tests/accumulate_values.py); bit for bit against the numpy reference and
    HostDevice's methods of the same names, in both harness builds (accumulate.cu must not depend on CuPy's
    flags: it uses only common.cuh's PTX wrappers)."""
    so = request.getfixturevalue("lib" if build == "ieee" else "lib_cupy")
    code = DTYPES.index(dtype)
    f32 = np.dtype(np.float32)
    rng = np.random.default_rng(4242 + code)
    for op in OPS:
        for div in (1, 3):
            for n in ACC_COUNTS:
                for offs in ACC_OFFSETS:
                    for kind in ("acc", "final", "widen"):
                        if kind == "widen" and (op != "sum" or div != 1):
                            continue
                        for in_place in (False, True) if kind != "widen" else (False,):
                            nthreads = int(rng.choice([16, 32, 96]))
                            a = half_values(rng, dtype, n)
                            b = partial_values(rng, a, div) if kind != "widen" else None
                            want = acc_reference(kind, a, b, op, div)
                            out_dtype = dtype if kind == "final" else f32
                            raw_a, av = guarded(dtype, n, offs[1])
                            av[...] = a
                            if kind != "widen":
                                raw_b, bv = guarded(f32, n, offs[2], shift=offs[3])
                                bv[...] = b
                            if in_place:  # reduce_acc: dst is b; reduce_acc_final: dst is a
                                raw_d, d = (raw_b, bv) if kind == "acc" else (raw_a, av)
                            else:
                                raw_d, d = guarded(out_dtype, n, offs[0], shift=offs[3] if kind != "final" else 0)
                            bp = ptr(bv) if kind != "widen" else 0
                            if kind == "acc":
                                rc = so.rc_host_reduce_acc(code, OPS.index(op), ptr(d), ptr(av), bp, n, nthreads)
                            elif kind == "final":
                                rc = so.rc_host_reduce_acc_final(
                                    code, OPS.index(op), ptr(d), ptr(av), bp, n, int(div != 1), float(div), nthreads
                                )
                            else:
                                rc = so.rc_host_widen(code, ptr(d), ptr(av), n, nthreads)
                            assert rc == 0
                            where = f"{build}: {kind} {dtype} {op} n={n} offsets={offs} div={div} in_place={in_place}"
                            np.testing.assert_array_equal(bits(d), bits(want), err_msg=where)
                            check_guards(raw_d, d)
                            if not (in_place and kind == "final"):
                                np.testing.assert_array_equal(bits(av), bits(a), err_msg=f"a changed: {where}")
                            if kind != "widen" and not (in_place and kind == "acc"):
                                np.testing.assert_array_equal(bits(bv), bits(b), err_msg=f"b changed: {where}")
                            assert so.rc_host_misaligned() == 0, f"misaligned vector access: {where}"
                            # HostDevice: the same bits, from the inputs (again in place where the kernel was)
                            hb = b.copy() if b is not None else None
                            ha = a.copy()
                            if in_place:
                                hd = hb if kind == "acc" else ha
                            else:  # poison
                                hd = np.full(n * out_dtype.itemsize, 0x5A, np.uint8).view(out_dtype)
                            _host_acc(kind, hd, ha, hb, op, div)
                            np.testing.assert_array_equal(bits(hd), bits(want), err_msg=f"HostDevice, {where}")


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_accumulate_rounds_ties_to_even(lib, lib_cupy, dtype):
    """reduce_acc_final(SUM) of a = +-h_k and b = t - a, with t exactly halfway between the half values of
    bits k and k + 1 (every finite k, 65504 -> inf included) or one float32 ulp below or above: the kernels
    (both builds) and HostDevice give the even one of the two on the tie, k below, k + 1 above, checked
    against those integers (no float64, no numpy cast). With div = 3: b = 3t - a, (a + b) / 3 = t exactly."""
    top = 0x7C00 if dtype == F16 else 0x7F80
    k = np.arange(top, dtype=np.int64)
    if dtype == F16:
        m = midpoint_f16(k)
    else:
        m = ((k.astype(np.uint32) << np.uint32(16)) | np.uint32(0x8000)).view(np.float32)
    even = np.where(k % 2 == 0, k, k + 1)
    code = DTYPES.index(dtype)
    for sign in (1, -1):
        x = (k.astype(np.uint16) | np.uint16(0x8000 if sign < 0 else 0)).view(dtype)
        xf = x.astype(np.float32)
        sm = (np.float32(sign) * m).astype(np.float32)
        below, above = np.nextafter(sm, np.float32(0)), np.nextafter(sm, np.float32(sign * np.inf))
        cases = [(sm, 1, even), (below, 1, k), (above, 1, k + 1)]
        with np.errstate(over="ignore"):
            t3 = (np.float32(3) * sm).astype(np.float32)
        ok3 = np.isfinite(t3)
        cases.append((t3[ok3], 3, even[ok3]))
        for t, div, want_k in cases:
            xs, xfs = (x, xf) if div == 1 else (x[ok3], xf[ok3])
            b = (t - xfs).astype(np.float32)
            assert ((b.astype(np.float64) + xfs.astype(np.float64)) == t.astype(np.float64)).all()  # exact
            assert ((xfs + b) == t).all()
            want = want_k.astype(np.uint16) | np.uint16(0x8000 if sign < 0 else 0)
            where = f"{dtype} sign {sign} div {div}"
            for so in (lib, lib_cupy):
                d = np.empty(xs.size, dtype)
                assert (
                    so.rc_host_reduce_acc_final(
                        code, 0, ptr(d), ptr(xs), ptr(b), xs.size, int(div != 1), float(div), 64
                    )
                    == 0
                )
                np.testing.assert_array_equal(bits(d), want, err_msg=f"kernel: {where}")
            d = np.empty(xs.size, dtype)
            _host_acc("final", d, xs, b, "sum", div)
            np.testing.assert_array_equal(bits(d), want, err_msg=f"HostDevice: {where}")


def test_accumulate_nan_and_signed_zeros(lib):
    """The decisions the bits depend on, spelled out: every NaN is the positive quiet NaN of its type, MIN/MAX
    propagate NaN, and between +0 and -0 give a's (the first operand's) zero, widen is exact."""
    from ringcomm.devices.host import HostDevice
    from ringcomm.ops import ReduceOp

    dev = HostDevice()
    nans32 = _bits_f32(0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FC00001)
    for dtype in HALVES:
        code = DTYPES.index(dtype)
        hnan = [0x7E00, 0xFE00, 0x7C01, 0x7FFF] if dtype == F16 else [0x7FC0, 0xFFC0, 0x7F81, 0x7FFF]
        a = np.array(
            hnan + [0x3C00 if dtype == F16 else 0x3F80] * 5 + [0x0000, 0x8000, 0x0000, 0x8000], np.uint16
        ).view(dtype)
        b = np.concatenate([np.ones(4, np.float32), nans32, _bits_f32(0x80000000, 0x00000000, 0, 0x80000000)])
        n = a.size
        for op, zeros in (
            ("min", [0x0000, 0x8000, 0x0000, 0x8000]),
            ("max", [0x0000, 0x8000, 0x0000, 0x8000]),
            ("sum", [0x0000, 0x0000, 0x0000, 0x8000]),
            ("prod", [0x8000, 0x8000, 0x0000, 0x0000]),
        ):
            d32, h32 = np.empty(n, np.float32), np.empty(n, np.float32)
            dh, hh = np.empty(n, dtype), np.empty(n, dtype)
            lib.rc_host_reduce_acc(code, OPS.index(op), ptr(d32), ptr(a), ptr(b), n, 16)
            lib.rc_host_reduce_acc_final(code, OPS.index(op), ptr(dh), ptr(a), ptr(b), n, 0, 1.0, 16)
            with np.errstate(all="ignore"):
                dev.reduce_acc(h32, a, b, ReduceOp(op))
                dev.reduce_acc_final(hh, a, b, ReduceOp(op))
            for got32, goth, who in ((d32, dh, "kernel"), (h32, hh, "HostDevice")):
                assert (bits(got32)[:9] == 0x7FC00000).all(), (who, op, dtype, [hex(v) for v in bits(got32)])
                assert (bits(goth)[:9] == CANONICAL_NAN_BITS[dtype]).all(), (who, op, dtype)
                assert list(bits(goth)[9:]) == zeros, (who, op, dtype, [hex(v) for v in bits(goth)[9:]])
                assert list(bits(got32)[9:]) == [z << 16 for z in zeros], (who, op, dtype)
        w, hw = np.empty(n, np.float32), np.empty(n, np.float32)
        lib.rc_host_widen(code, ptr(w), ptr(a), n, 16)
        dev.widen(hw, a)
        for got in (w, hw):
            assert (bits(got)[:4] == 0x7FC00000).all()
            np.testing.assert_array_equal(bits(got)[4:], bits(a[4:].astype(np.float32)))
    every = np.arange(1 << 16, dtype=np.uint16)
    for dtype in HALVES:
        w, hw = np.empty(every.size, np.float32), np.empty(every.size, np.float32)
        lib.rc_host_widen(DTYPES.index(dtype), ptr(w), ptr(every), every.size, 64)
        dev.widen(hw, every.view(dtype))
        want = acc_reference("widen", every.view(dtype), None)
        np.testing.assert_array_equal(bits(w), bits(want))
        np.testing.assert_array_equal(bits(hw), bits(want))


def _bits_f32(*u: int) -> np.ndarray:
    return np.array(u, np.uint32).view(np.float32)


def test_host_device_accumulate_validates():
    from ringcomm.devices.host import HostDevice
    from ringcomm.ops import ReduceOp

    dev = HostDevice()
    h, f = np.ones(4, np.float16), np.ones(4, np.float32)
    with pytest.raises(ValueError, match="lengths differ"):
        dev.reduce_acc(f, h, f[:3], ReduceOp.SUM)
    with pytest.raises(ValueError, match="lengths differ"):
        dev.widen(f, h[:3])
    with pytest.raises(TypeError, match="float16, bfloat16"):
        dev.reduce_acc(f, f, f, ReduceOp.SUM)
    with pytest.raises(TypeError, match="float32"):
        dev.reduce_acc(f, h, h, ReduceOp.SUM)
    with pytest.raises(TypeError, match="dst"):
        dev.reduce_acc_final(h.astype(ml_dtypes.bfloat16), h, f, ReduceOp.SUM)
    with pytest.raises(TypeError, match="dst"):
        dev.widen(h, h)
    e16, e32 = np.empty(0, np.float16), np.empty(0, np.float32)
    dev.reduce_acc(e32, e16, e32, ReduceOp.MIN)
    dev.reduce_acc_final(e16, e16, e32, ReduceOp.AVG, 3)
    dev.widen(e32, e16)


def _convert(lib, kind: int, src: np.ndarray, out_dtype: Any) -> np.ndarray:
    src = np.ascontiguousarray(src)
    out = np.empty(src.size, out_dtype)
    lib.rc_host_convert(kind, ptr(src), ptr(out), src.size)
    return out


def test_half_conversions_match_numpy(lib):
    every = np.arange(1 << 16, dtype=np.uint16)
    f = _convert(lib, 1, every, np.float32)
    np.testing.assert_array_equal(f, every.view(np.float16).astype(np.float32))  # NaNs compare equal here
    rng = np.random.default_rng(3)
    with np.errstate(invalid="ignore"):
        between = every.view(np.float16).astype(np.float32) * np.float32(1.0004883)
    x = np.concatenate(
        [
            every.view(np.float16).astype(np.float32),  # exact values
            between,  # between neighbours, ties
            rng.standard_normal(100000).astype(np.float32) * np.float32(1e-5),  # subnormal range
            rng.standard_normal(100000).astype(np.float32) * np.float32(3e4),  # overflow boundary
            np.array(
                [65504, 65519.996, 65520, 65536, 2.0**-25, 2.0**-24, 1.5 * 2.0**-24, 2.0**-14, np.inf, -np.inf],
                np.float32,
            ),
        ]
    )
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    np.testing.assert_array_equal(_convert(lib, 0, x, np.uint16), bits(want))


def test_bfloat16_conversions_match_ml_dtypes(lib):
    every = np.arange(1 << 16, dtype=np.uint16)
    finite = ~np.isnan(every.view(ml_dtypes.bfloat16).astype(np.float32))
    f = _convert(lib, 3, every, np.float32)
    np.testing.assert_array_equal(f[finite], every.view(ml_dtypes.bfloat16).astype(np.float32)[finite])
    rng = np.random.default_rng(4)
    x = np.concatenate(
        [
            (rng.standard_normal(200000) * 10.0 ** rng.integers(-40, 38, 200000)).astype(np.float32),
            (every[finite].view(ml_dtypes.bfloat16).astype(np.float32) * np.float32(1.00390625)),  # ties
        ]
    )
    x = x[np.isfinite(x)]
    np.testing.assert_array_equal(_convert(lib, 2, x, np.uint16), bits(x.astype(ml_dtypes.bfloat16)))


def _f64_to_bf16_exact(x: np.ndarray) -> np.ndarray:
    """Correctly rounded float64 -> bfloat16 (RNE) for values in bfloat16's normal range."""
    b = x.view(np.uint64)
    r = b + np.uint64((1 << 44) - 1) + ((b >> np.uint64(45)) & np.uint64(1))
    sign = (r >> np.uint64(48)) & np.uint64(0x8000)
    exp = ((r >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64) - 1023 + 127
    man = (r >> np.uint64(45)) & np.uint64(0x7F)
    return (sign | (exp.astype(np.uint64) << np.uint64(7)) | man).astype(np.uint16)


def test_double_rounding_free_casts(lib):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(300000) * 10.0 ** rng.integers(-9, 5, 300000)
    # values just off a float16 tie: a double rounding through float32 would get these wrong
    halves = np.arange(0x0400, 0x7BFF, dtype=np.uint16).view(np.float16).astype(np.float64)
    ulp = np.spacing(halves.astype(np.float16)).astype(np.float64)
    x = np.concatenate([x, halves + ulp / 2 + 2.0**-40 * halves, halves + ulp / 2 - 2.0**-40 * halves])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(_convert(lib, 4, x, np.uint16), bits(x.astype(np.float16)))
    y = rng.standard_normal(300000) * 10.0 ** rng.integers(-30, 30, 300000)
    bfs = np.arange(0x0080, 0x7F7F, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    y = np.concatenate([y, bfs * (1 + 2.0**-8 + 2.0**-45), bfs * (1 + 2.0**-8 - 2.0**-45)])
    np.testing.assert_array_equal(_convert(lib, 5, y, np.uint16), _f64_to_bf16_exact(y))


def adam_reference(p, g, m, v, lr, b1, b2, eps, wd, step, scale):
    p, g, m, v = (np.asarray(a, np.float64) for a in (p, g.astype(np.float64), m, v))
    g = g * scale
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat, vhat = m / (1 - b1**step), v / (1 - b2**step)
    p = p * (1 - lr * wd)
    p = p - lr * mhat / (np.sqrt(vhat) + eps)
    return p, m, v


@pytest.mark.parametrize("pdt", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_fused_adam_matches_reference(lib, pdt):
    rng = np.random.default_rng(11)
    for gdt in FLOATS:
        for odt in [None] + FLOATS:
            for n in (0, 1, 37, 3001):
                p0 = rng.standard_normal(n).astype(pdt)
                g = (rng.standard_normal(n) * 0.1).astype(gdt)
                m0 = (rng.standard_normal(n) * 0.01).astype(pdt)
                v0 = np.abs(rng.standard_normal(n) * 0.001).astype(pdt)
                lr, b1, b2, eps, wd, step, scale = 1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.5
                p, m, v = p0.copy(), m0.copy(), v0.copy()
                raw_o, out = guarded(odt or np.dtype(np.uint8), n, 1)
                s = np.array([lr, b1, b2, eps, 1 - lr * wd, 1 - b1**step, 1 - b2**step, scale], np.float64)
                rc = lib.rc_host_adam(
                    DTYPES.index(pdt),
                    DTYPES.index(gdt),
                    -1 if odt is None else DTYPES.index(odt),
                    ptr(p),
                    ptr(g),
                    ptr(m),
                    ptr(v),
                    ptr(out) if odt is not None else 0,
                    n,
                    ptr(s),
                    int(rng.choice([16, 64])),
                )
                assert rc == 0
                rp, rm, rv = adam_reference(p0, g, m0, v0, lr, b1, b2, eps, wd, step, scale)
                u = 2.0**-24 if pdt == np.float32 else 2.0**-53  # unit roundoff; atol: a few ulps of the inputs
                where = f"master {pdt} grad {gdt} out {odt} n={n}"
                np.testing.assert_allclose(p, rp, rtol=64 * u, atol=16 * u, err_msg=where)
                np.testing.assert_allclose(m, rm, rtol=64 * u, atol=16 * u * 0.1, err_msg=where)
                np.testing.assert_allclose(v, rv, rtol=64 * u, atol=16 * u * 1e-3, err_msg=where)
                if odt is None:
                    assert (raw_o == 0xA5).all()
                    continue
                check_guards(raw_o, out)
                if odt == np.dtype(ml_dtypes.bfloat16) and pdt == np.float64:
                    want = _f64_to_bf16_exact(p) if n else np.empty(0, np.uint16)
                else:
                    want = bits(p.astype(odt))
                np.testing.assert_array_equal(bits(out), want, err_msg=where)


# ------------------------------------------------------------- fused Adam under CuPy's NVRTC options
def test_cupy_options_model_flushes_and_fuses(lib, lib_cupy):
    """The model is not vacuous: plain float code flushes and fuses under it, and is IEEE otherwise."""
    assert lib.rc_host_cupy_options() == 0 and lib_cupy.rc_host_cupy_options() == 1
    a, b, tiny = 1 + 2.0**-12, 1 + 2.0**-27, 2.0**-140  # a*a = 1 + 2^-11 + 2^-24: its float rounding drops 2^-24
    cases = [  # (probe, x, y, z, IEEE, under -ftz=true -fmad=true)
        (0, a, a, -(1 + 2.0**-11), 0.0, 2.0**-24),  # x*y + z fused into one fma
        (1, 2.0**-70, 2.0**-70, 0, 2.0**-140, 0.0),  # subnormal result flushed
        (1, tiny, 1, 0, tiny, 0.0),  # subnormal input flushed
        (2, tiny, 1, 0, tiny, 0.0),
        (3, tiny, 0, 0, 2.0**-70, 0.0),  # sqrtf
        (4, tiny, 0, 0, tiny, 0.0),  # (float)double
        (5, tiny, 0, 0, tiny, 0.0),  # (double)float
        (6, b, b, -(1 + 2.0**-26), 0.0, 2.0**-54),  # double x*y + z fused too
        (7, 2.0**-540, 2.0**-540, 0, 2.0**-1080, 2.0**-1080),  # no flush-to-zero for double
    ]
    for op, x, y, z, ieee, cupy in cases:
        assert lib.rc_host_probe(op, x, y, z) == ieee, (op, x, y, z)
        assert lib_cupy.rc_host_probe(op, x, y, z) == cupy, (op, x, y, z)


def _with_tiny(rng: np.random.Generator, x: np.ndarray, lo: float = -149.0, hi: float = -118.0) -> np.ndarray:
    """x with about a third of its elements replaced by +-2^e, e uniform in [lo, hi): float32's subnormals
    and the normals just above them (float32 and bfloat16 subnormals, intermediates that underflow)."""
    pick = rng.random(x.size) < 1 / 3
    tiny = np.where(rng.random(x.size) < 0.5, -1.0, 1.0) * 2.0 ** rng.uniform(lo, hi, x.size)
    return np.where(pick, tiny, x)


@pytest.mark.parametrize("build", ["ieee", "cupy_options"])
@pytest.mark.parametrize("pdt", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_fused_adam_bitwise_equals_host_adam(request, build, pdt):
    """csrc/optimizer.cu and ringcomm.zero.adam.adam_update agree bit for bit, also with optimizer.cu's
    float and double as CuPy's options make them on the GPU (flush-to-zero, FMA contraction), on data
    full of float32 subnormals and of sums whose FMA contraction would round differently."""
    from ringcomm.zero.adam import adam_update

    so = request.getfixturevalue("lib" if build == "ieee" else "lib_cupy")
    rng = np.random.default_rng(29 + (pdt == np.float64))
    n = 3001
    lr, b1, b2, eps = 3e-3, 0.9, 0.999, 1e-8
    subnormal_results = 0
    for gdt in FLOATS:
        for odt in [None] + FLOATS:
            p0 = _with_tiny(rng, rng.standard_normal(n)).astype(pdt)
            m0 = _with_tiny(rng, rng.standard_normal(n) * 1e-2).astype(pdt)
            v0 = np.abs(_with_tiny(rng, rng.standard_normal(n) * 1e-3)).astype(pdt)
            v0[rng.random(n) < 0.05] = 0
            kernel, host = [p0.copy(), m0.copy(), v0.copy()], [p0.copy(), m0.copy(), v0.copy()]
            for step, (wd, scale) in enumerate([(0.0, 1.0), (0.05, 0.37), (0.1, 1.0 / 3.0)], start=1):
                g = _with_tiny(rng, rng.standard_normal(n) * 0.1).astype(gdt)
                raw_o, out_k = guarded(odt or np.dtype(np.uint8), n, 1)
                out_h = np.empty(n, odt) if odt is not None else None
                s = np.array([lr, b1, b2, eps, 1.0 - lr * wd, 1.0 - b1**step, 1.0 - b2**step, scale], np.float64)
                rc = so.rc_host_adam(
                    DTYPES.index(pdt),
                    DTYPES.index(gdt),
                    -1 if odt is None else DTYPES.index(odt),
                    ptr(kernel[0]),
                    ptr(g),
                    ptr(kernel[1]),
                    ptr(kernel[2]),
                    ptr(out_k) if odt is not None else 0,
                    n,
                    ptr(s),
                    int(rng.choice([16, 64])),
                )
                assert rc == 0
                with np.errstate(over="ignore"):  # out float16 may overflow to inf where v is 0
                    adam_update(
                        host[0],
                        g,
                        host[1],
                        host[2],
                        lr=lr,
                        beta1=b1,
                        beta2=b2,
                        eps=eps,
                        weight_decay=wd,
                        step=step,
                        grad_scale=scale,
                        out=out_h,
                    )
                where = f"{build} build: master {pdt} grad {gdt} out {odt} step {step}"
                for name, k, h in zip(("master", "exp_avg", "exp_avg_sq"), kernel, host):
                    np.testing.assert_array_equal(bits(k), bits(h), err_msg=f"{name}, {where}")
                if odt is None:
                    assert (raw_o == 0xA5).all()
                else:
                    check_guards(raw_o, out_k)
                    np.testing.assert_array_equal(bits(out_k), bits(out_h), err_msg=f"out, {where}")
                f32 = host[0].astype(np.float32) if pdt == np.float64 else host[0]
                subnormal_results += int(((f32 != 0) & (np.abs(f32) < np.finfo(np.float32).tiny)).sum())
    assert subnormal_results > 1000  # the data reach float32's subnormal range, where -ftz=true would flush
