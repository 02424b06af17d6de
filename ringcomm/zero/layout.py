"""The flat layout: many parameters as one padded buffer, cut into N equal shards.

Parameter i occupies elements ``[offsets[i], offsets[i] + sizes[i])`` of the flat buffer, in the
order given (C order inside each parameter). The buffer is padded with zeros to ``padded`` elements,
the smallest nonzero multiple of ``ALIGN * world_size`` (ALIGN = 16, the collectives' chunk
alignment) that holds every parameter, so that :func:`ringcomm.schedule.partition` cuts it into
``world_size`` equal, nonempty shards of ``shard_size`` elements: rank r owns
``[r * shard_size, (r + 1) * shard_size)``. A parameter may straddle any number of shards.
Pure arithmetic and copies; no communication.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ..schedule import ALIGN


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in the padded flat buffer, and which rank owns which elements.

    Build with :meth:`of`. All counts are in elements (not bytes).
    """

    shapes: tuple[tuple[int, ...], ...]
    world_size: int
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    count: int  # elements of all parameters together (unpadded)
    padded: int  # elements of the padded flat buffer: Φ of the memory formulas
    shard_size: int  # padded // world_size: elements each rank owns

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], world_size: int) -> FlatLayout:
        """The layout of parameters with these ``shapes`` over ``world_size`` ranks."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1; got {world_size!r}")
        shapes_t = tuple(tuple(int(d) for d in s) for s in shapes)
        for i, s in enumerate(shapes_t):
            if any(d < 0 for d in s):
                raise ValueError(f"parameter {i}: negative dimension in shape {s}")
        sizes = tuple(math.prod(s) for s in shapes_t)
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += n
        quantum = ALIGN * world_size
        padded = max(1, -(-total // quantum)) * quantum
        return cls(shapes_t, world_size, sizes, tuple(offsets), total, padded, padded // world_size)

    def bucket(self, bucket_elements: int) -> int:
        """Elements per rank in one round of a bucketed reduce-scatter over the shards, with a staging
        buffer of about ``bucket_elements`` (N times the result): the whole shard when N·shard_size
        fits, else the largest multiple of ALIGN in bucket_elements / N (at least ALIGN). The rounds
        are this size and the remainder ``shard_size % bucket``, both multiples of ALIGN, so
        :func:`ringcomm.schedule.partition` cuts every round's N·m elements into N pieces of m."""
        if isinstance(bucket_elements, bool) or not isinstance(bucket_elements, int) or bucket_elements < 1:
            raise ValueError(f"bucket_elements must be an integer >= 1; got {bucket_elements!r}")
        n, S = self.world_size, self.shard_size
        if n * S <= bucket_elements:
            return S
        return min(S, max(ALIGN, bucket_elements // n // ALIGN * ALIGN))

    def shard(self, rank: int) -> tuple[int, int]:
        """The [start, stop) of rank ``rank``'s shard in the padded flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}); got {rank}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The parameters overlapping flat ``[lo, hi)``: (index, start, stop) within the parameter's
        own flat elements, in flat order. Zero-size parameters are left out."""
        out = []
        i = max(0, bisect.bisect_right(self.offsets, lo) - 1)
        while i < len(self.sizes) and self.offsets[i] < hi:
            a = max(lo, self.offsets[i])
            b = min(hi, self.offsets[i] + self.sizes[i])
            if a < b:
                out.append((i, a - self.offsets[i], b - self.offsets[i]))
            i += 1
        return out

    def pack(self, flats: Sequence[Any], lo: int, hi: int, dst: Any) -> None:
        """Copy flat elements ``[lo, hi)`` of the parameters (``flats``: one 1-D array per parameter)
        into ``dst`` (``hi - lo`` elements, numpy or CuPy like ``flats``); padding gets zeros."""
        assert dst.size == hi - lo, (dst.size, lo, hi)
        for i, a, b in self.pieces(lo, hi):
            at = self.offsets[i] + a - lo
            dst[at : at + b - a] = flats[i][a:b]
        if hi > self.count:
            dst[max(0, self.count - lo) :] = 0

    def runs(self, indices: Sequence[int]) -> list[tuple[int, int]]:
        """Maximal contiguous flat ranges [start, stop) covering the parameters ``indices``."""
        out: list[tuple[int, int]] = []
        for i in sorted(set(indices)):
            a, b = self.offsets[i], self.offsets[i] + self.sizes[i]
            if a == b:
                continue
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    def views(self, flat: Any, base: int = 0, indices: Sequence[int] | None = None) -> list[Any]:
        """Each parameter as a view of ``flat`` in its shape; ``flat[0]`` is flat element ``base``."""
        idx = range(len(self.sizes)) if indices is None else indices
        return [
            flat[self.offsets[i] - base : self.offsets[i] - base + self.sizes[i]].reshape(self.shapes[i]) for i in idx
        ]
