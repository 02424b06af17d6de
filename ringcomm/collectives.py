"""The collectives: validate the arguments on the local rank, then run a schedule through the engine.

Every check here happens before any communication, so a bad argument raises TypeError/ValueError
on the rank that passed it and never leaves its peers waiting inside a ring (they time out with
:class:`ringcomm.TimeoutError`, or with ``check=True`` all ranks raise :class:`MismatchError`).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any
from weakref import ref

import numpy as np

from . import schedule
from .arrays import classify, default_stream, flat, lane_buffer, lane_stream, relation, span, writable
from .devices import get as get_device
from .engine import Context
from .ops import AVG, HALF_DTYPES, OPS, ReduceOp, check_dtype, parse_accumulate, parse_op

_debug, DEBUG = logging.getLogger("ringcomm").isEnabledFor, logging.DEBUG
#: NumPy 1 lets ``a.data = ...`` move an array (deprecated); NumPy 2 refuses it (collectives._small_host)
_FIXED_ADDRESSES = np.lib.NumpyVersion(np.__version__) >= "2.0.0"
#: the most fast lanes a communicator keeps (Communicator._lanes; a GPU one per kind of call, count
#: included): past it they are dropped, and the next call of each kind takes the full path again
LANES = 256


def _input(comm: Any, x: Any, name: str, op: ReduceOp | None, stream: Any) -> tuple[str, Any, Any]:
    """(kind, flat view, device) for the input array ``x``.

    A GPU collective runs on ``stream``; by default on PyTorch's current stream for a PyTorch CUDA
    tensor, else on CuPy's current stream (arrays.default_stream). DLPack imports happen on it. A
    stream that captures a CUDA graph is refused (RuntimeError, before any communication) unless the
    ring runs its calls as ring kernels (:func:`_capturable`).
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
    device = comm._device(kind, run_on)
    if kind != "host":
        _on_device(a.data.device_id, device, f"{name}: the array is on", "an array")
        _on_device(getattr(device.stream, "device_id", -1), device, "stream: a stream of", "a stream")
    if kind != "host" and comm.size > 1 and device.stream.is_capturing():
        _capturable(comm, kind, name, device.device_id)
    return kind, flat(a, name), device


def _capturable(comm: Any, kind: str, name: str, device_id: int) -> None:
    """Raise RuntimeError unless a call on ``kind`` arrays can be captured in a CUDA graph: only a
    ring kernel's (one launch; the host-driven transports wait on the host between steps, which a
    capture refuses), and only once the ring's transports and its executor on GPU ``device_id`` are
    set up (a collective set-up that synchronises the GPU: before the capture, as for NCCL's
    communicators)."""
    link = comm._transports.get(kind)
    if link is None or link.kernel and device_id not in comm._executors:
        raise RuntimeError(
            f"{name}: its stream is capturing a CUDA graph, but this communicator has not set up its GPU "
            f"transports (or its ring kernel on GPU {device_id}) yet, a collective set-up that synchronises the "
            "GPU: make one GPU call on that GPU on every rank before the capture"
        )
    if not link.kernel:
        why = link.note or f"its transport is {link.name}, which waits on the host between steps"
        raise RuntimeError(
            f"{name}: its stream is capturing a CUDA graph, and only a ring kernel's calls can be captured "
            f"(RINGCOMM_TRANSPORT=kernel, on a ring of IPC edges whose kernels run at once); this ring: {why}"
        )


def _output(out: Any, kind: str, dtype: np.dtype, count: int | None, device: Any, name: str = "out") -> Any:
    """The flat view of a user-given output, checked for kind, dtype, size (unless None), writability.

    ``device``: the input's (from _input); a GPU DLPack ``out`` is imported on its stream.
    """
    okind, o = ("host", out) if type(out) is np.ndarray else classify(out, name, device.stream)
    if okind != kind:
        raise TypeError(f"{name}: the input is a {kind} array but {name} is a {okind} array; use one kind for both")
    if kind != "host":
        _on_device(o.data.device_id, device, f"{name}: the array is on", "an array")
    if o.dtype != dtype:
        raise TypeError(f"{name}: dtype {o.dtype} differs from the input's {dtype}; pass an array of dtype {dtype}")
    if count is not None and o.size != count:
        raise ValueError(f"{name}: has {o.size} elements, expected {count}")
    writable(o, name)
    return flat(o, name)


