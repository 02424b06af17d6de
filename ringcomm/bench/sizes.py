"""The benchmark's arithmetic: sizes and suffixes, sweeps, element counts, algbw and busbw.

Everything here is pure (no MPI, no arrays) so it is unit-tested in one process. Bandwidths follow
nccl-tests' doc/PERFORMANCE.md: ``algbw = S / t`` with S the size in bytes of the full buffer (the
reduced buffer of all_reduce, the pre-scatter buffer of reduce_scatter, the gathered buffer of
all_gather, the broadcast or reduced buffer), and ``busbw = algbw * factor`` with the factor of
:func:`bus_factor`. Units: bytes, seconds, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import re

import numpy as np

from ..schedule import ALIGN, COLLECTIVES

#: Size suffixes (powers of 1024, as nccl-tests reads them).
SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

#: Collectives whose buffer is split into one shard per rank.
SHARDED = ("reduce_scatter", "all_gather")

_SIZE_RE = re.compile(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a non-negative integer with an optional K, M or G suffix (1024-based).

    ``"8"`` -> 8, ``"64K"`` -> 65536, ``"128M"`` -> 134217728, ``"1G"`` -> 1073741824; a trailing
    ``B``/``iB`` and lower case are accepted (``"4kib"``). ValueError otherwise.
    """
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0 bytes; got {text}")
        return int(text)
    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise ValueError(
            f"invalid size {text!r}: expected a non-negative integer number of bytes with an optional "
            "K, M or G suffix (powers of 1024), e.g. 8, 64K, 128M, 1G"
        )
    return int(m.group(1)) * SUFFIXES[m.group(2).upper()]


def format_size(nbytes: int) -> str:
    """``nbytes`` for people: ``"8 B"``, ``"64 KiB"``, ``"1.5 MiB"``, ``"2 GiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{nbytes} B"


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int | None = None, step: int | None = None) -> list[int]:
    """The sizes (bytes) of a sweep from ``min_bytes`` to ``max_bytes`` (inclusive when hit).

    Exactly one of ``factor`` (multiply: 8, 16, 32, ... as nccl-tests' ``-f``; an integer >= 2,
    and ``min_bytes`` > 0) and ``step`` (add: as nccl-tests' ``-i``; an integer >= 1) is given.
    A sweep never goes past ``max_bytes``: ``-b 8 -e 100 -f 2`` is 8, 16, 32, 64.
    """
    if min_bytes < 0 or max_bytes < 0:
        raise ValueError(f"sizes must be >= 0 bytes; got min {min_bytes}, max {max_bytes}")
    if min_bytes > max_bytes:
        raise ValueError(f"the minimum size ({min_bytes} B) is larger than the maximum ({max_bytes} B)")
    if (factor is None) == (step is None):
        raise ValueError("give exactly one of a step factor (-f) and a step size in bytes (-i)")
    sizes, size = [], min_bytes
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, (int, np.integer)) or factor < 2:
            raise ValueError(f"the step factor (-f) must be an integer >= 2; got {factor!r}")
        if min_bytes == 0:
            raise ValueError("a sweep by factor (-f) cannot start at 0 bytes; use -b >= 1, or -i to step linearly")
        while size <= max_bytes:
            sizes.append(size)
            size *= int(factor)
    else:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ValueError(f"the step size (-i) must be an integer >= 1 byte; got {step!r}")
        while size <= max_bytes:
            sizes.append(size)
            size += int(step)
    return sizes


def count_multiple(collective: str, nranks: int) -> int:
    """The element count of ``collective`` is rounded down to a multiple of this.

    reduce_scatter and all_gather: ``ALIGN * nranks`` (ringcomm's shard boundaries are multiples
    of :data:`ringcomm.schedule.ALIGN` elements), so that every rank's shard has the same size, as
    NCCL and MPI_Reduce_scatter_block need and as the busbw formula assumes. Others: 1.
    """
    _check_collective(collective)
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1; got {nranks}")
    return ALIGN * nranks if collective in SHARDED else 1


def element_count(size_bytes: int, itemsize: int, collective: str, nranks: int) -> int:
    """Elements of the full buffer for a row of ``size_bytes``: rounded down to whole elements of
    ``itemsize`` bytes, then to a multiple of :func:`count_multiple`. The row's size is
    ``element_count(...) * itemsize`` bytes (what the table prints)."""
    if itemsize < 1:
        raise ValueError(f"itemsize must be >= 1 byte; got {itemsize}")
    count = size_bytes // itemsize
    return count - count % count_multiple(collective, nranks)


def sweep_counts(sizes: list[int], itemsize: int, collective: str, nranks: int) -> list[int]:
    """The distinct element counts of a sweep, in order (sizes that round to the same count, e.g.
    small reduce_scatter sizes that all round to 0, give one row)."""
    counts: list[int] = []
    for size in sizes:
        c = element_count(size, itemsize, collective, nranks)
        if c not in counts:
            counts.append(c)
    return counts


def bus_factor(collective: str, nranks: int) -> float:
    """busbw / algbw for ``collective`` on ``nranks`` ranks (nccl-tests' doc/PERFORMANCE.md).

    all_reduce 2(n-1)/n; reduce_scatter and all_gather (n-1)/n; broadcast and reduce 1.
    """
    _check_collective(collective)
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1; got {nranks}")
    if collective == "all_reduce":
        return 2.0 * (nranks - 1) / nranks
    if collective in SHARDED:
        return (nranks - 1) / nranks
    return 1.0


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s): ``nbytes / seconds``; 0 when seconds <= 0."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def busbw(collective: str, nbytes: int, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s: :func:`algbw` times :func:`bus_factor`."""
    return algbw(nbytes, seconds) * bus_factor(collective, nranks)


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; accepted: {', '.join(COLLECTIVES)}")
