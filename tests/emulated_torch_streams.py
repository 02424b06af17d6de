"""Which stream a collective on a PyTorch CUDA tensor runs on, checked on the emulated GPU (one rank).

Run by tests/test_torch_dlpack.py with tests/emulated first on PYTHONPATH (the CuPy stand-in,
whose streams are lazy: queued work runs only when something waits for it) and
RINGCOMM_EMULATED_HARNESS set. A fake ``torch`` module stands in for PyTorch's CUDA side with
PyTorch's signatures and behaviour: ``torch.cuda.current_stream(device)`` (a non-blocking stream,
as PyTorch's pool streams are, so not ordered with the null stream; a new Stream object each
call), ``Stream.cuda_stream``, ``device_index`` and ``__cuda_stream__``,
``torch.cuda.ExternalStream(ptr)``, ``Event``, ``torch.from_dlpack`` of a CuPy array (a tensor over
its memory; tests/emulated_torch_lanes.py and benchmarks/gpu_host_cost.py ``--arrays torch`` use
this module as ``torch`` too), and a ``torch.Tensor`` whose
``__cuda_array_interface__`` is version 2 without a "stream" key (raising TypeError for
bfloat16, as PyTorch's does) and whose ``__dlpack__(*, stream=-1, max_version, dl_device, copy)``
makes the consumer's stream wait on PyTorch's current stream unless they are the same stream
(torch/_tensor.py). Every check: PyTorch's "kernel" writes x on its stream, the collective runs,
PyTorch's next "kernel" reads the result on its stream, and only PyTorch's stream is synchronized
(with stream= a CuPy stream of the caller's: only that stream, whose wait the DLPack exchange made).
"""

from __future__ import annotations

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
    """torch.cuda.Stream: ``cuda_stream`` (the cudaStream_t as an int), ``device_index``; equal to
    another of the same stream and device (``torch.cuda.current_stream()`` makes a new one each call)."""

    def __init__(self, stream: cupy.cuda.Stream, device_index: int = 0) -> None:
        self._stream, self.cuda_stream, self.device_index = stream, stream.ptr, device_index

    def wait_event(self, event: TorchEvent) -> None:
        self._stream.wait_event(event._event)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.cuda_stream)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TorchStream):
            return False
        return (other.cuda_stream, other.device_index) == (self.cuda_stream, self.device_index)

    __hash__ = None


class TorchExternalStream(TorchStream):
    def __init__(self, stream_ptr: int, device: object = None) -> None:
        handle = types.SimpleNamespace(__cuda_stream__=lambda: (0, stream_ptr))
        super().__init__(cupy.cuda.Stream.from_external(handle))


class TorchEvent:
    def __init__(self) -> None:
        self._event = cupy.cuda.Event()

    def record(self, stream: TorchStream) -> None:
        self._event.record(stream._stream)


_torch_stream = TorchStream(cupy.cuda.Stream(non_blocking=True))  # not PyTorch's default stream
_default_stream = TorchStream(cupy.cuda.Stream.null)


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
        if self.data.dtype == bfloat16:
            raise TypeError("Got unsupported ScalarType BFloat16")
        return {
            "typestr": self.data.dtype.str,
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
        if self.is_nested:  # (a nested tensor's layout is strided, its numel and data_ptr its buffer's)
            raise RuntimeError("Internal error: NestedTensorImpl doesn't support sizes. Please file an issue.")
        if self.device.index != cupy.cuda.runtime.getDevice():
            raise BufferError("Can't export tensors on a different CUDA device index.")
        if stream is not None and type(stream) is not int:
            raise TypeError("stream must be ``int`` or ``none``")
        if stream == 2:
            raise BufferError("per-thread default stream is not supported.")
        if stream != -1:
            consumer = _default_stream if stream in (None, 1) else TorchExternalStream(stream)
            current = torch.cuda.current_stream()
            if consumer != current:  # "Only synchronize on different streams"
                event = TorchEvent()
                event.record(current)
                consumer.wait_event(event)
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
    """A device argument's index: None (the current device, 0 here), an int, or a torch.device."""
    return 0 if device is None else device if isinstance(device, int) else device.index


torch = types.ModuleType("torch")
torch.Tensor, torch.dtype, torch.strided = Tensor, dtype, strided
torch.from_dlpack = Tensor  # (of a CuPy array: a tensor over its memory)
for _name, _dtype in _DTYPES.items():
    setattr(torch, _name, _dtype)
torch.cuda = types.SimpleNamespace(
    Stream=TorchStream,
    ExternalStream=TorchExternalStream,
    Event=TorchEvent,
    current_stream=lambda device=None: TorchStream(_torch_stream._stream, _index(device)),
    default_stream=lambda device=None: TorchStream(_default_stream._stream, _index(device)),
)
sys.modules["torch"] = torch


# ---------------------------------------------------------------------------------------- checks
def torch_writes(a: cupy.ndarray, values: np.ndarray) -> None:
    """PyTorch's kernel writing ``values`` into ``a``, queued on PyTorch's current stream."""
    with _torch_stream._stream:
        a[...] = cupy.asarray(values)


def torch_reads(a: cupy.ndarray) -> np.ndarray:
    """PyTorch's next kernel copying ``a``, on its stream; then only that stream is synchronized."""
    with _torch_stream._stream:
        seen = a.copy()
    _torch_stream.synchronize()
    return seen._np().copy()  # no cupy-wide flush: what PyTorch's stream saw


def check(comm: ringcomm.Communicator, dtype: np.dtype, stream_kind: str) -> list[str]:
    rng = np.random.default_rng()
    n = 1000
    values = rng.standard_normal(n).astype(dtype)
    src, dst = cupy.empty(n, dtype), cupy.empty(n, dtype)
    dst.set(np.full(n, np.nan, dtype))
    x, y = Tensor(src), Tensor(dst)
    torch_writes(src, values)
    stream = {"default": None, "torch": _torch_stream, "cupy": cupy.cuda.Stream(non_blocking=True)}[stream_kind]
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
    # imported by DLPack (not by the interface, which names no stream), asking with the collective's stream
    want = _torch_stream.cuda_stream if stream_kind != "cupy" else stream.ptr
    for name, t in (("x", x), ("y", y)):
        if t.dlpack_streams != [want]:
            errors.append(f"{what}: {name}.__dlpack__ was called with stream={t.dlpack_streams}, expected [{want}]")
    return errors


def main() -> int:
    errors = []
    for dtype in (np.dtype(np.float32), bfloat16):  # with and without a __cuda_array_interface__
        for stream_kind in ("default", "torch", "cupy"):
            comm = ringcomm.Communicator(MPI.COMM_WORLD, timeout=30)  # one per case: an error aborts it
            try:
                found = check(comm, dtype, stream_kind)
            except Exception as e:  # noqa: BLE001 - report every case, then fail
                found = [f"{dtype} stream={stream_kind}: {type(e).__name__}: {e}"]
            comm.close()
            errors += found
            print(f"{dtype} stream={stream_kind}: {'FAIL' if found else 'ok'}")
    for e in errors:
        print(e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