def _on_device(where: int, device: Any, what: str, other: str) -> None:
    """RuntimeError unless GPU ``where`` (-1: any) is the call's, CuPy's current device: its kernels
    could not touch another GPU's memory without peer access, nor be launched on its streams.
    ``what``: the message's subject ("x: the array is on"); ``other``: what to pass instead."""
    if where not in (-1, device.device_id):
        raise RuntimeError(
            f"{what} GPU {where}, but the current device is GPU {device.device_id}: make GPU {where} current "
            f"(cupy.cuda.Device({where}).use(), torch.cuda.set_device) or pass {other} of GPU {device.device_id}"
        )


def _accumulating(comm: Any, accumulate: Any, dtype: np.dtype) -> bool:
    """Whether this call adds in float32 (accumulate="float32", or RINGCOMM_ACCUMULATE, on a half type)."""
    mode = accumulate if comm.accumulate_override == "" else comm.accumulate_override
    return mode is not None and parse_accumulate(mode) == "float32" and dtype in HALF_DTYPES


def _root(comm: Any, root: Any) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
        raise ValueError(f"root must be an integer rank in [0, {comm.size}); got {root!r}")
    return int(root)


def _small_host(comm: Any, x: Any, op: Any, out: Any) -> Any:
    """The fast lane of a small all-reduce of numpy arrays whose gather is cached: when every check
    of all_reduce passes at a glance (a usable communicator without check=True or float32
    accumulation, a known op that suits the dtype, x contiguous and still within small_bytes,
    written arrays writable, out of x's dtype and size and apart from x, or x itself) and the
    DEBUG log is off, it runs the call (what _launch does, less what the lane refused: the
    agreement, the log line) and returns its result, else None: the full path then runs, with
    its checks, their messages and its log line."""
    small = comm._gathers.get(("host", x.size, x.dtype))
    op = OPS.get(op) if isinstance(op, str) else None  # (a ReduceOp is a str; anything else: the full path's error)
    if small is None or op is None or x.nbytes > comm.small_bytes or not _lanes_open(comm):
        return None
    flags = x.flags
    if not flags.c_contiguous or (op is AVG and x.dtype.kind in "iu"):  # (a cached dtype is supported)
        return None
    src = x if x.ndim == 1 else x.reshape(-1)
    if out is None or out is x:
        if not flags.writeable:
            return None
        work = src
    elif (work := _lane_out(comm, x, flags, out, x.size)) is None:
        return None
    ctx, run = small.lanes.get(op) or small.lane(comm, op)
    _run_lane(comm, ctx, run, work, src)
    return x if out is None else out


def _lane_out(comm: Any, x: Any, flags: Any, out: Any, count: int, apart: bool = True) -> Any:
    """For a fast lane: the flat view of ``out`` when it is what the full path would take as the
    output of ``count`` elements of x (``flags``: x's) apart from x (a numpy array of x's dtype,
    C-contiguous, writable; ``apart`` False: wherever it lies), else None."""
    if type(out) is not np.ndarray or out.dtype is not x.dtype and out.dtype != x.dtype or out.size != count:
        return None
    owned, flags = flags.owndata, out.flags
    if not flags.c_contiguous or not flags.writeable:
        return None
    if apart and (out is x or not (owned and flags.owndata)):  # (two arrays that own their memory are apart)
        # Two arrays found apart stay apart: from NumPy 2 a view's address never changes (its
        # data cannot be reassigned), nor its bytes while it stays contiguous (checked above)
        # (measured: 0.1 us less than may_share_memory)
        seen = comm._apart if _FIXED_ADDRESSES else None
        if seen is None or seen[0]() is not x or seen[1]() is not out:
            if np.may_share_memory(out, x):
                return None
            comm._apart = ref(x), ref(out)
    return out if out.ndim == 1 else out.reshape(-1)


def _lanes_open(comm: Any) -> bool:
    """Whether a fast lane may run a call now: a usable communicator without check=True, an
    accumulation override (RINGCOMM_ACCUMULATE) or the DEBUG log (the full path's agreement,
    dtype rule and log line)."""
    return not (
        comm._aborted or comm.check or comm._late_error is not None or comm.accumulate_override or _debug(DEBUG)
    )


def _new_lane(comm: Any, plan: Any, collective: str, dtype: np.dtype, op: ReduceOp | None, root: int) -> tuple:
    """``(ctx, run)``: a lane for later calls like one that just ran the cached ``plan``
    (Communicator._lanes): a Context of its own, which its calls reuse, and the plan's run bound
    to it."""
    ctx = Context(collective, comm, comm._host, dtype, op)
    ctx.root = root
    return ctx, partial(plan.run, ctx)


