"""Test data for result checking: exactly representable inputs, independent expected results.

Every rank's input is a pure function of (seed, rank, global element index): a hash of the three
picks an entry of a small *value table* (small integers, see :func:`value_table`) chosen per dtype,
op and rank count so that every partial result of the reduction is exactly representable. Any rank
can therefore compute what any other rank contributed, and the expected result is computed here
with numpy in a wide type (float64 / int64 / uint64), never by the implementation under test.
Results are compared exactly, except ``avg`` (a division), which is allowed one unit in the last
place of the dtype.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any

import ml_dtypes
import numpy as np

from ..ops import FLOAT_DTYPES, ReduceOp, bfloat16

#: Elements processed per block when generating data (keeps the temporaries in cache).
BLOCK = 1 << 18

#: nccl-tests' type names (what the table prints) and the dtypes they stand for.
TYPE_NAMES: dict[str, np.dtype] = {
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64),
    "uint64": np.dtype(np.uint64),
    "half": np.dtype(np.float16),
    "float": np.dtype(np.float32),
    "double": np.dtype(np.float64),
    "bfloat16": bfloat16,
}
_ALIASES = {
    "float16": "half",
    "fp16": "half",
    "float32": "float",
    "fp32": "float",
    "float64": "double",
    "fp64": "double",
    "bf16": "bfloat16",
}

_GOLDEN, _F1, _F2 = np.uint32(0x9E3779B1), np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def parse_dtype(name: str) -> np.dtype:
    """The dtype for a type name: nccl-tests' (float, half, double, bfloat16, int8, ...) or numpy's
    (float32, float16, ...); ValueError listing the accepted names otherwise."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in TYPE_NAMES:
        accepted = ", ".join(list(TYPE_NAMES) + list(_ALIASES))
        raise ValueError(f"unknown data type {name!r}; accepted: {accepted}")
    return TYPE_NAMES[key]


def type_name(dtype: np.dtype) -> str:
    """nccl-tests' name of ``dtype`` ("float" for float32, "half" for float16, ...)."""
    dtype = np.dtype(dtype)
    for name, dt in TYPE_NAMES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no benchmark type name")


