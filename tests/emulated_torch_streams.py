"""Which stream a collective on a PyTorch CUDA tensor runs on, checked on the emulated GPU (one rank).

Run by tests/test_torch_dlpack.py with tests/emulated first on PYTHONPATH (the CuPy stand-in,
whose streams are lazy: queued work runs only when something waits for it) and
RINGCOMM_EMULATED_HARNESS set. A fake ``torch`` module stands in for PyTorch's CUDA side with
PyTorch 2.13's signatures and behaviour (torch/cuda/streams.py, torch/cuda/__init__.py,
torch/_tensor.py, torch/utils/dlpack.py):
- ``torch.cuda.current_stream(device=None)`` (a new Stream object each call), by default the legacy
  default stream (handle 0), or the stream made current by ``torch.cuda.set_stream`` or inside
  ``with torch.cuda.stream(s)``; ``default_stream``, ``current_device``;
- streams: ``cuda_stream``, ``device_index``, ``__cuda_stream__``; equal when their device and
  stream id are (a pool stream's id is odd, an ``ExternalStream(ptr, device=None)``'s is even (on a
  GPU the pointer itself, aligned; here 2 x ptr, the emulated handles being small integers): an
  ExternalStream over a pool stream's handle is not equal to it); ``Event(enable_timing=False,
  blocking=False, interprocess=False, external=False)`` and ``record(stream=None)``;
- ``torch.from_dlpack(x, *, device=None, copy=None)`` of a CuPy array: a tensor over its memory on
  its device, whose stream exchange makes PyTorch's current stream wait for CuPy's
  (tests/emulated_torch_lanes.py and benchmarks/gpu_host_cost.py ``--arrays torch`` use this module
  as ``torch`` too);
- a ``torch.Tensor`` whose ``__cuda_array_interface__`` is version 2 without a "stream" key
  (bfloat16 as "<V2"; a RuntimeError for a tensor that requires grad), and whose
  ``__dlpack__(*, stream=-1, max_version, dl_device, copy)`` makes the consumer's stream wait on
  PyTorch's current stream unless they are the same stream, with PyTorch's refusals in its order.
Every check, on PyTorch's legacy default stream and on a pool stream made current: PyTorch's
"kernel" writes x on its stream, the collective runs, PyTorch's next "kernel" reads the result on
its stream, and only PyTorch's stream is synchronized (with stream= a CuPy stream of the
caller's: only that stream, whose wait the DLPack exchange made).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types

import cupy
import numpy as np
from dlpack_producer import KDL_BFLOAT, KDL_CUDA, Producer
from mpi4py import MPI

import ringcomm
from ringcomm.ops import bfloat16


# ----------------------------------------------------------------------------------- fake torch
class TorchStream:
    """torch.cuda.Stream over an emulated CuPy stream: ``cuda_stream`` (the cudaStream_t as an
    int), ``device_index``; equal to another of the same device and stream id (c10's CUDAStream
    ==): the default stream's id is 0, a pool stream's odd (``torch.cuda.current_stream()`` makes a
    new object each call). Made here over a CuPy stream (the tests' stand-in for a new pool stream)."""

    def __init__(self, stream: cupy.cuda.Stream, device_index: int = 0) -> None:
        self._stream, self.cuda_stream, self.device_index = stream, stream.ptr, device_index
        self._id = 0 if stream.ptr == 0 else 2 * stream.ptr + 1

    def wait_event(self, event: TorchEvent) -> None:
        self._stream.wait_event(event._event)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.cuda_stream)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TorchStream):
            return False
        return (other._id, other.device_index) == (self._id, self.device_index)

    def __hash__(self) -> int:
        return hash((self.cuda_stream, self.device_index))


class TorchExternalStream(TorchStream):
    """torch.cuda.ExternalStream(stream_ptr, device=None): a stream made elsewhere, on ``device``
    (None: the current one); its stream id is the handle (c10's getStreamFromExternal)."""

    def __init__(self, stream_ptr: int, device: object = None) -> None:
        handle = types.SimpleNamespace(__cuda_stream__=lambda: (0, stream_ptr))
        super().__init__(cupy.cuda.Stream.from_external(handle), _index(device))
        self._id = 2 * stream_ptr  # (a handle as a pool stream's id would be odd: never equal to one)


class TorchEvent:
    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False
    ) -> None:
        self._event = cupy.cuda.Event(block=blocking, disable_timing=not enable_timing, interprocess=interprocess)

    def record(self, stream: TorchStream | None = None) -> None:
        self._event.record((stream if stream is not None else torch.cuda.current_stream())._stream)


_pool_stream = cupy.cuda.Stream(non_blocking=True)  # a PyTorch pool stream, for the tests to make current
_current: dict[int, cupy.cuda.Stream] = {}  # per device: the stream set_stream made current (else the default)