def _lane_address(plan: Any, work: Any) -> int | None:
    """Where a lane's ``work`` must lie for the lane to run ``plan`` again: anywhere (None) for the
    window's plans, at ``work``'s address for a Plan (bound to its buffers' addresses, as the
    Communicator finds it; a call elsewhere takes the full path, which finds or makes its plan)."""
    return span(work)[0] if plan.by_address else None


def _run_lane(comm: Any, ctx: Context, run: Any, work: Any, src: Any) -> None:
    """Run a fast lane's call: numbered as _launch does it, then ``run(work, src)`` on the lane's
    ``ctx`` (Communicator._execute's work: an error aborts, _failed)."""
    comm._calls += 1
    ctx.call, ctx.tag = comm._calls, None
    try:
        comm.bytes_sent += run(work, src)
    except BaseException as e:
        comm._failed(ctx, e)


def _kernel_lane(comm: Any, key: tuple, x: Any, a: tuple, stream: Any) -> tuple | None:
    """``(lane, call)``: the lane ``key`` of GPU calls like one that a ring kernel ran before
    (:func:`_keep_kernel_lane`) and the launch its executor keeps, when a call on ``x`` (``a``: its
    arrays.lane_buffer) may take it now: the lanes open, the launch still kept, no kernel failure
    recorded (by any of the communicator's executors, as _usable polls them), CuPy's current device
    the lane's and x's, and ``stream`` one that arrays.lane_stream picks without an import; the
    lane's device then runs on it. Else None: the full path runs, with its checks, their messages
    and its log line."""
    lane = comm._lanes.get(key)
    if lane is None or not _lanes_open(comm):
        return None
    ctx, ex, at, steps, _ = lane
    call, device = ex.calls.get(at), ctx.device
    if call is None or call[0] is not steps or a[3] != device.device_id:
        return None
    if ex.cupy.cuda.runtime.getDevice() != device.device_id:
        return None
    if any(e.err[0] for e in comm._executors.values()):
        return None
    on = lane_stream(x, stream, device.device_id)
    if on is None:
        return None
    device.stream = on
    return lane, call


def _gpu_out(out: Any, x: Any, a: tuple, count: int, apart: bool = True) -> int | None:
    """The address of ``out`` where a kernel lane takes it as the result of ``count`` elements of a
    call on ``x`` (``a``: its lane_buffer): an array of x's type that lane_buffer takes, of x's
    dtype, device and that size, apart from x (``apart`` False: wherever it lies). Else None."""
    o = lane_buffer(out) if type(out) is type(x) else None
    if o is None or o[1] != count or o[2] != a[2] or o[3] != a[3]:
        return None
    return o[0] if not apart or _apart(a, o) else None


def _apart(a: tuple, b: tuple) -> bool:
    """Whether the buffers ``a`` and ``b`` (lane_buffer's) share no byte."""
    return a[0] + a[1] * a[2].itemsize <= b[0] or b[0] + b[1] * b[2].itemsize <= a[0]


def _known(op: Any) -> ReduceOp | None:
    """The ReduceOp a lane's key names for ``op`` (None where parse_op would refuse it or must say more)."""
    return OPS.get(op) if isinstance(op, str) else None


def _run_kernel_lane(comm: Any, found: tuple, work: int, src: int, own: int = 0, scratch: int | None = None) -> None:
    """Run a kernel lane's call (``found``: :func:`_kernel_lane`'s): numbered as _launch does it,
    its kept launch queued (executor.launch) with the buffers at these addresses (``scratch``, a
    count: ``work`` is the communicator's scratch of that many elements instead, taken and done
    around it as the full path does)."""
    (ctx, ex, at, _, _), call = found
    device = ctx.device
    if scratch is not None:
        work = comm._scratch_array("cuda", device, scratch, ctx.dtype).data.ptr
    comm._calls += 1
    ctx.call = comm._calls
    try:
        comm.bytes_sent += ex.launch(at, call, device, work, src, 0, own)
    except BaseException as e:
        comm._failed(ctx, e)
    if scratch is not None:
        comm._scratch_done("cuda", device)


