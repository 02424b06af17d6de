"""The CUDA device: ringcomm's own kernels from csrc/, compiled at run time by NVRTC through CuPy.

Every operation is queued on the device's stream and returns at once (the stream orders it after
the work already queued there). Kernels are compiled once per process and device (CuPy's disk
cache, ``~/.cupy/kernel_cache``, keeps the binaries across processes); no nvcc is needed.

Also here: :func:`fused_adam`, one pass of AdamW over a shard (csrc/optimizer.cu).
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import classify, on_stream
from ..ops import FLOAT_DTYPES, HALF_DTYPES, SUPPORTED_DTYPES, ReduceOp, bfloat16
from .host import check_acc_operands

try:  # CuPy is optional: this module imports without it (the cuda extra installs it)
    import cupy
except ImportError:  # pragma: no cover - depends on the machine
    cupy = None

#: Threads per block of every kernel (csrc/common.cuh: RC_BLOCK).
BLOCK = 512
#: 16-byte vectors a thread handles per grid-stride iteration (csrc/common.cuh: RC_UNROLL).
UNROLL = 4
#: Blocks per multiprocessor when the occupancy query is unavailable (csrc/common.cuh: RC_MIN_BLOCKS).
DEFAULT_BLOCKS_PER_SM = 2
#: NVRTC options (the arch is added by CuPy for the current device).
NVRTC_OPTIONS = ("-std=c++17",)

#: numpy dtype -> the suffix of its kernels in csrc/
SUFFIX: dict[np.dtype, str] = {
    np.dtype(np.float16): "f16",
    bfloat16: "bf16",
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.int8): "i8",
    np.dtype(np.uint8): "u8",
    np.dtype(np.int16): "i16",
    np.dtype(np.uint16): "u16",
    np.dtype(np.int32): "i32",
    np.dtype(np.uint32): "u32",
    np.dtype(np.int64): "i64",
    np.dtype(np.uint64): "u64",
}
assert set(SUFFIX) == set(SUPPORTED_DTYPES)

_OP_NAME = {ReduceOp.SUM: "sum", ReduceOp.AVG: "sum", ReduceOp.PROD: "prod", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}
ADAM_MASTER_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
ADAM_GRAD_DTYPES = FLOAT_DTYPES
ADAM_OUT_DTYPES = FLOAT_DTYPES

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([\w.]+)"[ \t]*$', re.M)


def reduce_kernel_names() -> list[str]:
    """Every reduce kernel the device may launch."""
    return [f"ringcomm_reduce_{op}_{s}" for s in SUFFIX.values() for op in ("sum", "prod", "min", "max")]


def accumulate_kernel_names() -> list[str]:
    """Every float32-accumulation kernel (csrc/accumulate.cu) the device may launch."""
    halves = [SUFFIX[d] for d in HALF_DTYPES]
    ops = ("sum", "prod", "min", "max")
    return (
        [f"ringcomm_reduce_acc_{op}_{s}" for s in halves for op in ops]
        + [f"ringcomm_reduce_acc_final_{op}_{s}" for s in halves for op in ops]
        + [f"ringcomm_widen_{s}" for s in halves]
    )


def adam_kernel_names() -> list[str]:
    """Every fused-Adam kernel :func:`fused_adam` may launch."""
    outs = ["none"] + [SUFFIX[d] for d in ADAM_OUT_DTYPES]
    return [
        f"ringcomm_adam_{SUFFIX[p]}_{SUFFIX[g]}_{o}" for p in ADAM_MASTER_DTYPES for g in ADAM_GRAD_DTYPES for o in outs
    ]


# ---------------------------------------------------------------------------------------- sources
def _csrc_text(name: str) -> str:
    """The text of csrc/<name>: from the installed package (ringcomm.csrc), else the source tree."""
    for package, sub in (("ringcomm.csrc", ()), ("ringcomm", ("csrc",))):
        try:
            res = importlib.resources.files(package)
            for part in sub:
                res = res / part
            res = res / name
            if res.is_file():
                return res.read_text(encoding="utf-8")
        except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
            pass
    import ringcomm

    path = Path(ringcomm.__file__).resolve().parent.parent / "csrc" / name
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise FileNotFoundError(f"ringcomm kernel source {name!r} not found in the package (ringcomm.csrc) nor at {path}")


@functools.cache
def kernel_source(name: str) -> str:
    """csrc/<name> with the csrc files it includes pasted in place of their #include, each once
    (as their include guards would have it): what NVRTC compiles.

    Pasting (rather than an include path) keeps CuPy's cache key, which hashes the source text,
    correct when an included file changes.
    """
    pasted: set[str] = set()

    def paste(file: str) -> str:
        pasted.add(file)
        return _INCLUDE.sub(lambda m: "" if m[1] in pasted else paste(m[1]), _csrc_text(file))

    code = paste(name)
    if "common.cuh" not in pasted:
        raise RuntimeError(f"csrc/{name} must include common.cuh")
    return code


_lock = threading.Lock()
_modules: dict[str, tuple[Any, threading.Lock]] = {}  # (module, held while it compiles)
_kernels: dict[str, Any] = {}
_blocks_per_sm: dict[tuple[str, int], int] = {}
_sm_count: dict[int, int] = {}
#: cudaDevAttrMpsEnabled (CUDA's driver_types.h; CuPy does not name it)
MPS_ENABLED = 133


def _require_cupy() -> Any:
    if cupy is None:
        raise ImportError("GPU arrays need CuPy: pip install 'ringcomm[cuda]' (cupy-cuda13x; cupy-cuda12x for CUDA 12)")
    return cupy


#: what a machine with only an NVIDIA driver lacks to compile the kernels, and how to get it
NVRTC_FIX = (
    "ringcomm compiles its kernels at run time with NVRTC, which needs NVRTC and the CUDA headers: "
    "pip install 'ringcomm[cuda]' (cupy-cuda13x[ctk], for a CUDA 13 driver) or 'ringcomm[cuda12]' "
    "(cupy-cuda12x[ctk]), which bring them from PyPI, or install a CUDA toolkit and set CUDA_PATH"
)


def _module_source(file: str, name: str) -> tuple[str, str, tuple[str, ...]]:
    """(module key, code, options) of the module that holds kernel ``name`` of csrc/<file>: the whole
    file, but for ring.cu only the entry ``ringcomm_ring_<op>_<suffix>`` (RC_RING_ONE_ENTRY)."""
    if file != "ring.cu":
        return file, kernel_source(file), NVRTC_OPTIONS
    return name, kernel_source(file) + "\n" + ring_entry(name), NVRTC_OPTIONS + ("-DRC_RING_ONE_ENTRY",)


def ring_entry(name: str) -> str:
    """The line that defines kernel ``ringcomm_ring_<op>_<suffix>`` alone (csrc/ring.cu's kernels are
    compiled one at a time: 48 of them take NVRTC about 40 s), its C type from ring.cu's own list."""
    op, suffix = name.split("_")[2:4]
    listed = re.search(rf"^RC_RING_OPS\({re.escape(suffix)}, ([^)]+)\)$", _csrc_text("ring.cu"), re.M)
    if listed is None:
        raise RuntimeError(f"csrc/ring.cu lists no kernels for dtype suffix {suffix!r}")
    return f"RC_RING_ENTRY({op}, rc::Op{op.capitalize()}, {suffix}, {listed[1]})\n"


