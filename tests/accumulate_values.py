"""Test data and the reference for the float32-accumulation methods (``reduce_acc``, ``reduce_acc_final``,
``widen``; csrc/accumulate.cu, ringcomm/devices/host.py), shared by tests/test_csrc_host.py and
tests/gpu/test_cuda_kernels.py.

The data are full of what tends to go wrong: subnormals of the half type and of float32, +-0 (and MIN/MAX
between +0 and -0), +-inf, NaNs of every kind (quiet, signalling, either sign, odd payloads), values that
overflow the half type when rounded (or float32 when added), sums that fall exactly halfway between two
half values (ties, with and without the division by 3), and ordinary values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
HALVES = (F16, BF16)
#: the NaN every float32-accumulation result is written as: float32 0x7fc00000 (and its casts)
CANONICAL_NAN = np.uint32(0x7FC00000).view(np.float32)
CANONICAL_NAN_BITS = {F16: 0x7E00, BF16: 0x7FC0, np.dtype(np.float32): 0x7FC00000}


def _bits32(*u: int) -> np.ndarray:
    return np.array(u, np.uint32).view(np.float32)


def half_values(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    """n elements of the half type ``dtype``: a third special bit patterns, the rest ordinary values."""
    dtype = np.dtype(dtype)
    if dtype == F16:
        ordinary = (rng.standard_normal(n) * 100.0).astype(np.float16)
        special = [
            0x0000,
            0x8000,
            0x0001,
            0x8001,
            0x03FF,
            0x0200,
            0x0400,
            0x7BFF,
            0xFBFF,
            0x7C00,
            0xFC00,
            0x7E00,
            0xFE00,
            0x7C01,
            0x7FFF,
            0xFD55,
            0x3C00,
        ]
        sub = rng.integers(1, 0x400, n, dtype=np.uint16)  # subnormals
    else:
        ordinary = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(BF16)
        special = [
            0x0000,
            0x8000,
            0x0001,
            0x8001,
            0x007F,
            0x0040,
            0x0080,
            0x7F7F,
            0xFF7F,
            0x7F80,
            0xFF80,
            0x7FC0,
            0xFFC0,
            0x7F81,
            0x7FFF,
            0xFFA5,
            0x3F80,
        ]
        sub = rng.integers(1, 0x80, n, dtype=np.uint16)
    bits = ordinary.view(np.uint16).copy()
    pick = rng.random(n)
    bits = np.where(pick < 0.2, rng.choice(np.array(special, np.uint16), n), bits)
    bits = np.where((pick >= 0.2) & (pick < 0.3), sub | (rng.integers(0, 2, n, dtype=np.uint16) << 15), bits)
    return bits.astype(np.uint16).view(dtype)


def partial_values(rng: np.random.Generator, a: np.ndarray, div: int = 1) -> np.ndarray:
    """float32 partial sums to meet the half-type data ``a``: specials, float32 subnormals, values near the
    half type's overflow, and ties (a + b, or (a + b) / div, exactly halfway between two half values)."""
    n = a.size
    x = a.astype(np.float32)
    b = (rng.standard_normal(n) * 100.0).astype(np.float32)
    if a.dtype == BF16:
        b = (b * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    pick = rng.random(n)
    specials = _bits32(
        0x00000000,
        0x80000000,
        0x00000001,
        0x807FFFFF,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0xFFFFFFFF,
        0x7FBFFFFF,
        0x7F7FFFFF,
        0xFF7FFFFF,
    )
    b = np.where(pick < 0.1, rng.choice(specials, n), b)
    tiny = (rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-149, -120, n)).astype(np.float32)
    b = np.where((pick >= 0.1) & (pick < 0.2), tiny, b)  # float32 subnormals and just above
    near_max = 65504.0 if a.dtype == F16 else 3.3e38
    big = (rng.choice([-1.0, 1.0], n) * near_max * rng.uniform(0.999, 1.001, n)).astype(np.float32)
    b = np.where((pick >= 0.2) & (pick < 0.3), big, b)
    if a.dtype == F16:  # half subnormal range: rounding to float16 subnormals
        small = (rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-26, -13, n)).astype(np.float32)
        b = np.where((pick >= 0.3) & (pick < 0.35), small, b)
    # ties: a random value m halfway between two neighbouring half values, b = div * m - a (exact: kept only
    # where float32 holds it exactly and a + b is exactly div * m)
    m = tie_points(rng, a.dtype, n)
    with np.errstate(all="ignore"):
        want = (np.float64(div) * m.astype(np.float64)).astype(np.float32)
        bt = (want.astype(np.float64) - x.astype(np.float64)).astype(np.float32)
        exact = (
            np.isfinite(x)
            & np.isfinite(want)
            & (bt.astype(np.float64) == want.astype(np.float64) - x.astype(np.float64))
            & ((x + bt) == want)
            & (want.astype(np.float64) == np.float64(div) * m.astype(np.float64))
        )
    b = np.where((pick >= 0.35) & (pick < 0.6) & exact, bt, b)
    return b.astype(np.float32)


def tie_points(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    """n float32 values, each exactly halfway between two neighbouring values of the half type (either sign)."""
    dtype = np.dtype(dtype)
    if dtype == F16:
        k = rng.integers(0, 0x7C00, n)  # lower neighbour's bits, 65504 (k = 0x7bff: the tie goes to inf) included
        m = midpoint_f16(k)
    else:
        k = rng.integers(0, 0x7F80, n)
        m = ((k.astype(np.uint32) << np.uint32(16)) | np.uint32(0x8000)).view(np.float32)
    return np.where(rng.random(n) < 0.5, -m, m).astype(np.float32)


def midpoint_f16(k: np.ndarray) -> np.ndarray:
    """float32 halfway between the float16 values of bits k and k + 1 (0 <= k < 0x7c00), built exactly."""
    k = np.asarray(k, np.int64)
    normal = k.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32) + np.uint32(0x1000)
    sub = np.float32(2.0**-25) * (2 * k + 1).astype(np.float32)  # (k + 1/2) * 2^-24, exact
    return np.where(k >= 0x400, normal.view(np.float32), sub).astype(np.float32)


def reference(kind: str, a: np.ndarray, b: np.ndarray | None, op: str = "sum", div: int = 1) -> np.ndarray:
    """What the kernels compute, spelled out in numpy float32 (no float64): kind "acc" (float32),
    "final" (rounded to a's dtype by numpy's / ml_dtypes' cast: to nearest even) or "widen"."""
    x = a.astype(np.float32)
    with np.errstate(all="ignore"):
        if kind == "widen":
            r = x
        elif op in ("sum", "avg"):
            r = x + b
        elif op == "prod":
            r = x * b
        elif op == "min":  # NaN in either gives NaN; between equal operands (+0, -0) the first
            r = np.where((x <= b) | np.isnan(x), x, b)
        elif op == "max":
            r = np.where((x >= b) | np.isnan(x), x, b)
        else:
            raise ValueError(op)
        if kind == "final" and div != 1:
            r = r / np.float32(div)
        r = np.where(np.isnan(r), CANONICAL_NAN, r).astype(np.float32)
        return r.astype(a.dtype) if kind == "final" else r