def _keep_kernel_lane(
    comm: Any,
    key: tuple,
    ctx: Context,
    steps: Any,
    bounds: Any,
    in_place: bool,
    result_chunks: Any = (),
    own: str | None = None,
    extra: Any = None,
) -> None:
    """After a GPU call that the ring kernel ran (``ctx``: its Context; ``steps`` to ``own`` what it
    gave RingExecutor.run, ``own`` the way alone), the lane ``key`` of the calls like it
    (:func:`_kernel_lane`): a Context and a device of its own, the executor's key of the launch, and
    ``extra``, what the collective's lane needs (its shard's bounds). At most LANES lanes are kept
    (past it all are dropped, the host's too, and made again by the next full-path calls)."""
    if len(comm._lanes) >= LANES and key not in comm._lanes:
        comm._lanes.clear()
    ex = comm._executors[ctx.device.device_id]
    lane_ctx = Context(ctx.collective, comm, get_device("cuda"), ctx.dtype, ctx.op)
    lane_ctx.root = ctx.root
    at = ex.key(lane_ctx, steps, bounds, in_place, result_chunks, own)
    comm._lanes[key] = (lane_ctx, ex, at, steps, extra)


def _kernel_ran(comm: Any, kind: str, wide: bool) -> bool:
    """Whether a GPU call that went the full path (not through the host) ran as a ring kernel, whose
    lane the next such call may take (not with accumulate="float32": its partial sums' scratch)."""
    return kind == "cuda" and not wide and comm._transport(kind).kernel


def all_reduce(
    comm: Any, x: Any, op: ReduceOp | str = "sum", *, out: Any = None, stream: Any = None, accumulate: str | None = None
) -> Any:
    """Reduce ``x`` over all ranks; the result is in ``out`` or, when out is None, in place in ``x``.

    Returns the result array (``out``, or ``x`` itself). Every rank ends with bitwise identical
    values. GPU arrays run on ``stream`` (default: CuPy's current stream). ``accumulate``:
    None, or "float32": float16/bfloat16 partial sums travel and are added in float32 and each
    result is rounded once (no effect on other dtypes; env ``RINGCOMM_ACCUMULATE`` overrides).
    """
    if accumulate is None:
        if type(x) is np.ndarray and stream is None:
            done = _small_host(comm, x, op, out)
            if done is not None:
                return done
        elif (a := lane_buffer(x)) is not None:  # the kernel lane: in place, or out apart from x
            found = _kernel_lane(comm, ("kernel all_reduce", a[1], a[2], _known(op), out is None), x, a, stream)
            work = None if found is None else a[0] if out is None else _gpu_out(out, x, a, a[1])
            if work is not None:
                _run_kernel_lane(comm, found, work, a[0])
                return x if out is None else out
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
    shared = comm._shared if kind == "host" else None
    if comm._via_host(kind, src.nbytes):
        _through_host(comm, ctx, count, src, 0, work, partial(all_reduce, comm, op=op, accumulate=accumulate))
    elif kind == "host" and 1 < n and src.nbytes <= comm.small_bytes and (shared is None or src.nbytes <= shared.small):
        # Latency-bound: gather every rank's whole buffer (engine.GatherFold; in shared memory on
        # one node), then fold the N blocks locally in the ring's order (bitwise the ring's result).
        # With a window, what its slots cannot hold goes to its inbox (Communicator._run) or the
        # ring, never to an MPI gather: ranks whose small_bytes differ then meet in the window,
        # whose headers tell a slot from an inbox (a MismatchError, not a timeout)
        small = comm._gather_plan(ctx, count)
        acc = comm._partial_sums(kind, device, count) if wide else None
        comm._launch(ctx, count, -1, False, small.algorithm, small.link, n - 1, small.run, work, src, acc)
        if wide:
            comm._scratch_done((kind, "partial sums"), device)
    else:
        steps, chunks = schedule.all_reduce(n, r), comm._in_ring(schedule.partition(count, n))
        comm._run(ctx, kind, count, steps, chunks, work, src, result_chunks=range(n))
        if (out is None) == (work is src) and _kernel_ran(comm, kind, wide):
            key = ("kernel all_reduce", count, src.dtype, op, out is None)
            _keep_kernel_lane(comm, key, ctx, steps, chunks, work is src, range(n))
    return x if out is None else out