def kernel(file: str, name: str) -> Any:
    """The RawKernel ``name`` of csrc/<file>; the first call compiles the whole file (NVRTC; ring.cu:
    that kernel alone).

    A module is compiled once; different modules compile at the same time in different threads
    (NVRTC runs without the GIL: :func:`warm_up`). A compilation that fails (no NVRTC library, no
    CUDA headers) raises RuntimeError saying how to install what is missing.
    """
    k = _kernels.get(name)
    if k is None:
        cp = _require_cupy()
        key, code, options = _module_source(file, name)
        with _lock:
            if key not in _modules:
                _modules[key] = (cp.RawModule(code=code, options=options), threading.Lock())
            mod, compiling = _modules[key]
        with compiling:
            k = _kernels.get(name)
            if k is None:
                try:
                    k = _kernels[name] = mod.get_function(name)  # CuPy compiles here, on first use
                except Exception as e:  # noqa: BLE001 - CuPy raises RuntimeError, CompileException, ...
                    raise RuntimeError(f"compiling csrc/{file} failed ({type(e).__name__}: {e}). {NVRTC_FIX}") from e
    return k


def every_kernel() -> list[tuple[str, str]]:
    """(file, kernel) of one kernel per module ringcomm compiles: each csrc file but ring.cu, and
    every ring kernel (ring.cu's are compiled one at a time)."""
    files = [
        ("reduce.cu", "ringcomm_reduce_sum_f32"),
        ("copy.cu", "ringcomm_copy"),
        ("optimizer.cu", "ringcomm_adam_f32_f32_none"),
        ("accumulate.cu", "ringcomm_widen_f16"),
    ]
    ops = dict.fromkeys(_OP_NAME.values())
    return files + [("ring.cu", f"ringcomm_ring_{op}_{suffix}") for suffix in SUFFIX.values() for op in ops]


