"""Reduction operators and the dtypes each one accepts."""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: Element types the collectives accept, host and GPU alike.
FLOAT_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))
INT_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)
)
SUPPORTED_DTYPES: tuple[np.dtype, ...] = FLOAT_DTYPES + INT_DTYPES
HALF_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float16), bfloat16)


class ReduceOp(str, enum.Enum):
    """Reduction operator; the lower-case strings ("sum", ...) are accepted wherever an op is."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    def __str__(self) -> str:
        return self.value


#: ReduceOp.SUM and ReduceOp.AVG as module names, for the per-call paths: an enum member looked up
#: on its class costs about 75 ns in CPython 3.11, a module global a few
SUM, AVG = ReduceOp.SUM, ReduceOp.AVG

#: the numpy ufunc that combines two arrays for each op (AVG adds; the division comes last)
UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}

#: every ReduceOp by itself and by its lower-case name
OPS = {**{o.value: o for o in ReduceOp}, **{o: o for o in ReduceOp}}
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_INTS = frozenset(INT_DTYPES)


def parse_op(op: ReduceOp | str) -> ReduceOp:
    """Return the ReduceOp for ``op`` (a ReduceOp or its name, any case); ValueError otherwise."""
    found = OPS.get(op) if isinstance(op, str) else None
    if found is None and isinstance(op, str):
        found = OPS.get(op.lower())
    if found is not None:
        return found
    raise ValueError(f"unsupported op {op!r}; accepted: {', '.join(o.value for o in ReduceOp)} (or ringcomm.ReduceOp)")


def check_dtype(dtype: np.dtype, op: ReduceOp | None = None) -> np.dtype:
    """Raise TypeError unless ``dtype`` is supported (and, given ``op``, makes sense with it)."""
    if dtype not in _SUPPORTED:  # a dtype object is looked up as it is; anything else converted first
        dtype = np.dtype(dtype)
        if dtype not in _SUPPORTED:
            names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise TypeError(f"unsupported dtype {dtype}; accepted: {names}")
    if op is AVG and dtype in _INTS:
        raise TypeError(f"op 'avg' on integer dtype {dtype} would silently floor; use 'sum' and divide yourself")
    return dtype


#: the values ``accumulate=`` accepts (besides None): the type partial sums of half types travel in
ACCUMULATE = ("float32",)


def parse_accumulate(value: str | None) -> str | None:
    """``accumulate=`` checked: None (or "none"/"" from the environment) or "float32"; ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    if isinstance(value, str) and value.strip().lower() in ACCUMULATE:
        return value.strip().lower()
    raise ValueError(f"accumulate={value!r} is not valid; accepted: None, {', '.join(map(repr, ACCUMULATE))}")