def _through_host(comm: Any, ctx: Context, count: int, src: Any, at: int, result: Any, host_call: Any) -> None:
    """A small GPU collective on a transport that waits on the host anyway (Communicator._via_host):
    ``src`` is copied to a pinned host stage of ``count`` elements at element ``at``, once the
    stream's earlier work is done; ``host_call(stage)`` runs the host's collective on the stage (the
    shared-memory window's plans on one node, MPI's across nodes) and returns the host array to
    copy into ``result`` (None: nothing to copy back), which is queued on the stream. Bitwise the
    GPU ring's result (the kernels' arithmetic is the host's, bit for bit: csrc/), with one host
    wait where the ring pays N-1 or more steps, each a kernel, a host wait for it and MPI messages
    (250-300 us an all-reduce at N = 2 on an H200, where MPI's copy, host sum and copy back took
    30 us). The stage is reused: a call's copy into it waits on the GPU for the last call's copy
    out of it, and the host wait (also where nothing is copied in) for that copy to be done."""
    device, key = ctx.device, (ctx.device.name, "host stage")
    stage = comm._scratch_array(key, device, count, src.dtype, pinned=True)
    if _debug(DEBUG):
        logging.getLogger("ringcomm").debug(
            "%s: rank %d/%d: %d B of GPU memory through the host (copied out, the host's collective, copied back; "
            "small_bytes %d)",
            ctx.collective,
            comm.rank,
            comm.size,
            stage.nbytes,
            comm.small_bytes,
        )
    device.to_host(
        stage[at : at + src.size], src, ctx, "this rank's GPU work before the call, and its copy to the host"
    )
    done = host_call(stage)
    if result is not None:
        device.from_host(result, done)
    comm._scratch_done(key, device)


def reduce_scatter(
    comm: Any, x: Any, op: ReduceOp | str = "sum", *, out: Any = None, stream: Any = None, accumulate: str | None = None
) -> Any:
    """Reduce ``x`` over all ranks and return this rank's shard ``shard_bounds(x.size)[rank]``.

    ``x`` is not modified. ``out`` (optional) must have the shard's size and x's dtype.
    ``accumulate``: as for :meth:`all_reduce`.
    """
    if accumulate is None and (a := lane_buffer(x)) is not None:
        # the kernel lane: a fresh result, or an out apart from x (the kernel's last reductions write it)
        found = _kernel_lane(comm, ("kernel reduce_scatter", a[1], a[2], _known(op)), x, a, stream)
        if found is not None:
            lo, hi = found[0][-1]
            into = None if out is None else _gpu_out(out, x, a, hi - lo)
            if out is None or into is not None:
                result = found[0][0].device.empty(hi - lo, a[2]) if out is None else out
                _run_kernel_lane(comm, found, 0, a[0], result.data.ptr if out is None else into, scratch=a[1])
                return result
    if type(x) is np.ndarray and stream is None and accumulate is None and isinstance(op, str):
        # the lane of a count, dtype and op that ran in the window (see broadcast): x contiguous, a
        # fresh result or an out of the shard's size (one that shares x's memory is folded into a
        # fresh array first and copied, as the full path does through its scratch, but at 2 ranks
        # x's own shard: see below)
        lane = comm._lanes.get(("reduce_scatter", x.size, x.dtype, OPS.get(op)))
        if lane is not None and _lanes_open(comm) and (flags := x.flags).c_contiguous:
            ctx, run, lo, hi = lane
            result = np.empty(hi - lo, x.dtype) if out is None else _lane_out(comm, x, flags, out, hi - lo, apart=False)
            if result is not None:
                into = (
                    result
                    if out is None
                    or not np.may_share_memory(result, x)
                    or (comm.size == 2 and span(result)[0] == span(x)[0] + lo * x.itemsize)
                    else np.empty(hi - lo, x.dtype)
                )
                _run_lane(comm, ctx, run, into, x if x.ndim == 1 else x.reshape(-1))
                if into is not result:
                    result[...] = into
                return out if out is not None else result
    op = parse_op(op)
    kind, src, device = _input(comm, x, "x", op, stream)
    wide = _accumulating(comm, accumulate, src.dtype)
    bounds = schedule.partition(src.size, comm.size)  # comm.shard_bounds, as a tuple
    lo, hi = bounds[comm.rank]
    result = device.empty(hi - lo, src.dtype) if out is None else _output(out, kind, src.dtype, hi - lo, device)
    ctx = Context("reduce_scatter", comm, device, src.dtype, op)
    ctx.wide = wide
    steps = schedule.reduce_scatter(comm.size, comm.position)  # place p ends with chunk p: its own shard
    chunks = comm._in_ring(bounds)
    plan = None if wide else comm._window_plan(ctx, kind, src.size, steps, chunks, -1)
    if comm._via_host(kind, src.nbytes):  # (into the stage's own shard: the host path allows it)
        _through_host(
            comm,
            ctx,
            src.size,
            src,
            0,
            result,
            lambda stage: reduce_scatter(comm, stage, op, out=stage[lo:hi], accumulate=accumulate),
        )
    elif plan is not None:  # the window folds this rank's chunk straight into the result, unless out aliases x
        # (but at 2 ranks out may be x's own shard: its fold is one op, whose last operand is that shard)
        into = (
            result
            if relation(result, src) == "apart" or comm.size == 2 and relation(result, src[lo:hi]) == "same"
            else comm._scratch_array(kind, device, hi - lo, src.dtype)
        )
        comm._launch(ctx, src.size, -1, False, plan.algorithm, comm._transport(kind), plan.steps, plan.run, into, src)
        if into is not result:
            device.copy(result, into)
            comm._scratch_done(kind, device)
        comm._lanes["reduce_scatter", src.size, src.dtype, op] = (
            *_new_lane(comm, plan, "reduce_scatter", src.dtype, op, -1),
            lo,
            hi,
        )
    else:
        work = comm._scratch_array(kind, device, src.size, src.dtype)
        # a ring kernel reduces this rank's chunk straight into the result (one launch), when the result
        # lies apart from x or is x's own chunk (read by that last reduction alone, element by element)
        kernel = kind != "host" and comm._transport(kind).kernel
        into = kernel and (relation(result, src) == "apart" or relation(result, src[lo:hi]) == "same")
        own = (result, "out") if into else None
        comm._run(ctx, kind, src.size, steps, chunks, work, src, result_chunks=[comm.position], own=own)
        if own is None:
            device.copy(result, work[lo:hi])
        comm._scratch_done(kind, device)
        if own is not None and not wide:
            key = ("kernel reduce_scatter", src.size, src.dtype, op)
            _keep_kernel_lane(comm, key, ctx, steps, chunks, False, [comm.position], "out", (lo, hi))
    return out if out is not None else result