def warm_up(jobs: int | None = None) -> None:
    """Compile every kernel for the current device now (NVRTC; CuPy's disk cache keeps the result
    for later processes): each csrc file, and the 48 ring kernels of ``RINGCOMM_TRANSPORT=kernel``,
    which are otherwise compiled at their first use, about 2 s each. ``jobs`` threads compile at
    once (default: the CPUs this process may use)."""
    device = _require_cupy().cuda.runtime.getDevice()

    def compile_one(job: tuple[str, str]) -> None:
        cupy.cuda.runtime.setDevice(device)  # (a new thread's current device is 0: CuPy compiles and loads for it)
        kernel(*job)

    with ThreadPoolExecutor(jobs or len(os.sched_getaffinity(0))) as pool:
        list(pool.map(compile_one, every_kernel()))


def sm_count(device_id: int) -> int:
    """Multiprocessors of the device (cached)."""
    n = _sm_count.get(device_id)
    if n is None:
        rt = cupy.cuda.runtime
        attr = getattr(rt, "cudaDevAttrMultiProcessorCount", 16)
        n = _sm_count[device_id] = int(rt.deviceGetAttribute(attr, device_id))
    return n


def mps_enabled(device_id: int) -> bool:
    """Whether contexts on the device are shared through MPS (cudaDevAttrMpsEnabled; False where the
    driver does not know the attribute)."""
    try:
        return bool(cupy.cuda.runtime.deviceGetAttribute(MPS_ENABLED, device_id))
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


class capture_relaxed:  # noqa: N801 - used as a function
    """While ``stream`` captures, the calling thread's stream capture interaction mode relaxed
    inside the block (cuThreadExchangeStreamCaptureMode, push-pop, as PyTorch's
    CUDAStreamCaptureModeGuard); nothing otherwise. A capture in global or thread-local mode
    (``torch.cuda.graph``'s default is global) prohibits the thread's "unsafe" calls, cudaMalloc,
    event queries and synchronizations among them, and fails and invalidates on one. For what
    ringcomm does outside the graph while a stream captures: its allocations, copies and waits,
    which live as long as the communicator."""

    __slots__ = ("driver", "before")

    def __init__(self, stream: Any) -> None:
        self.driver = None
        if stream.is_capturing():
            try:
                from cuda.bindings import driver
            except ImportError as e:
                raise RuntimeError(
                    "a collective in a CUDA graph capture needs NVIDIA's cuda-bindings: pip install "
                    f"'ringcomm[cuda]' ({e})"
                ) from e
            self.driver = driver

    def __enter__(self) -> None:
        cu = self.driver
        if cu is not None:
            err, self.before = cu.cuThreadExchangeStreamCaptureMode(
                cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
            )
            if int(err) != 0:
                raise RuntimeError(f"cuThreadExchangeStreamCaptureMode returned CUresult {int(err)}")

    def __exit__(self, *exc: object) -> None:
        if self.driver is not None:
            self.driver.cuThreadExchangeStreamCaptureMode(self.before)


