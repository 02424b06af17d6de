"""ZeroShardManager: ZeRO stages 0-3 over ringcomm's collectives.

Stage 0 is plain data parallelism: all-reduce the gradients, run Adam on the whole model on every
rank. Stage 1 partitions the optimizer states (master copy, exp_avg, exp_avg_sq): each rank keeps
them for its shard only, keeps a full gradient buffer, reduce-scatters it, updates its shard and
all-gathers the parameters. (Issue 5's text says stage 1 all-reduces; an all-reduce plus the
parameter all-gather would send 3Φ, not the paper's 2Φ, and the other ranks' reduced gradients
are never used, so stage 1 reduce-scatters, as the paper's P_os does.) Stage 2 also partitions the
gradients (the reduced gradient exists only as the shard; the reduction streams through a bounded
bucket). Stage 3 also partitions the parameters: a rank
keeps only its shard and the full parameters exist only inside :meth:`ZeroShardManager.gathered`.

Communication per step, in elements sent by each rank (Φ the padded count; the ring moves
(N-1)/N of a buffer per reduce-scatter or all-gather and 2(N-1)/N per all-reduce):

- stage 0: one all-reduce of the gradients, 2(N-1)/N·Φ (the paper's 2Φ);
- stages 1, 2: reduce-scatter of the gradients + all-gather of the parameters, 2(N-1)/N·Φ (2Φ);
- stage 3: reduce-scatter of the gradients, plus one all-gather per ``gathered()`` of all
  parameters: with one for forward and one for backward, 3(N-1)/N·Φ (3Φ).

With gradient clipping or loss scaling, one float64 scalar (the gradients' squared norm) is summed
over the ranks per step in stages 1-3 (stage 0 has the whole reduced gradient locally). Buffers of
at most ``comm.small_bytes`` take the communicator's gather-and-fold all-reduce, (N-1)·Φ.
Construction broadcasts rank 0's parameters (Φ elements) once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import numbers
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..arrays import classify
from ..communicator import Communicator
from ..ops import FLOAT_DTYPES, parse_accumulate
from ..records import exchange
from . import checkpoint
from .adam import apply_adam
from .layout import FlatLayout
from .memory import STAGES
from .scaler import LossScaler

log = logging.getLogger("ringcomm")

KINDS = ("params", "grads", "master", "exp_avg", "exp_avg_sq")

#: Elements per pass of the float64 squared-norm loop (host: pairwise sums, deterministic).
_NORM_CHUNK = 1 << 14
#: torch.nn.utils.clip_grad_norm_'s epsilon: coef = max_norm / (norm + 1e-6), at most 1.
_CLIP_EPS = 1e-6


def _xp(kind: str) -> Any:
    if kind == "host":
        return np
    import cupy

    return cupy


def _real(name: str, value: Any, *, low: float, low_ok: bool, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    v = float(value)
    if v < low or (v == low and not low_ok) or (high is not None and v >= high):
        bound = f"{'>=' if low_ok else '>'} {low:g}" + (f" and < {high:g}" if high is not None else "")
        raise ValueError(f"{name} must be {bound}; got {value!r}")
    return v


class _Params(Sequence):
    """Stage 3's ``params``: entry i exists only while parameter i is gathered."""

    def __init__(self, mgr: ZeroShardManager) -> None:
        self._mgr = mgr

    def __len__(self) -> int:
        return len(self._mgr.layout.sizes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        arr = self._mgr._gathered_arrays.get(i if i >= 0 else i + len(self))
        if arr is None:
            if not -len(self) <= i < len(self):
                raise IndexError(f"parameter index {i} out of range ({len(self)} parameters)")
            raise RuntimeError(
                f"parameter {i} is not gathered: with stage 3 this rank keeps only its shard; "
                f"read it inside `with mgr.gathered([{i}]):`"
            )
        return arr


class ZeroShardManager:
    """Shards a model's parameters, gradients and AdamW states over the ranks of ``comm`` (ZeRO).

    ``params``: the parameters, numpy or CuPy arrays of one working precision (float16, bfloat16,
    float32 or float64), any shapes. They are copied into one flat buffer padded with zeros to Φ
    elements, a multiple of 16·N (so the N shards are equal; a parameter may straddle shards),
    and rank 0's values are broadcast to every rank. The caller's arrays are not referenced
    afterwards: read the parameters from :attr:`params` (stages 0-2) or :meth:`gathered`.
    The master copy, exp_avg and exp_avg_sq are float32 (float64 for float64 parameters).

    ``stage``: 0-3 (see the module docstring). ``lr``, ``betas``, ``eps``, ``weight_decay``: AdamW
    as ``torch.optim.AdamW`` (formula in :mod:`ringcomm.zero.adam`); they may be changed between
    steps (e.g. ``mgr.lr = ...``). ``max_grad_norm``: clip the global L2 norm of the averaged,
    unscaled gradient to this value (coefficient min(1, max_norm / (norm + 1e-6)), as
    ``torch.nn.utils.clip_grad_norm_``), or None. ``loss_scale``: None, a float (static) or
    "dynamic" (see :class:`ringcomm.zero.scaler.LossScaler`). ``accumulate``: None or "float32":
    the gradient reduction of float16/bfloat16 parameters adds in float32 and rounds once (the
    collectives' ``accumulate=``; DeepSpeed's ``communication_data_type`` without a float32 copy).

    Construction is collective (every rank of ``comm`` calls it with parameters of the same shapes
    and dtype); so are :meth:`step`, :meth:`gathered`, :meth:`save` and :meth:`load`, which every
    rank must call in the same order with the same arguments (indices, directory).
    """

    #: Largest reduce-scatter (elements) the gradient reduction of stages 2-3 issues: the bucket.
    #: The gradients go through a staging buffer of min(Φ, bucket_elements) elements (about), in
    #: rounds (:meth:`FlatLayout.bucket`); the volume sent is the same. Construction reads it, so set
    #: it on the class (or a subclass) before constructing; it must be the same on every rank
    #: (checked at construction). Changing it on an instance afterwards has no effect.
    bucket_elements: int = 1 << 25

    def __init__(
        self,
        comm: Communicator,
        params: Sequence[Any],
        stage: int = 2,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
        loss_scale: None | float | str = None,
        accumulate: str | None = None,
    ) -> None:
        # ---- local validation, before any communication
        self.accumulate = parse_accumulate(accumulate)  # float16/bfloat16 gradients: summed in float32
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a ringcomm.Communicator (ringcomm.init()); got {type(comm).__name__}")
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(f"unknown ZeRO stage {stage!r}; accepted: 0, 1, 2, 3")
        self.lr = _real("lr", lr, low=0.0, low_ok=True)
        if not isinstance(betas, Sequence) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2); got {betas!r}")
        self.betas = (
            _real("betas[0]", betas[0], low=0.0, low_ok=True, high=1.0),
            _real("betas[1]", betas[1], low=0.0, low_ok=True, high=1.0),
        )
        self.eps = _real("eps", eps, low=0.0, low_ok=False)
        self.weight_decay = _real("weight_decay", weight_decay, low=0.0, low_ok=True)
        self.max_grad_norm = (
            None if max_grad_norm is None else _real("max_grad_norm", max_grad_norm, low=0.0, low_ok=False)
        )
        self.scaler = LossScaler(loss_scale)
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence) or len(params) == 0:
            raise TypeError("params must be a non-empty list of arrays (one per parameter)")
        arrays = [classify(p, f"params[{i}]") for i, p in enumerate(params)]
        kinds = {k for k, _ in arrays}
        if len(kinds) != 1:
            raise TypeError("params mix numpy and GPU arrays; pass them all on the host or all on one GPU")
        dtypes = {a.dtype for _, a in arrays}
        if len(dtypes) != 1:
            raise TypeError(
                f"params have several dtypes ({', '.join(sorted(map(str, dtypes)))}); use one working precision"
            )
        dtype = dtypes.pop()
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"params: dtype {dtype}; accepted working precisions: {', '.join(map(str, FLOAT_DTYPES))}")
        bucket = self.bucket_elements

        self.comm, self.stage, self.dtype = comm, stage, dtype
        self.kind = kinds.pop()
        self.master_dtype = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
        self.layout = layout = FlatLayout.of([a.shape for _, a in arrays], comm.size)
        n, rank, S = comm.size, comm.rank, layout.shard_size
        self._lo, self._hi = layout.shard(rank)
        # bucket: rounds of at most this many elements per rank through a staging buffer of n times it
        self._bucket = layout.bucket(bucket)  # validates bucket_elements (locally, before any communication)

        # ---- every rank must describe the same model and bucket (one small all-gather, with a
        # deadline): a different bucket_elements would make the reduce-scatter rounds differ in size
        sig = repr((self.kind, layout.shapes)).encode()
        digest = np.frombuffer(hashlib.sha256(sig).digest()[:16], np.int64)
        mine = [
            stage,
            FLOAT_DTYPES.index(dtype),
            len(layout.sizes),
            layout.count,
            int(digest[0]),
            int(digest[1]),
            bucket,
        ]
        table = exchange(comm, mine)
        first = table[0][0][: len(mine)]
        bad = [r for r, (v, _) in enumerate(table) if v[: len(mine)] != first]
        if bad:
            fields = ("stage", "dtype") + ("parameter shapes or device",) * 4 + ("bucket_elements",)
            differ = dict.fromkeys(fields[j] for r in bad for j, (a, b) in enumerate(zip(table[r][0], first)) if a != b)
            raise ValueError(
                f"ZeroShardManager: ranks {bad} differ from rank 0 in {', '.join(differ)} "
                f"(rank 0: stage {first[0]}, {first[2]} parameters, {first[3]} elements, bucket_elements {first[6]}; "
                f"this rank {rank}: stage {stage}, {len(layout.sizes)} parameters, {layout.count} elements, "
                f"bucket_elements {bucket}); construct the manager alike on every rank"
            )

        # ---- buffers
        xp = self._xp = _xp(self.kind)
        flat = xp.empty(layout.padded, dtype)
        layout.pack([a.reshape(-1) for _, a in arrays], 0, layout.padded, flat)
        del arrays
        comm.broadcast(flat, root=0)  # every rank starts from rank 0's parameters
        md, lo, hi = self.master_dtype, self._lo, self._hi
        self._param_flat = self._param_shard = self._grad_flat = self._grad_shard = self._staging = None
        if stage == 0:
            self._param_flat = flat
            self._master = flat.astype(md)
        elif stage in (1, 2):
            self._param_flat = flat
            self._master = flat[lo:hi].astype(md)
        else:
            self._param_shard = flat[lo:hi].copy()
            self._master = self._param_shard.astype(md)
        del flat
        self._exp_avg = xp.zeros(self._master.size, md)
        self._exp_avg_sq = xp.zeros(self._master.size, md)
        if stage <= 1:
            self._grad_flat = xp.zeros(layout.padded, dtype)
        else:
            self._grad_shard = xp.zeros(S, dtype)
        if stage >= 2 or self._bucket < S:
            self._staging = xp.empty(n * self._bucket, dtype)
        self._views = layout.views(self._param_flat) if self._param_flat is not None else None
        self._grad_views = layout.views(self._grad_flat) if self._grad_flat is not None else None
        self._gathered_arrays: dict[int, Any] = {}
        self._gather_refs: dict[int, int] = {}

        log.debug(
            "zero: stage %d rank %d/%d: %d parameters, %d elements padded to %d (shard %d), %s/%s, bucket %d",
            stage,
            rank,
            n,
            len(layout.sizes),
            layout.count,
            layout.padded,
            S,
            dtype,
            self.master_dtype,
            self._bucket,
        )
        self.step_count = 0  #: Adam's step t: applied steps (skipped ones do not count)
        self.skipped_steps = 0  #: steps skipped because of an overflow
        self.last_grad_norm: float | None = None  #: global L2 norm of the last step's averaged unscaled gradient
        self._comm_mark = comm.bytes_sent
        self._comm_last = 0

    # ------------------------------------------------------------------ properties
    @property
    def params(self) -> Sequence[Any]:
        """The parameters in their shapes and working precision. Stages 0-2: views of the flat
        buffer, updated in place by :meth:`step` (read them, do not write them). Stage 3: entry i
        exists only while parameter i is gathered (else RuntimeError)."""
        return self._views if self.stage < 3 else _Params(self)

    @property
    def grads(self) -> list[Any] | None:
        """Stages 0-1: views of the flat gradient buffer, one per parameter: write the local
        gradients there and pass this list to :meth:`step` to skip a copy (their contents are
        overwritten by the reduction). Stages 2-3: None (there is no full gradient buffer)."""
        return self._grad_views

    @property
    def loss_scale(self) -> float:
        """The current loss scale: multiply the loss by it before backward (1.0 without scaling)."""
        return self.scaler.scale

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's [start, stop) in the padded flat buffer (elements)."""
        return self._lo, self._hi

    @property
    def comm_bytes(self) -> int:
        """Bytes this rank sent in collectives (``comm.bytes_sent``) during the last step cycle:
        from the end of the previous :meth:`step` (or of construction, save, load) to the end of the
        latest one, so it includes the all-gathers of ``gathered()`` before that step. 0 before the
        first step."""
        return self._comm_last

    @property
    def scratch_bytes(self) -> int:
        """Bytes of this manager's gradient staging (bucket) buffer; not a model state, so not in
        :meth:`memory_report`. (The communicator keeps a scratch of the largest reduce-scatter too.)"""
        return 0 if self._staging is None else int(self._staging.nbytes)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the parameters gathered right now (stage 3 inside :meth:`gathered`; else 0)."""
        return sum(int(a.nbytes) for a in self._gathered_arrays.values())

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: ``params``, ``grads``, ``master``, ``exp_avg``,
        ``exp_avg_sq`` (the persistent model states; the transient gathered parameters of stage 3
        and the staging buffer are not included, see :attr:`gathered_bytes`, :attr:`scratch_bytes`).

        With Φ the padded count, N ranks, P and G the working precision's bytes, M the master's:
        stage 0: P·Φ, P·Φ, M·Φ ×3; stage 1: P·Φ, P·Φ, M·Φ/N ×3; stage 2: P·Φ, P·Φ/N, M·Φ/N ×3;
        stage 3: P·Φ/N, P·Φ/N, M·Φ/N ×3 — for fp16 and fp32 master the paper's 16Φ,
        4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N.
        """
        p = self._param_flat if self._param_flat is not None else self._param_shard
        g = self._grad_flat if self._grad_flat is not None else self._grad_shard
        arrays = (p, g, self._master, self._exp_avg, self._exp_avg_sq)
        return {k: int(a.nbytes) for k, a in zip(KINDS, arrays)}

    # ------------------------------------------------------------------ the step
    def _check_grads(self, grads: Sequence[Any]) -> list[Any]:
        layout = self.layout
        if isinstance(grads, (str, bytes)) or not isinstance(grads, Sequence):
            raise TypeError(f"grads must be a list of arrays, one per parameter; got {type(grads).__name__}")
        if len(grads) != len(layout.sizes):
            raise ValueError(f"grads: got {len(grads)} arrays, expected {len(layout.sizes)} (one per parameter)")
        flats = []
        for i, g in enumerate(grads):
            kind, a = classify(g, f"grads[{i}]")
            if kind != self.kind:
                raise TypeError(f"grads[{i}]: a {kind} array, but the parameters are {self.kind} arrays")
            if a.dtype != self.dtype:
                raise TypeError(f"grads[{i}]: dtype {a.dtype}, expected the working precision {self.dtype}")
            if tuple(a.shape) != layout.shapes[i]:
                raise ValueError(f"grads[{i}]: shape {tuple(a.shape)}, expected {layout.shapes[i]} (the parameter's)")
            flats.append(a.reshape(-1))
        return flats

    def _sumsq(self, x: Any) -> float:
        """Sum of squares of ``x`` in float64 (deterministic: fixed chunks, pairwise sums)."""
        xp = self._xp
        n = x.size
        buf = xp.empty(min(n, _NORM_CHUNK if xp is np else 1 << 24), np.float64)
        total = xp.zeros((), np.float64)
        step = buf.size
        for a in range(0, n, step):
            t = buf[: min(n, a + step) - a]
            xp.copyto(t, x[a : a + t.size], casting="unsafe")
            xp.multiply(t, t, out=t)
            total += t.sum()
        return float(total)

    def _reduce_buckets(self, fill: Any, landing: Any) -> None:
        """Reduce-scatter the gradients in rounds: round o gathers elements [r*S+o, r*S+o+l) of
        every rank r's flat gradient into staging (``fill(start, stop, dst)``), reduce-scatters it,
        and writes this rank's reduced part to ``landing[o:o+l]``."""
        n, S, c = self.comm.size, self.layout.shard_size, self._bucket
        for o in range(0, S, c):
            m = min(c, S - o)
            buf = self._staging[: n * m]
            for r in range(n):
                fill(r * S + o, r * S + o + m, buf[r * m : (r + 1) * m])
            self.comm.reduce_scatter(buf, "sum", out=landing[o : o + m], accumulate=self.accumulate)

    def step(self, grads: Sequence[Any]) -> bool:
        """One optimizer step from this rank's local ``grads`` (one array per parameter, its shape,
        the working precision; loss-scaled if a loss scale is set). Collective.

        Sums the gradients over the ranks (all-reduce in stage 0, reduce-scatter in 1-3) and divides
        by N·loss_scale (the average of the ranks' gradients, unscaled); with a loss scale, skips the
        step on every rank if any gradient is inf/nan anywhere (Adam's step count, the parameters
        and states are left unchanged; a dynamic scale is lowered) and returns False; clips the
        global norm if ``max_grad_norm``; runs AdamW on this rank's shard (in place, master
        precision); writes the updated parameters in the working precision and all-gathers them
        (stages 1-2) or keeps the shard (stage 3). Returns True when the step was applied.
        ``grads`` are read, not modified (except :attr:`grads` views, which are overwritten).
        Without a loss scale nothing is checked: non-finite gradients propagate (as in PyTorch).
        """
        flats = self._check_grads(grads)
        comm, layout, stage = self.comm, self.layout, self.stage
        n, lo, hi = comm.size, self._lo, self._hi
        zero_copy = self._grad_views is not None and all(g is v for g, v in zip(grads, self._grad_views))
        if stage == 0:
            if not zero_copy:
                layout.pack(flats, 0, layout.padded, self._grad_flat)
            comm.all_reduce(self._grad_flat, "sum", accumulate=self.accumulate)
            reduced = self._grad_flat
        elif stage == 1:
            if not zero_copy:
                layout.pack(flats, 0, layout.padded, self._grad_flat)
            reduced = self._grad_flat[lo:hi]
            if self._bucket == layout.shard_size:
                # x is copied first: out may alias it
                comm.reduce_scatter(self._grad_flat, "sum", out=reduced, accumulate=self.accumulate)
            else:
                gf = self._grad_flat

                def fill(a: int, b: int, dst: Any) -> None:
                    dst[...] = gf[a:b]

                self._reduce_buckets(fill, reduced)
        else:
            self._reduce_buckets(lambda a, b, dst: layout.pack(flats, a, b, dst), self._grad_shard)
            reduced = self._grad_shard

        inv = 1.0 / (n * self.scaler.scale)
        coef = 1.0
        if self.max_grad_norm is not None or self.scaler.enabled:
            sq = self._sumsq(reduced)
            if stage != 0:
                total = np.array([sq])
                comm.all_reduce(total, "sum")
                sq = float(total[0])
            norm = math.sqrt(sq) * inv if math.isfinite(sq) else sq  # inf or nan
            self.last_grad_norm = norm
            if self.scaler.enabled and not math.isfinite(sq):
                self.scaler.update(overflow=True)
                self.skipped_steps += 1
                self._end_cycle()
                return False
            if self.max_grad_norm is not None:
                coef = min(1.0, self.max_grad_norm / (norm + _CLIP_EPS))
        else:
            self.last_grad_norm = None

        self.step_count += 1
        if stage == 0:
            target = self._param_flat
        elif stage in (1, 2):
            target = self._param_flat[lo:hi]
        else:
            target = self._param_shard
        apply_adam(
            self._master,
            reduced,
            self._exp_avg,
            self._exp_avg_sq,
            lr=self.lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            weight_decay=self.weight_decay,
            step=self.step_count,
            grad_scale=inv * coef,
            out=target,
        )
        if stage in (1, 2):
            comm.all_gather(target, out=self._param_flat)
        self.scaler.update(overflow=False)
        self._end_cycle()
        return True

    def _end_cycle(self) -> None:
        now = self.comm.bytes_sent
        self._comm_last, self._comm_mark = now - self._comm_mark, now

    # ------------------------------------------------------------------ stage 3 gathering
    def _check_indices(self, indices: Sequence[int] | None) -> list[int]:
        count = len(self.layout.sizes)
        if indices is None:
            return list(range(count))
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise TypeError(f"indices must be a list of parameter indices or None; got {type(indices).__name__}")
        out = []
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise TypeError(f"parameter index {i!r} is not an integer")
            if not 0 <= i < count:
                raise IndexError(f"parameter index {i} out of range (0 to {count - 1})")
            out.append(int(i))
        return out

    def _gather(self, new: list[int]) -> None:
        """All-gather (everything) or broadcast from the owners (a subset) the parameters ``new``."""
        layout, comm, xp = self.layout, self.comm, self._xp
        S = layout.shard_size
        if len(new) == len(layout.sizes):
            full = xp.empty(layout.padded, self.dtype)
            comm.all_gather(self._param_shard, out=full)
            for i, v in zip(new, layout.views(full, 0, new)):
                self._gathered_arrays[i] = v
            return
        for a, b in layout.runs(new):
            buf = xp.empty(b - a, self.dtype)
            for q in range(a // S, (b - 1) // S + 1):
                x0, x1 = max(a, q * S), min(b, (q + 1) * S)
                if q == comm.rank:
                    buf[x0 - a : x1 - a] = self._param_shard[x0 - q * S : x1 - q * S]
                comm.broadcast(buf[x0 - a : x1 - a], root=q)
            idx = [i for i in new if layout.sizes[i] and a <= layout.offsets[i] < b]
            for i, v in zip(idx, layout.views(buf, a, idx)):
                self._gathered_arrays[i] = v
        for i in new:  # zero-size parameters
            if i not in self._gathered_arrays:
                self._gathered_arrays[i] = xp.empty(layout.shapes[i], self.dtype)

    @contextlib.contextmanager
    def gathered(self, indices: Sequence[int] | None = None) -> Iterator[list[Any]]:
        """Context manager giving the full parameters ``indices`` (default: all), in their shapes.

        Yields the list of arrays in the order of ``indices``; :attr:`params` serves them too while
        inside. Stage 3: collective; gathering all parameters is one all-gather ((N-1)/N·Φ
        elements sent per rank), a subset is broadcast piece by piece from the ranks that own it;
        on exit the manager drops the gathered arrays (do not keep references: the memory lives
        as long as they do). Contexts nest; a parameter gathered already is not gathered again.
        Changes to the arrays are not written back. Stages 0-2: no communication, yields the views.
        """
        idx = self._check_indices(indices)
        if self.stage < 3:
            yield [self._views[i] for i in idx]
            return
        uniq = sorted(set(idx))
        self._gather([i for i in uniq if self._gather_refs.get(i, 0) == 0])
        for i in uniq:
            self._gather_refs[i] = self._gather_refs.get(i, 0) + 1
        try:
            yield [self._gathered_arrays[i] for i in idx]
        finally:
            for i in uniq:
                self._gather_refs[i] -= 1
                if self._gather_refs[i] == 0:
                    del self._gather_refs[i], self._gathered_arrays[i]

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | os.PathLike) -> None:
        """Write a sharded checkpoint to ``directory`` (collective; see :mod:`ringcomm.zero.checkpoint`).

        Each rank writes the master copy and Adam moments of its shard; rank 0 writes meta.json
        last. It can be loaded at any world size and stage, and read by :func:`consolidate`.
        """
        checkpoint.save(self, directory)
        self._comm_mark = self.comm.bytes_sent

    def load(self, directory: str | os.PathLike) -> None:
        """Replace the master copy, Adam moments, step count and dynamic loss scale by the checkpoint
        in ``directory`` (saved at any world size and stage) and rebuild the parameters from it.
        Collective and all-or-nothing: on any error :class:`CheckpointError` is raised on every rank
        and nothing was changed. The hyperparameters (lr, ...) stay this manager's."""
        checkpoint.load(self, directory)
        self._comm_mark = self.comm.bytes_sent

    def _checkpoint_range(self, saving: bool = False) -> tuple[int, int]:
        """The unpadded flat elements this rank loads (stage 0 keeps the whole master: all of them)
        or, ``saving``, saves (its shard, so that the ranks' files tile the vector): the range
        clipped to the count."""
        count = self.layout.count
        if self.stage == 0 and not saving:
            return 0, count
        return min(self._lo, count), min(self._hi, count)

    def _local(self, a: int, b: int) -> slice:
        """Where unpadded flat elements [a, b) of :meth:`_checkpoint_range` sit in the local states."""
        start = a if self.stage == 0 else 0  # a shard starts at its own first element (or is all padding)
        return slice(start, start + b - a)

    def _checkpoint_shard(self) -> tuple[int, int, list[Any]]:
        """(start, stop, [master, exp_avg, exp_avg_sq] over it): what this rank saves."""
        a, b = self._checkpoint_range(saving=True)
        sl = self._local(a, b)
        return a, b, [self._master[sl], self._exp_avg[sl], self._exp_avg_sq[sl]]

    def _check_checkpoint(self, meta: dict[str, Any]) -> None:
        if [tuple(s) for s in meta["shapes"]] != list(self.layout.shapes):
            got, want = meta["shapes"], list(self.layout.shapes)
            if len(got) != len(want):
                detail = f"{len(got)} parameters vs {len(want)}"
            else:
                detail = next(f"parameter {i}: {g} vs {w}" for i, (g, w) in enumerate(zip(got, want)) if tuple(g) != w)
            raise checkpoint.CheckpointError(
                f"checkpoint does not fit this model: shapes differ ({detail}, checkpoint vs manager)"
            )
        if meta["master_dtype"] != self.master_dtype:
            raise checkpoint.CheckpointError(
                f"checkpoint keeps {meta['master_dtype']} master states, this manager {self.master_dtype} "
                f"(working precision {self.dtype})"
            )

    def _commit_checkpoint(self, meta: dict[str, Any], staged: tuple[Any, Any, Any]) -> None:
        xp, stage = self._xp, self.stage
        sl = self._local(*self._checkpoint_range())
        for dst, src in zip((self._master, self._exp_avg, self._exp_avg_sq), staged):
            dst[sl] = xp.asarray(src)
            dst[sl.stop :] = 0  # padding
        self.step_count = int(meta["step"])
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.scaler.load_state_dict(meta.get("loss_scaler") or {})
        self.last_grad_norm = None
        if stage == 0:
            self._param_flat[...] = self._master
        elif stage in (1, 2):
            self._param_flat[self._lo : self._hi] = self._master
            self.comm.all_gather(self._param_flat[self._lo : self._hi], out=self._param_flat)
        else:
            self._param_shard[...] = self._master

    def __repr__(self) -> str:
        return (
            f"<ZeroShardManager stage {self.stage}, {len(self.layout.sizes)} parameters, "
            f"{self.layout.count} elements (padded {self.layout.padded}), {self.dtype}, "
            f"rank {self.comm.rank} of {self.comm.size}, step {self.step_count}>"
        )
