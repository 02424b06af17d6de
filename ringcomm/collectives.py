"""The collectives: validate the arguments on the local rank, then run a schedule through the engine.

Every check here happens before any communication, so a bad argument raises TypeError/ValueError
on the rank that passed it and never leaves its peers waiting inside a ring (they time out with
:class:`ringcomm.TimeoutError`, or with ``check=True`` all ranks raise :class:`MismatchError`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import schedule
from .arrays import classify, default_stream, flat, relation, writable
from .engine import Context
from .ops import HALF_DTYPES, ReduceOp, check_dtype, parse_accumulate, parse_op


def _input(comm: Any, x: Any, name: str, op: ReduceOp | None, stream: Any) -> tuple[str, Any, Any]:
    """(kind, flat view, device) for the input array ``x``.

    A GPU collective runs on ``stream``; by default on PyTorch's current stream for a PyTorch CUDA
    tensor, else on CuPy's current stream (arrays.default_stream). DLPack imports happen on it.
    """
    comm._usable()
    if type(x) is np.ndarray and stream is None:  # a numpy array: nothing to import, no stream to pick
        check_dtype(x.dtype, op)
        return "host", flat(x, name), comm._host
    run_on = stream if type(x) is np.ndarray else default_stream(x, stream, name)  # numpy: no stream to pick
    kind, a = classify(x, name, run_on)
    check_dtype(a.dtype, op)
    if stream is not None and kind == "host":
        raise TypeError(f"{name}: stream= applies to GPU arrays only; got a numpy array and stream={stream!r}")
    return kind, flat(a, name), comm._device(kind, run_on)


def _output(out: Any, kind: str, dtype: np.dtype, count: int | None, device: Any, name: str = "out") -> Any:
    """The flat view of a user-given output, checked for kind, dtype, size (unless None), writability.

    ``device``: the input's (from _input); a GPU DLPack ``out`` is imported on its stream.
    """
    okind, o = ("host", out) if type(out) is np.ndarray else classify(out, name, device.stream)
    if okind != kind:
        raise TypeError(f"{name}: the input is a {kind} array but {name} is a {okind} array; use one kind for both")
    if o.dtype != dtype:
        raise TypeError(f"{name}: dtype {o.dtype} differs from the input's {dtype}; pass an array of dtype {dtype}")
    if count is not None and o.size != count:
        raise ValueError(f"{name}: has {o.size} elements, expected {count}")
    writable(o, name)
    return flat(o, name)


def _accumulating(comm: Any, accumulate: Any, dtype: np.dtype) -> bool:
    """Whether this call adds in float32 (accumulate="float32", or RINGCOMM_ACCUMULATE, on a half type)."""
    mode = accumulate if comm.accumulate_override == "" else comm.accumulate_override
    return mode is not None and parse_accumulate(mode) == "float32" and dtype in HALF_DTYPES


def _root(comm: Any, root: Any) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
        raise ValueError(f"root must be an integer rank in [0, {comm.size}); got {root!r}")
    return int(root)


def all_reduce(comm: Any, x: Any, op: Any = "sum", *, out: Any = None, stream: Any = None, accumulate: Any = None) -> Any:
    op = parse_op(op)
    kind, src, device = _input(comm, x, "x", op, stream)
    wide = _accumulating(comm, accumulate, src.dtype)
    if out is None:
        writable(src, "x (all_reduce writes its result into x when out is None)")
        work = src
    else:
        work = _output(out, kind, src.dtype, src.size, device)
        rel = relation(work, src)
        if rel == "overlap":
            raise ValueError("out partly overlaps x; pass out=None (in place) or a separate array")
        if rel == "same":
            work = src
    n, r, count = comm.size, comm.position, src.size
    ctx = Context("all_reduce", comm, device, src.dtype, op)
    ctx.wide = wide
    if 1 < n and src.nbytes <= comm.small_bytes:
        # Latency-bound: gather every rank's whole buffer round the ring (N-1 steps, not 2(N-1)),
        # then fold the N blocks locally in the ring's order (bitwise the ring's result). Block p
        # is the data of the rank at ring place p.
        gather, mine, fold, reused = comm._gather_plan(ctx, kind, count)
        if reused is not None:  # GPUs: after the previous call's use of the buffer (maybe on another stream)
            reused.after(device)
        device.copy(mine, src)
        comm._run_plan(ctx, kind, count, gather)
        if wide:
            fold(ctx, work, comm._partial_sums(kind, device, count))
            comm._scratch_done((kind, "partial sums"), device)
        else:
            fold(ctx, work)
        if reused is not None:
            reused.done(device)
    else:
        steps = schedule.all_reduce(n, r)
        comm._run(ctx, kind, count, steps, comm._in_ring(schedule.partition(count, n)), work, src,
                  result_chunks=range(n))
    return x if out is None else out


def reduce_scatter(
    comm: Any, x: Any, op: Any = "sum", *, out: Any = None, stream: Any = None, accumulate: Any = None
) -> Any:
    op = parse_op(op)
    kind, src, device = _input(comm, x, "x", op, stream)
    wide = _accumulating(comm, accumulate, src.dtype)
    bounds = schedule.partition(src.size, comm.size)  # comm.shard_bounds, as a tuple
    lo, hi = bounds[comm.rank]
    result = device.empty(hi - lo, src.dtype) if out is None else _output(out, kind, src.dtype, hi - lo, device)
    ctx = Context("reduce_scatter", comm, device, src.dtype, op)
    ctx.wide = wide
    work = comm._scratch_array(kind, device, src.size, src.dtype)
    steps = schedule.reduce_scatter(comm.size, comm.position)  # place p ends with chunk p: its own shard
    comm._run(ctx, kind, src.size, steps, comm._in_ring(bounds), work, src, result_chunks=[comm.position])
    device.copy(result, work[lo:hi])
    comm._scratch_done(kind, device)
    return out if out is not None else result


def all_gather(comm: Any, shard: Any, *, out: Any = None, stream: Any = None) -> Any:
    kind, src, device = _input(comm, shard, "shard", None, stream)
    n, r = comm.size, comm.rank
    ctx = Context("all_gather", comm, device, src.dtype, None)
    agreed = False
    if out is not None:
        work = _output(out, kind, src.dtype, None, device)
        count = work.size
        bounds = schedule.partition(count, n)
        lo, hi = bounds[r]
        if src.size != hi - lo:
            raise ValueError(
                f"shard: has {src.size} elements, but rank {r}'s shard of out ({count} elements) is "
                f"[{lo}, {hi}) = {hi - lo} elements (see Communicator.shard_bounds)"
            )
        if relation(work, src) != "apart" and relation(work[lo:hi], src) != "same":
            raise ValueError(f"shard overlaps out but is not out[{lo}:{hi}] (this rank's place in out)")
    else:
        # Shard sizes are only known to their owners: exchange them (this is the agreement check too).
        sizes = comm._guarded(lambda: comm._agree(ctx, "all_gather", 0, -1, extra=src.size))[:, -1]
        agreed = True
        stops = np.cumsum(sizes)
        bounds = tuple((int(b - s), int(b)) for b, s in zip(stops, sizes))
        work = device.empty(int(stops[-1]), src.dtype)
        lo, hi = bounds[r]
    if relation(work[lo:hi], src) != "same":
        device.copy(work[lo:hi], src)
    steps = schedule.all_gather(n, comm.position)
    comm._run(ctx, kind, work.size, steps, comm._in_ring(bounds), work, work, agreed=agreed)
    return out if out is not None else work


def broadcast(comm: Any, x: Any, root: int = 0, *, stream: Any = None) -> Any:
    root = _root(comm, root)
    kind, buf, device = _input(comm, x, "x", None, stream)
    if comm.rank != root:  # the root's x is only read
        writable(buf, "x (broadcast writes root's data into x)")
    n = comm.size
    nchunks = schedule.chain_chunks(n, buf.size, buf.itemsize, comm.slice_bytes)
    ctx = Context("broadcast", comm, device, buf.dtype, None)
    steps = schedule.broadcast(n, comm.position, comm.ring.index(root), nchunks)
    comm._run(ctx, kind, buf.size, steps, schedule.partition(buf.size, nchunks), buf, buf, root=root)
    return x


def reduce(
    comm: Any, x: Any, op: Any = "sum", root: int = 0, *, out: Any = None, stream: Any = None, accumulate: Any = None
) -> Any:
    op = parse_op(op)
    root = _root(comm, root)
    kind, src, device = _input(comm, x, "x", op, stream)
    wide = _accumulating(comm, accumulate, src.dtype)
    n, is_root = comm.size, comm.rank == root
    o = None if out is None else _output(out, kind, src.dtype, src.size, device)
    rel = "same" if o is None else relation(o, src)
    if rel == "overlap":
        raise ValueError("out partly overlaps x; pass out=None (in place at the root) or a separate array")
    if not is_root:
        work = comm._scratch_array(kind, device, src.size, src.dtype)
    elif rel == "same":
        writable(src, "x (reduce writes the result into x at the root when out is None)")
        work = src
    else:
        work = o
    nchunks = schedule.chain_chunks(n, src.size, src.itemsize, comm.slice_bytes)
    ctx = Context("reduce", comm, device, src.dtype, op)
    ctx.wide = wide
    steps = schedule.reduce(n, comm.position, comm.ring.index(root), nchunks)
    result = range(nchunks) if is_root else ()
    comm._run(
        ctx, kind, src.size, steps, schedule.partition(src.size, nchunks), work, src, result_chunks=result, root=root
    )
    if not is_root:
        comm._scratch_done(kind, device)
        return None
    return x if out is None else out