def max_blocks(k: Any, name: str, device_id: int) -> int:
    """A full wave of ``k`` on the device: SMs x resident blocks per SM (occupancy query, cached)."""
    key = (name, device_id)
    per_sm = _blocks_per_sm.get(key)
    if per_sm is None:
        try:
            per_sm = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, BLOCK, 0))
        except Exception:  # noqa: BLE001 - the query is an optimisation only
            per_sm = DEFAULT_BLOCKS_PER_SM
        per_sm = _blocks_per_sm[key] = max(1, per_sm)
    return per_sm * sm_count(device_id)


def _grid(k: Any, name: str, device_id: int, items: int) -> int:
    """Blocks for ``items`` units of work per thread-iteration, at most one full wave."""
    return max(1, min(-(-items // BLOCK), max_blocks(k, name, device_id)))


def pointer(a: Any) -> int:
    """The device address of the first element of ``a`` (CuPy array or __cuda_array_interface__)."""
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:
        return int(ptr)
    return int(a.__cuda_array_interface__["data"][0])


def _u64(x: int) -> np.uint64:
    return np.uint64(x)


class LastUse:
    """The event recorded after the last use of a reused buffer, and the stream it was recorded on
    (see :class:`ringcomm.devices.Reused`). The stream object is kept, so that its handle cannot be
    reused by a new stream while the comparison of handles in :meth:`CudaDevice.after` relies on it."""

    __slots__ = ("event", "stream")

    def __init__(self) -> None:
        self.event = cupy.cuda.Event(block=False, disable_timing=True)
        self.stream = None


#: outgrown or dropped reused buffers, each kept until the event of its last use has completed
_retired: list[tuple[Any, LastUse]] = []


# ----------------------------------------------------------------------------------------- device
class CudaDevice:
    """Reduce and copy GPU arrays with ringcomm's kernels, queued on ``stream``.

    ``stream``: a ``cupy.cuda.Stream`` (or anything with ``.ptr``, ``.use()``, ``.synchronize()`` and
    ``.is_capturing()``, such as ``cupy.cuda.ExternalStream``); default: CuPy's current stream.
    Nothing here blocks the host except :meth:`synchronize`.
    """

    name = "cuda"

    def __init__(self, stream: Any = None) -> None:
        cp = _require_cupy()
        self.xp = cp
        self.stream = stream if stream is not None else cp.cuda.get_current_stream()
        self.device_id = int(cp.cuda.runtime.getDevice())
        if "ringcomm_widen_f16" not in _kernels:  # compile outside any hot loop (once per process)
            kernel("reduce.cu", "ringcomm_reduce_sum_f32")
            kernel("copy.cu", "ringcomm_copy")
            kernel("accumulate.cu", "ringcomm_widen_f16")

    def reduce(self, dst: Any, a: Any, b: Any, op: ReduceOp, div: int = 1, spare: bool = False) -> None:
        """``dst[:] = op(a, b)``, then divided by ``div`` when div != 1; queued on the stream.

        1-D contiguous arrays of one dtype and length; ``dst`` may be the same memory as ``a``;
        ``b`` may be a view of a neighbour's memory (CUDA IPC). Half types are combined in float32
        and rounded once, the division included. ``div`` applies to float dtypes only. ``spare``
        (HostDevice's hint that ``b`` may be overwritten) is not used here.
        """
        n = dst.size
        if a.size != n or b.size != n:
            raise ValueError(f"reduce: lengths differ (dst {n}, a {a.size}, b {b.size})")
        dtype = dst.dtype
        if a.dtype != dtype or b.dtype != dtype:
            raise TypeError(f"reduce: dtypes differ (dst {dtype}, a {a.dtype}, b {b.dtype})")
        if n == 0:
            return
        suffix = SUFFIX.get(dtype)
        if suffix is None:
            raise TypeError(f"reduce: unsupported dtype {dtype}; accepted: {', '.join(map(str, SUFFIX))}")
        use_div = div != 1
        if use_div and dtype not in FLOAT_DTYPES:
            raise TypeError(f"reduce: div={div} needs a float dtype, got {dtype} (AVG on integers is refused)")
        name = f"ringcomm_reduce_{_OP_NAME[op]}_{suffix}"
        k = kernel("reduce.cu", name)
        grid = _grid(k, name, self.device_id, -(-n * dtype.itemsize // (16 * UNROLL)))
        k(
            (grid,),
            (BLOCK,),
            (_u64(pointer(dst)), _u64(pointer(a)), _u64(pointer(b)), _u64(n), np.int32(use_div), np.float64(div)),
            stream=self.stream,
        )

    def fold(self, work: Any, pieces: Any, op: ReduceOp, div: int = 1) -> None:
        """For each ``(lo, hi, views)`` of ``pieces``: ``work[lo:hi]`` = the views reduced in their
        order by :meth:`reduce` (the next view first, the partial result second; the last step
        divided by ``div``); queued on the stream (HostDevice.fold)."""
        for lo, hi, views in pieces:
            dst, part = work[lo:hi], views[0]
            for k in range(1, len(views)):
                self.reduce(dst, views[k], part, op, div if k == len(views) - 1 else 1)
                part = dst

    # ---- float32 accumulation (accumulate="float32"; csrc/accumulate.cu): the bits of HostDevice's
    # methods of the same names: every NaN result the positive quiet NaN (float32 0x7fc00000, float16
    # 0x7e00, bfloat16 0x7fc0), MIN / MAX propagate NaN and give a's zero between +0 and -0, float32 ->
    # half rounds to nearest even, subnormals kept, nothing fused.

    def reduce_acc(self, dst: Any, a: Any, b: Any, op: ReduceOp) -> None:
        """``dst[:] = op(float32(a), b)`` in float32, not rounded to a's type; queued on the stream.

        ``a``: float16 or bfloat16 (the local data); ``b`` and ``dst``: float32 (partial sums; ``b``
        may be a view of a neighbour's memory). 1-D contiguous arrays of one length; ``dst`` may be
        the same memory as ``b``. AVG is SUM here (the division comes in :meth:`reduce_acc_final`).
        """
        n = check_acc_operands("reduce_acc", dst, a, b, np.float32)
        if n == 0:
            return
        name = f"ringcomm_reduce_acc_{_OP_NAME[op]}_{SUFFIX[a.dtype]}"
        self._launch_acc(name, n, (_u64(pointer(dst)), _u64(pointer(a)), _u64(pointer(b)), _u64(n)))

    def reduce_acc_final(self, dst: Any, a: Any, b: Any, op: ReduceOp, div: int = 1) -> None:
        """``dst[:] = op(float32(a), b) / div`` rounded once to a's type; queued on the stream.

        ``a`` and ``dst``: float16 or bfloat16 (one dtype; ``dst`` may be the same memory as ``a``);
        ``b``: float32 (the partial sums, possibly a neighbour's memory). The op and the division
        (float32, correctly rounded; only when div != 1) are float32; one rounding to nearest even at
        the end. 1-D contiguous arrays of one length.
        """
        n = check_acc_operands("reduce_acc_final", dst, a, b, a.dtype)
        if n == 0:
            return
        name = f"ringcomm_reduce_acc_final_{_OP_NAME[op]}_{SUFFIX[a.dtype]}"
        self._launch_acc(
            name,
            n,
            (_u64(pointer(dst)), _u64(pointer(a)), _u64(pointer(b)), _u64(n), np.int32(div != 1), np.float32(div)),
        )

    def widen(self, dst: Any, a: Any) -> None:
        """``dst[:] = float32(a)`` (exact; NaN as the positive quiet NaN) for float16 / bfloat16 ``a``, queued
        on the stream."""
        n = check_acc_operands("widen", dst, a, None, np.float32)
        if n == 0:
            return
        self._launch_acc(f"ringcomm_widen_{SUFFIX[a.dtype]}", n, (_u64(pointer(dst)), _u64(pointer(a)), _u64(n)))

    def _launch_acc(self, name: str, n: int, args: tuple) -> None:
        k = kernel("accumulate.cu", name)
        grid = _grid(k, name, self.device_id, -(-n // (4 * UNROLL)))  # a thread moves UNROLL units of 4 elements
        k((grid,), (BLOCK,), args, stream=self.stream)

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[:] = src`` (same number of bytes), queued on the stream; ``src`` may be a peer's memory."""
        nbytes = dst.nbytes
        if src.nbytes != nbytes:
            raise ValueError(f"copy: sizes differ (dst {nbytes} bytes, src {src.nbytes} bytes)")
        if nbytes == 0:
            return
        k = kernel("copy.cu", "ringcomm_copy")
        grid = _grid(k, "ringcomm_copy", self.device_id, -(-nbytes // (16 * UNROLL)))
        k((grid,), (BLOCK,), (_u64(pointer(dst)), _u64(pointer(src)), _u64(nbytes)), stream=self.stream)

    def pinned(self, nbytes: int) -> np.ndarray:
        """A numpy uint8 array of ``nbytes`` over new pinned host memory (which the array keeps alive)."""
        return np.frombuffer(self.xp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)

    def to_host(self, dst: np.ndarray, src: Any, ctx: Any, what: str) -> None:
        """``dst[:] = src`` (pinned ``dst``), copied on the stream after the work queued before it, and
        waited for on the host within the communicator's deadline (``what``: what the error names)."""
        if src.nbytes:
            rt = self.xp.cuda.runtime
            rt.memcpyAsync(dst.ctypes.data, pointer(src), src.nbytes, rt.memcpyDeviceToHost, self.stream.ptr)
        self.synchronize(ctx, None, ctx.comm.rank, what)

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        """``dst[:] = src`` (pinned ``src``), queued on the stream: ``src`` must not change before the
        stream has passed the copy (a :class:`ringcomm.devices.Reused` buffer's event says when)."""
        if src.nbytes:
            rt = self.xp.cuda.runtime
            rt.memcpyAsync(pointer(dst), src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, self.stream.ptr)

    def empty(self, count: int, dtype: Any) -> Any:
        """A new device array from CuPy's pool, allocated on this device's stream.

        CuPy's pool is stream-aware: memory freed by an array goes back to the stream it was
        allocated on, and is reused only by later allocations on that stream, which are ordered
        after its last use there. An array written on this stream must be allocated on it.
        """
        with self.xp.cuda.Device(self.device_id), on_stream(self.stream), capture_relaxed(self.stream):
            return self.xp.empty(int(count), dtype)  # (in a capture: the graph's own, allocated once)

    def synchronize(self, ctx: Any, step: int | None, peer: int, what: str, *args: Any) -> None:
        """Wait until everything queued on the stream is done, polling an event within the
        communicator's deadline (:func:`ringcomm.transports.base.wait_until`): a hung kernel or
        a stream waiting on a stuck neighbour raises ringcomm.TimeoutError instead of hanging."""
        from ..transports.base import wait_until

        event = self.xp.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        wait_until(lambda: event.done, ctx, step, peer, what, *args)

    # ---- reused buffers (ringcomm.devices.Reused): ordered across the streams of successive calls
    def after(self, last: LastUse | None) -> None:
        """Make this device's stream wait for ``last`` (a no-op on the stream that recorded it)."""
        if last is not None and last.stream is not None and last.stream.ptr != self.stream.ptr:
            self.stream.wait_event(last.event)

    def record(self, last: LastUse | None) -> LastUse:
        """Record the end of this call's use of a reused buffer on the stream (in ``last``, or a new one)."""
        if last is None:
            last = LastUse()
        last.event.record(self.stream)
        last.stream = self.stream
        return last

    @staticmethod
    def retire(buf: Any, last: LastUse | None) -> None:
        """Drop the reused buffer ``buf`` once its last use has completed (kept alive until then)."""
        _retired[:] = [(b, u) for b, u in _retired if not u.event.done]
        if last is not None and last.stream is not None and not last.event.done:
            _retired.append((buf, last))


# ------------------------------------------------------------------------------------- fused Adam
def fused_adam(
    master: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    out: Any = None,
    stream: Any = None,
) -> Any:
    """One AdamW step over a shard, in one kernel, queued on ``stream`` (default: the current one).

    PyTorch's AdamW order, ``step`` counted from 1::

        g = grad * grad_scale
        exp_avg    = beta1 * exp_avg    + (1 - beta1) * g
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        master     = master * (1 - lr * weight_decay)
        master     = master - lr * (exp_avg / (1 - beta1**step)) / (sqrt(exp_avg_sq / (1 - beta2**step)) + eps)

    ``master``, ``exp_avg``, ``exp_avg_sq``: float32 or float64 (one dtype), updated in place.
    ``grad``: float16, bfloat16, float32 or float64. ``out`` (optional; float16, bfloat16, float32 or
    float64): receives the updated master cast to its dtype (round to nearest even), e.g. the
    working copy of the parameters. All arrays: GPU, C-contiguous, the same number of elements, not
    overlapping. Arithmetic is in the master dtype. Returns ``out`` if given, else ``master``.
    """
    cp = _require_cupy()
    named = {"master": master, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        named["out"] = out
    views = {}
    for name, x in named.items():
        kind, a = classify(x, name)
        if kind != "cuda":
            raise TypeError(f"fused_adam: {name} is a host array; every array must be on the GPU")
        if not a.flags.c_contiguous:
            raise TypeError(f"fused_adam: {name} is not C-contiguous (shape {a.shape}, strides {a.strides})")
        views[name] = a
    p, g = views["master"], views["grad"]
    if p.dtype not in ADAM_MASTER_DTYPES:
        raise TypeError(f"fused_adam: master has dtype {p.dtype}; accepted: float32, float64")
    for name in ("exp_avg", "exp_avg_sq"):
        if views[name].dtype != p.dtype:
            raise TypeError(f"fused_adam: {name} has dtype {views[name].dtype}; it must match master's {p.dtype}")
    if g.dtype not in ADAM_GRAD_DTYPES:
        raise TypeError(f"fused_adam: grad has dtype {g.dtype}; accepted: float16, bfloat16, float32, float64")
    o = views.get("out")
    if o is not None and o.dtype not in ADAM_OUT_DTYPES:
        raise TypeError(f"fused_adam: out has dtype {o.dtype}; accepted: float16, bfloat16, float32, float64")
    n = p.size
    for name, a in views.items():
        if a.size != n:
            raise ValueError(f"fused_adam: {name} has {a.size} elements, master has {n}")
    spans = sorted((pointer(a), pointer(a) + a.nbytes, name) for name, a in views.items() if a.nbytes)
    for (_, end, x), (start, _, y) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"fused_adam: {x} and {y} overlap in memory; pass separate arrays")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"fused_adam: step must be an integer >= 1 (1 on the first update); got {step!r}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(f"fused_adam: {name} must be in [0, 1); got {value!r}")
    if not float(eps) >= 0.0:
        raise ValueError(f"fused_adam: eps must be >= 0; got {eps!r}")
    result = out if out is not None else master
    if n == 0:
        return result
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    bc1, bc2 = 1.0 - beta1 ** int(step), 1.0 - beta2 ** int(step)
    decay = 1.0 - lr * float(weight_decay)
    oname = "none" if o is None else SUFFIX[o.dtype]
    name = f"ringcomm_adam_{SUFFIX[p.dtype]}_{SUFFIX[g.dtype]}_{oname}"
    k = kernel("optimizer.cu", name)
    s = stream if stream is not None else cp.cuda.get_current_stream()
    dev = int(cp.cuda.runtime.getDevice())
    args = (
        _u64(pointer(p)),
        _u64(pointer(g)),
        _u64(pointer(views["exp_avg"])),
        _u64(pointer(views["exp_avg_sq"])),
        _u64(0 if o is None else pointer(o)),
        _u64(n),
        *(np.float64(x) for x in (lr, beta1, beta2, float(eps), decay, bc1, bc2, float(grad_scale))),
    )
    k((_grid(k, name, dev, n),), (BLOCK,), args, stream=s)
    return result