def all_gather(comm: Any, shard: Any, *, out: Any = None, stream: Any = None) -> Any:
    """Concatenate every rank's ``shard`` in rank order; returns ``out`` (allocated when None).

    With ``out`` given, shard sizes follow ``shard_bounds(out.size)`` and ``shard`` may be the view
    of ``out`` at this rank's bounds (in place). With out None, shards may have any sizes.
    """
    if type(out) is type(shard) and (a := lane_buffer(shard)) is not None and (o := lane_buffer(out)) is not None:
        # the kernel lane: shard apart from out (the kernel sends it and copies it into out), or in
        # place: this rank's place in out (a shard starting in out: the full path's errors otherwise)
        in_place = a[1] > 0 and o[0] <= a[0] < o[0] + o[1] * o[2].itemsize
        found = _kernel_lane(comm, ("kernel all_gather", o[1], o[2], in_place), shard, a, stream)
        if found is not None and a[2:] == o[2:]:
            lo, hi = found[0][-1]
            if a[1] == hi - lo and (a[0] == o[0] + lo * o[2].itemsize if in_place else _apart(a, o)):
                _run_kernel_lane(comm, found, o[0], o[0], 0 if in_place else a[0])
                return out
    if type(shard) is np.ndarray and stream is None and type(out) is np.ndarray:
        # the lane of an out's count and dtype whose cached plan ran (see broadcast): shard
        # contiguous, of its size, and apart from out, or in place: this rank's place in out (a
        # view of out's memory at its address; the full path refuses any other overlap)
        lane = comm._lanes.get(("all_gather", out.size, out.dtype))
        if lane is not None and _lanes_open(comm) and (flags := shard.flags).c_contiguous:
            ctx, run, lo, hi, at = lane
            in_place = (base := shard.base) is not None and (base is out or base is out.base)
            work = _lane_out(comm, shard, flags, out, out.size, apart=not in_place) if shard.size == hi - lo else None
            if work is not None:  # (contiguous: its address can be read)
                where = span(work)[0] if in_place or at is not None else None
                if (at is None or where == at) and (not in_place or span(shard)[0] == where + lo * out.itemsize):
                    if not in_place:
                        work[lo:hi] = shard if shard.ndim == 1 else shard.reshape(-1)
                    _run_lane(comm, ctx, run, work, work)
                    return out
    kind, src, device = _input(comm, shard, "shard", None, stream)
    n, r = comm.size, comm.rank
    ctx = Context("all_gather", comm, device, src.dtype, None)
    agreed, place = False, "apart"  # place: how shard lies to this rank's place in out
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
        mine = work[lo:hi]
        place = relation(mine, src)
        if place != "same" and relation(work, src) != "apart":
            raise ValueError(f"shard overlaps out but is not out[{lo}:{hi}] (this rank's place in out)")
    else:
        # Shard sizes are only known to their owners: exchange them (this is the agreement check too).
        sizes = comm._guarded(lambda: comm._agree(ctx, "all_gather", 0, -1, extra=src.size))[:, -1]
        agreed = True
        stops = np.cumsum(sizes)
        bounds = tuple((int(b - s), int(b)) for b, s in zip(stops, sizes))
        work = device.empty(int(stops[-1]), src.dtype)
        lo, hi = bounds[r]
        mine = work[lo:hi]
    if out is not None and comm._via_host(kind, work.nbytes):  # (out None: sizes only known once agreed)
        _through_host(comm, ctx, count, src, lo, work, lambda stage: all_gather(comm, stage[lo:hi], out=stage))
        return out
    # a ring kernel sends this rank's shard from where it lies, and copies it into out (one launch)
    own = (src, "in") if place != "same" and kind != "host" and comm._transport(kind).kernel else None
    if place != "same" and own is None:
        device.copy(mine, src)
    steps = schedule.all_gather(n, comm.position)
    chunks = comm._in_ring(bounds)
    plan = comm._run(ctx, kind, work.size, steps, chunks, work, work, agreed=agreed, own=own)
    if out is not None and _kernel_ran(comm, kind, False):
        key = ("kernel all_gather", work.size, src.dtype, place == "same")
        _keep_kernel_lane(comm, key, ctx, steps, chunks, True, (), None if own is None else "in", (lo, hi))
    if plan is not None and out is not None:  # (the bounds of out's count: those of later such calls)
        comm._lanes["all_gather", work.size, src.dtype] = (
            *_new_lane(comm, plan, "all_gather", src.dtype, None, -1),
            lo,
            hi,
            _lane_address(plan, work),
        )
    return out if out is not None else work