def is_float(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one of the floating types (bfloat16 included)."""
    return np.dtype(dtype) in FLOAT_DTYPES


def wide_dtype(dtype: np.dtype) -> np.dtype:
    """The type expected results are computed in: float64, int64 or uint64."""
    dtype = np.dtype(dtype)
    if is_float(dtype):
        return np.dtype(np.float64)
    return np.dtype(np.uint64 if dtype.kind == "u" else np.int64)


def _finfo(dtype: np.dtype) -> Any:
    return ml_dtypes.finfo(dtype) if np.dtype(dtype) == bfloat16 else np.finfo(dtype)


def exact_limit(dtype: np.dtype) -> int:
    """The largest magnitude up to which every integer is exactly representable in ``dtype``, and
    which no result reaches (so the integer poison value, the dtype's maximum, is never valid)."""
    dtype = np.dtype(dtype)
    if is_float(dtype):
        return 2 ** (_finfo(dtype).nmant + 1)
    return int(np.iinfo(dtype).max) - 1


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def value_table(dtype: np.dtype, op: ReduceOp | None, nranks: int, rank: int) -> np.ndarray:
    """The values rank ``rank`` draws its inputs from (a power-of-two number of them, in ``dtype``).

    - sum, avg: integers in [-H, H) (unsigned: [0, H)) with N·H within :func:`exact_limit`, so every
      partial sum is exact (H at most 2^15).
    - prod: ±1 and ±2 (unsigned: 1 and 2) on the first P ranks and ±1 (unsigned: 1) on the others,
      P = log2 of the dtype's largest value (at most 62), so every partial product is an exact power
      of two in range.
    - min, max and no op (all_gather, broadcast): integers in [-H, H) (unsigned: [0, H)), H at most
      2^15 and within :func:`exact_limit`.
    """
    dtype = np.dtype(dtype)
    unsigned = dtype.kind == "u"
    limit = exact_limit(dtype)
    if op is ReduceOp.PROD:
        top = _finfo(dtype).max if is_float(dtype) else np.iinfo(dtype).max
        twos = rank < min(62, int(math.floor(math.log2(float(top)))))
        values = ([1, 2] if twos else [1]) if unsigned else ([1, -1, 2, -2] if twos else [1, -1])
        return np.array(values, dtype=np.int64).astype(dtype)
    h = min(1 << 15, _pow2_floor(limit // nranks if op in (ReduceOp.SUM, ReduceOp.AVG) else limit))
    lo = 0 if unsigned else -h
    return np.arange(lo, lo + (h if unsigned else 2 * h), dtype=np.int64).astype(dtype)


def derive_seed(*parts: Any) -> int:
    """A 32-bit seed from any printable parts (the same on every rank and every run)."""
    return zlib.crc32(repr(parts).encode())


def rank_values(table: np.ndarray, seed: int, rank: int, start: int, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` (host array) with rank ``rank``'s inputs at global indices [start, start + out.size).

    ``out[i] = table[h(seed, rank, start + i) % table.size]`` with ``h`` murmur3's 32-bit finaliser of
    the golden-ratio-scrambled index xor a key of (seed, rank, index // 2^32). ``out`` may have any
    dtype the table casts to. Returns ``out``.
    """
    if table.size & (table.size - 1):
        raise ValueError(f"value table size must be a power of two; got {table.size}")
    mask = np.uint32(table.size - 1)
    table = table.astype(out.dtype, copy=False)
    tmp = np.empty(min(BLOCK, out.size), np.uint32)
    lo = 0
    while lo < out.size:
        g = start + lo  # global index of the block's first element; blocks never cross a 2^32 boundary
        hi = min(out.size, lo + BLOCK, lo + (1 << 32) - (g & 0xFFFFFFFF))
        key = np.uint32(derive_seed(seed, rank, g >> 32))
        z = np.arange(g & 0xFFFFFFFF, (g & 0xFFFFFFFF) + hi - lo, dtype=np.uint32)
        t = tmp[: hi - lo]
        z *= _GOLDEN
        z ^= key
        np.right_shift(z, np.uint32(16), out=t)
        z ^= t
        z *= _F1
        np.right_shift(z, np.uint32(13), out=t)
        z ^= t
        z *= _F2
        np.right_shift(z, np.uint32(16), out=t)
        z ^= t
        z &= mask
        np.take(table, z, out=out[lo:hi])
        lo = hi
    return out


@dataclasses.dataclass(frozen=True)
class Case:
    """One row's collective call: what every rank passes, and this rank's place in it.

    ``count``: elements of the full buffer (see :mod:`ringcomm.bench.sizes`); ``bounds``: every rank's
    shard, as ``Communicator.shard_bounds(count)`` gives it; ``root``: -1 for unrooted collectives;
    ``op``: None for all_gather and broadcast.
    """

    collective: str
    count: int
    dtype: np.dtype
    op: ReduceOp | None
    root: int
    nranks: int
    rank: int
    bounds: tuple[tuple[int, int], ...]

    @property
    def shard(self) -> tuple[int, int]:
        """This rank's (start, stop)."""
        return self.bounds[self.rank]

    @property
    def nbytes(self) -> int:
        """Bytes of the full buffer (the size column of the table)."""
        return self.count * self.dtype.itemsize

    def table(self, rank: int) -> np.ndarray:
        """:func:`value_table` of ``rank`` for this case."""
        return value_table(self.dtype, self.op, self.nranks, rank)

    def input_range(self, rank: int | None = None) -> tuple[int, int]:
        """The global indices a rank contributes: its shard for all_gather, everything otherwise."""
        r = self.rank if rank is None else rank
        return self.bounds[r] if self.collective == "all_gather" else (0, self.count)


def input_data(case: Case, seed: int, out: np.ndarray | None = None) -> np.ndarray:
    """This rank's input for ``case``: a host array of ``case.dtype`` over :meth:`Case.input_range`
    (written into ``out`` when given)."""
    lo, hi = case.input_range()
    out = np.empty(hi - lo, case.dtype) if out is None else _check_out(out, hi - lo, case.dtype)
    return rank_values(case.table(case.rank), seed, case.rank, lo, out)


#: The numpy ufunc that combines two contributions under each op (avg: add, then divide once).
COMBINE = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def expected_dtype(case: Case) -> np.dtype:
    """The dtype of :func:`expected_result`: float64 for avg, ``case.dtype`` otherwise."""
    return np.dtype(np.float64) if case.op is ReduceOp.AVG else case.dtype


def _reduced(case: Case, seed: int, lo: int, out: np.ndarray) -> np.ndarray:
    """The reduction over all ranks of elements [lo, lo + out.size), computed block by block in the
    wide type (avg divided) and stored into ``out``."""
    wide = wide_dtype(case.dtype)
    acc = np.empty(min(BLOCK, out.size), wide)
    part = np.empty_like(acc)
    tables = [case.table(r).astype(wide) for r in range(case.nranks)]
    combine = COMBINE[case.op]
    for a in range(0, out.size, BLOCK):
        b = min(out.size, a + BLOCK)
        acc_b, part_b = acc[: b - a], part[: b - a]
        rank_values(tables[0], seed, 0, lo + a, acc_b)
        for r in range(1, case.nranks):
            combine(acc_b, rank_values(tables[r], seed, r, lo + a, part_b), out=acc_b)
        if case.op is ReduceOp.AVG:
            acc_b /= case.nranks
        out[a:b] = acc_b
    return out


def expected_result(case: Case, seed: int, out: np.ndarray | None = None) -> np.ndarray:
    """What this rank must hold after ``case`` ran on inputs :func:`input_data` (same ``seed``).

    all_reduce: the full reduction; reduce_scatter: its shard of it; all_gather: every rank's shard
    of its own input, concatenated; broadcast: the root's input; reduce: the reduction at the root,
    the rank's own unchanged input elsewhere. A host array of :func:`expected_dtype` (written into
    ``out`` when given); exact by construction of the value tables.
    """
    c, r = case.collective, case.rank
    lo, hi = case.shard if c == "reduce_scatter" else (0, case.count)
    out = np.empty(hi - lo, expected_dtype(case)) if out is None else _check_out(out, hi - lo, expected_dtype(case))
    if c == "all_reduce" or c == "reduce_scatter" or (c == "reduce" and r == case.root):
        return _reduced(case, seed, lo, out)
    if c == "all_gather":
        for q, (a, b) in enumerate(case.bounds):
            rank_values(case.table(q), seed, q, a, out[a:b])
        return out
    if c == "broadcast":
        return rank_values(case.table(case.root), seed, case.root, 0, out)
    if c == "reduce":
        return rank_values(case.table(r), seed, r, 0, out)
    raise ValueError(f"unknown collective {c!r}")


def _check_out(out: np.ndarray, size: int, dtype: np.dtype) -> np.ndarray:
    if out.size != size or out.dtype != dtype:
        raise ValueError(f"out must have {size} elements of {dtype}; got {out.size} of {out.dtype}")
    return out


def count_wrong(got: np.ndarray, expected: np.ndarray, dtype: np.dtype, op: ReduceOp | None) -> int:
    """How many elements of ``got`` (host array of ``dtype``) differ from ``expected``.

    Exact comparison (a NaN is always wrong), except for ``avg`` where |got - expected| may be up to
    the dtype's epsilon times |expected| (one unit in the last place: the division may round
    differently from float64's).
    """
    if got.shape != expected.shape:
        raise ValueError(f"result has {got.size} elements, expected {expected.size}")
    wrong = 0
    eps = _finfo(dtype).eps if op is ReduceOp.AVG else 0.0
    for a in range(0, got.size, BLOCK):
        g, e = got[a : a + BLOCK], expected[a : a + BLOCK]
        if op is ReduceOp.AVG:
            e = e.astype(np.float64)
            ok = np.abs(g.astype(np.float64) - e) <= float(eps) * np.abs(e)
            wrong += int(ok.size - np.count_nonzero(ok))
        else:
            wrong += int(np.count_nonzero(g != e))
    return wrong


def poison_value(dtype: np.dtype) -> Any:
    """A value no correct result holds: NaN for floats, the dtype's maximum for integers."""
    dtype = np.dtype(dtype)
    return np.array(np.nan).astype(dtype)[()] if is_float(dtype) else np.iinfo(dtype).max


def plant_indices(size: int, n: int) -> np.ndarray:
    """min(n, size) distinct indices spread evenly over [0, size) (for planted corruption)."""
    k = max(0, min(n, size))
    if k == 0:
        return np.zeros(0, np.int64)
    return np.floor(np.linspace(0, size - 1, k)).astype(np.int64)