def _current_stream(device: object = None) -> TorchStream:
    index = _index(device)
    return TorchStream(_current.get(index, cupy.cuda.Stream.null), index)


def _set_stream(stream: TorchStream) -> None:
    _current[stream.device_index] = stream._stream


@contextlib.contextmanager
def _stream_context(stream: TorchStream | None):
    """torch.cuda.stream(stream): ``stream`` current inside the block (None: nothing changes)."""
    if stream is None:
        yield
        return
    before = _current_stream(stream.device_index)
    _set_stream(stream)
    try:
        yield
    finally:
        _set_stream(before)


class dtype:  # noqa: N801 - torch's name
    """torch.dtype: the dtypes below are its only instances."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


strided = object()  # torch.layout's strided
_DTYPES = {name: dtype(name) for name in "float16 bfloat16 float32 float64 bool".split()}
_DTYPES.update((name, dtype(name)) for bits in (8, 16, 32, 64) for name in (f"int{bits}", f"uint{bits}"))


class Tensor:
    """A CUDA tensor over emulated device memory (``data``, a CuPy array), as PyTorch exports one:
    ``dtype``, ``layout``, ``requires_grad``, ``is_contiguous()``, ``data_ptr()``, ``numel()``,
    ``get_device()``, ``is_nested`` as PyTorch's, and ``__dlpack__`` refusing what PyTorch's refuses
    (a tensor that requires grad, not strided, nested, on another device than the current one; a
    stream not an int, or 2) with its errors."""

    def __init__(
        self, data: cupy.ndarray, requires_grad: bool = False, device_index: int = 0, is_nested: bool = False
    ) -> None:
        self.data, self.dlpack_streams = data, []
        self.is_cuda, self.requires_grad, self.layout, self.is_nested = True, requires_grad, strided, is_nested
        self.device = types.SimpleNamespace(type="cuda", index=device_index)
        self.dtype = _DTYPES[data.dtype.name]

    def is_contiguous(self) -> bool:
        return self.data.flags.c_contiguous

    def data_ptr(self) -> int:
        return self.data.data.ptr

    def numel(self) -> int:
        return self.data.size

    def get_device(self) -> int:
        return self.device.index

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.requires_grad:
            raise RuntimeError(
                "Can't get __cuda_array_interface__ on Variable that requires grad. "
                "If gradients aren't required, use var.detach() to get Variable that doesn't require grad."
            )
        return {
            "typestr": "<V2" if self.data.dtype == bfloat16 else self.data.dtype.str,
            "shape": self.data.shape,
            "strides": None,
            "data": (self.data.data.ptr, False),
            "version": 2,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device.index)

    def __dlpack__(self, *, stream=-1, max_version=None, dl_device=None, copy=None):
        self.dlpack_streams.append(stream)
        if self.requires_grad:
            raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
        if self.layout is not strided:
            raise BufferError("Can't export tensors with layout other than torch.strided")
        current_device = cupy.cuda.runtime.getDevice()
        if self.device.index != current_device:
            raise BufferError(
                "Can't export tensors on a different CUDA device index. "
                f"Expected: {self.device.index}. Current device: {current_device}."
            )
        if stream is not None and type(stream) is not int:
            raise TypeError("stream must be ``int`` or ``none``")
        if stream != -1:
            if stream is None or stream == 1:
                consumer = torch.cuda.default_stream()
            else:
                if stream == 2:
                    raise BufferError("per-thread default stream is not supported.")
                if stream == 0:
                    raise AssertionError(f"unsupported stream on CUDA: {stream}.")
                consumer = TorchExternalStream(stream)
            current = torch.cuda.current_stream()
            if consumer != current:  # "Only synchronize on different streams"
                event = TorchEvent()
                event.record(current)
                consumer.wait_event(event)
        if self.is_nested:  # (_C._to_dlpack: a nested tensor's layout is strided, its numel and data_ptr its buffer's)
            raise RuntimeError("Internal error: NestedTensorImpl doesn't support sizes. Please file an issue.")
        bf16 = self.data.dtype == bfloat16
        producer = Producer(
            self.data,
            code=KDL_BFLOAT if bf16 else None,
            bits=16 if bf16 else None,
            device=(KDL_CUDA, self.device.index),
            ptr=self.data.data.ptr,
        )
        return producer.__dlpack__(max_version=max_version)


def _index(device: object) -> int:
    """A device argument's index: None (the current device), an int, "cuda" or "cuda:<i>", or a
    torch.device (``.index``; None: the current device)."""
    if isinstance(device, str):
        device = None if device == "cuda" else int(device.split(":", 1)[1])
    elif device is not None and not isinstance(device, int):
        device = device.index
    return cupy.cuda.runtime.getDevice() if device is None else device


def from_dlpack(ext_tensor: cupy.ndarray, *, device: object = None, copy: object = None) -> Tensor:
    """torch.from_dlpack of a CuPy array: a tensor over its memory, on its device. PyTorch passes
    its current stream there to CuPy's ``__dlpack__``, which makes it wait for CuPy's current
    stream when they differ (CuPy's exchange, done here by an event)."""
    index = ext_tensor.device.id
    consumer, producer = _current_stream(index)._stream, cupy.cuda.get_current_stream()
    if consumer.ptr != producer.ptr:
        event = cupy.cuda.Event()
        event.record(producer)
        consumer.wait_event(event)
    return Tensor(ext_tensor, device_index=index)


torch = types.ModuleType("torch")
torch.Tensor, torch.dtype, torch.strided, torch.from_dlpack = Tensor, dtype, strided, from_dlpack
for _name, _dtype in _DTYPES.items():
    setattr(torch, _name, _dtype)
torch.cuda = types.SimpleNamespace(
    Stream=TorchStream,
    ExternalStream=TorchExternalStream,
    Event=TorchEvent,
    current_stream=_current_stream,
    default_stream=lambda device=None: TorchStream(cupy.cuda.Stream.null, _index(device)),
    set_stream=_set_stream,
    stream=_stream_context,
    current_device=lambda: cupy.cuda.runtime.getDevice(),
)
sys.modules["torch"] = torch


# ---------------------------------------------------------------------------------------- checks
def torch_writes(a: cupy.ndarray, values: np.ndarray) -> None:
    """PyTorch's kernel writing ``values`` into ``a``, queued on PyTorch's current stream."""
    with torch.cuda.current_stream()._stream:
        a[...] = cupy.asarray(values)


def torch_reads(a: cupy.ndarray) -> np.ndarray:
    """PyTorch's next kernel copying ``a``, on its stream; then only that stream is synchronized."""
    current = torch.cuda.current_stream()
    with current._stream:
        seen = a.copy()
    current.synchronize()
    return seen._np().copy()  # no cupy-wide flush: what PyTorch's stream saw


def torch_streams():
    """The cases of PyTorch's current stream: its legacy default stream, as PyTorch starts, and a
    pool stream made current (``torch.cuda.set_stream``), as under ``with torch.cuda.stream(s)``."""
    for name, stream in (("the legacy default stream", None), ("a pool stream", TorchStream(_pool_stream))):
        _current.clear()
        if stream is not None:
            torch.cuda.set_stream(stream)
        yield name
    _current.clear()


def check(comm: ringcomm.Communicator, dtype: np.dtype, stream_kind: str) -> list[str]:
    rng = np.random.default_rng()
    n = 1000
    values = rng.standard_normal(n).astype(dtype)
    src, dst = cupy.empty(n, dtype), cupy.empty(n, dtype)
    dst.set(np.full(n, np.nan, dtype))
    x, y = Tensor(src), Tensor(dst)
    torch_writes(src, values)
    current = torch.cuda.current_stream()
    stream = {"default": None, "torch": current, "cupy": cupy.cuda.Stream(non_blocking=True)}[stream_kind]
    what = f"{dtype} all_reduce(x, out=y, stream={stream_kind})"
    errors = []
    comm.all_reduce(x, out=y, stream=stream)
    if stream_kind == "cupy":  # the caller's own stream: the DLPack exchange orders it after PyTorch's work
        stream.synchronize()
        got = dst._np().copy()
    else:
        got = torch_reads(dst)
    if got.tobytes() != values.tobytes():
        wrong = int(np.count_nonzero(got.view(np.uint8) != values.view(np.uint8)))
        errors.append(
            f"{what}: the result seen on the collective's stream differs from x ({wrong} bytes differ; "
            f"first elements {got[:3]} vs {values[:3]})"
        )
    # imported by DLPack (not by the interface, which names no stream), asking with the collective's
    # stream (CuPy names the legacy default stream 1)
    want = (current.cuda_stream or 1) if stream_kind != "cupy" else stream.ptr
    for name, t in (("x", x), ("y", y)):
        if t.dlpack_streams != [want]:
            errors.append(f"{what}: {name}.__dlpack__ was called with stream={t.dlpack_streams}, expected [{want}]")
    return errors


def main() -> int:
    errors = []
    for current in torch_streams():
        for dtype, stream_kind in itertools.product((np.dtype(np.float32), bfloat16), ("default", "torch", "cupy")):
            comm = ringcomm.Communicator(MPI.COMM_WORLD, timeout=30)  # one per case: an error aborts it
            what = f"PyTorch's current stream {current}, {dtype} stream={stream_kind}"
            try:
                found = [f"{current}: {e}" for e in check(comm, dtype, stream_kind)]
            except Exception as e:  # noqa: BLE001 - report every case, then fail
                found = [f"{what}: {type(e).__name__}: {e}"]
            comm.close()
            errors += found
            print(f"{what}: {'FAIL' if found else 'ok'}")
    for e in errors:
        print(e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