def broadcast(comm: Any, x: Any, root: int = 0, *, stream: Any = None) -> Any:
    """Copy root's ``x`` into ``x`` on every rank (in place); returns ``x``."""
    if type(root) is int and (a := lane_buffer(x)) is not None:  # the kernel lane
        found = _kernel_lane(comm, ("kernel broadcast", a[1], a[2], root), x, a, stream)
        if found is not None:
            _run_kernel_lane(comm, found, a[0], a[0])
            return x
    if type(x) is np.ndarray and stream is None and type(root) is int:
        # The fast lane of a host broadcast of a count, dtype and root whose cached plan ran before
        # (so checked then; the window's, or a Plan when x lies where it did): the checks that
        # depend on x, then the call, numbered as _launch would (not when the full path has more
        # to do: see _small_host).
        lane = comm._lanes.get(("broadcast", x.size, x.dtype, root))
        if lane is not None and _lanes_open(comm):
            flags = x.flags
            ctx, run, at = lane
            if flags.c_contiguous and (flags.writeable or comm.rank == root) and (at is None or span(x)[0] == at):
                buf = x if x.ndim == 1 else x.reshape(-1)
                _run_lane(comm, ctx, run, buf, buf)
                return x
    root = _root(comm, root)
    kind, buf, device = _input(comm, x, "x", None, stream)
    if comm.rank != root:  # the root's x is only read
        writable(buf, "x (broadcast writes root's data into x)")
    n = comm.size
    nchunks = schedule.chain_chunks(n, buf.size, buf.itemsize, comm.slice_bytes)
    ctx = Context("broadcast", comm, device, buf.dtype, None)
    if comm._via_host(kind, buf.nbytes):  # (the root copies out, the others back)
        mine = comm.rank == root
        _through_host(
            comm, ctx, buf.size, buf if mine else buf[:0], 0, None if mine else buf, partial(broadcast, comm, root=root)
        )
        return x
    steps, pieces = (
        schedule.broadcast(n, comm.position, comm.ring.index(root), nchunks),
        schedule.partition(buf.size, nchunks),
    )
    plan = comm._run(ctx, kind, buf.size, steps, pieces, buf, buf, root=root)
    if _kernel_ran(comm, kind, False):
        _keep_kernel_lane(comm, ("kernel broadcast", buf.size, buf.dtype, root), ctx, steps, pieces, True)
    if plan is not None:  # cached: the next such call takes the lane
        comm._lanes["broadcast", buf.size, buf.dtype, root] = (
            *_new_lane(comm, plan, "broadcast", buf.dtype, None, root),
            _lane_address(plan, buf),
        )
    return x


def reduce(
    comm: Any,
    x: Any,
    op: ReduceOp | str = "sum",
    root: int = 0,
    *,
    out: Any = None,
    stream: Any = None,
    accumulate: str | None = None,
) -> Any:
    """Reduce ``x`` onto ``root``: its result goes to ``out`` or in place in ``x`` and is returned.

    On the other ranks ``x`` and ``out`` are left unchanged and None is returned.
    ``accumulate``: as for :meth:`all_reduce`.
    """
    if accumulate is None and type(root) is int and (a := lane_buffer(x)) is not None:
        # the kernel lane: in place at the root, or out apart from x
        found = _kernel_lane(comm, ("kernel reduce", a[1], a[2], _known(op), root, out is None), x, a, stream)
        work = None if found is None else a[0] if out is None else _gpu_out(out, x, a, a[1])
        if work is not None:
            if comm.rank != root:  # (its partial sums in the scratch)
                _run_kernel_lane(comm, found, 0, a[0], scratch=a[1])
                return None
            _run_kernel_lane(comm, found, work, a[0])
            return x if out is None else out
    if type(x) is np.ndarray and stream is None and accumulate is None and isinstance(op, str) and type(root) is int:
        # the lane of a count, dtype, op and root that ran in the window (see broadcast): x
        # contiguous, out None or apart from x; in place at the root (x writable) the root folds
        # from a copy of x, as the full path does
        lane = comm._lanes.get(("reduce", x.size, x.dtype, OPS.get(op), root))
        if lane is not None and _lanes_open(comm) and (flags := x.flags).c_contiguous:
            is_root, src = comm.rank == root, x if x.ndim == 1 else x.reshape(-1)
            if out is not None:  # (own None: the full path, with its messages)
                into = _lane_out(comm, x, flags, out, x.size)
                own = None if into is None else src
            else:
                into, own = (src, src.copy()) if is_root and flags.writeable else (None, None if is_root else src)
            if own is not None:
                ctx, run = lane
                _run_lane(comm, ctx, run, into if is_root else None, own)
                return (x if out is None else out) if is_root else None
    op = parse_op(op)
    root = _root(comm, root)
    kind, src, device = _input(comm, x, "x", op, stream)
    wide = _accumulating(comm, accumulate, src.dtype)
    n, is_root = comm.size, comm.rank == root
    o = None if out is None else _output(out, kind, src.dtype, src.size, device)
    rel = "same" if o is None else relation(o, src)
    if rel == "overlap":
        raise ValueError("out partly overlaps x; pass out=None (in place at the root) or a separate array")
    if is_root and rel == "same":
        writable(src, "x (reduce writes the result into x at the root when out is None)")
    nchunks = schedule.chain_chunks(n, src.size, src.itemsize, comm.slice_bytes)
    ctx = Context("reduce", comm, device, src.dtype, op)
    ctx.wide = wide
    steps = schedule.reduce(n, comm.position, comm.ring.index(root), nchunks)
    pieces = schedule.partition(src.size, nchunks)
    plan = None if wide else comm._window_plan(ctx, kind, src.size, steps, pieces, root)
    if comm._via_host(kind, src.nbytes):  # (the root's result copied back, in place or into out)
        _through_host(
            comm,
            ctx,
            src.size,
            src,
            0,
            ((src if rel == "same" else o) if is_root else None),
            partial(reduce, comm, op=op, root=root, accumulate=accumulate),
        )
    elif plan is not None:  # the root folds the others' buffers and its own (last) straight into its result
        into, own = (None, src) if not is_root else (o, src) if rel == "apart" else (src, None)
        if own is None:  # in place: its own buffer is read after the result is first written: fold a copy
            own = comm._scratch_array(kind, device, src.size, src.dtype)
            device.copy(own, src)  # (before the publication, beside the others' copies in)
        comm._launch(ctx, src.size, root, False, plan.algorithm, comm._transport(kind), plan.steps, plan.run, into, own)
        if own is not src:
            comm._scratch_done(kind, device)
        comm._lanes["reduce", src.size, src.dtype, op, root] = _new_lane(comm, plan, "reduce", src.dtype, op, root)
    else:
        work = comm._scratch_array(kind, device, src.size, src.dtype) if not is_root else src if rel == "same" else o
        chunks = range(nchunks) if is_root else ()
        comm._run(ctx, kind, src.size, steps, pieces, work, src, result_chunks=chunks, root=root)
        if not is_root:
            comm._scratch_done(kind, device)
        if (out is None) == (rel == "same") and _kernel_ran(comm, kind, wide):
            key = ("kernel reduce", src.size, src.dtype, op, root, out is None)
            _keep_kernel_lane(comm, key, ctx, steps, pieces, work is src, chunks)
    if not is_root:
        return None
    return x if out is None else out
