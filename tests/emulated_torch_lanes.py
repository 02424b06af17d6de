"""Kernel lanes for PyTorch CUDA tensors, checked on the emulated GPU (N ranks on one device,
RINGCOMM_TRANSPORT=kernel).

Run by tests/test_torch_dlpack.py under mpiexec with tests/emulated first on PYTHONPATH and the fake
``torch`` of tests/emulated_torch_streams.py (PyTorch's signatures, its DLPack stream exchange and its
refusals). A collective on PyTorch CUDA tensors like a call that a ring kernel ran takes its kernel
lane (collectives._kernel_lane): no DLPack import (``__dlpack__`` is not called), the kernel queued on
PyTorch's current stream, so ordered after PyTorch's work there and before its next, and every result
bitwise the host path's on fresh data. What a lane must not take goes the full path, with its DLPack
exchange or its errors: ``stream=`` a PyTorch stream other than the current one (the exchange makes
it wait for PyTorch's), a tensor that requires grad, a tensor on another device.
"""

from __future__ import annotations

import sys

import cupy
import numpy as np
from conftest import shared_seed
from emulated_torch_streams import Tensor, TorchStream, torch, torch_reads, torch_streams, torch_writes
from mpi4py import MPI

import ringcomm
from ringcomm.communicator import Communicator
from ringcomm.ops import bfloat16

ROUNDS = 4
made: list[Tensor] = []  # every tensor of a round: none may be imported by DLPack on a lane


def view(data: cupy.ndarray, **kw) -> Tensor:
    """A PyTorch CUDA tensor over ``data``."""
    made.append(Tensor(data, **kw))
    return made[-1]


def tensor(values: np.ndarray, **kw) -> Tensor:
    """A PyTorch CUDA tensor holding ``values``, written by PyTorch's kernel on its current stream."""
    t = view(cupy.empty(values.shape, values.dtype), **kw)
    torch_writes(t.data, values)
    return t


def poisoned(count: int, dtype: np.dtype) -> Tensor:
    return tensor(np.full(count, np.nan, np.float32).astype(dtype))


def check_lanes(comm: ringcomm.Communicator, host: ringcomm.Communicator, dtype: np.dtype, full: list) -> list[str]:
    mpi = MPI.COMM_WORLD
    n, r = mpi.size, mpi.rank
    count = 16 * n + 5  # (not a multiple of N)
    lo, hi = comm.shard_bounds(count)[r]
    current = torch.cuda.current_stream(0)
    external = torch.cuda.ExternalStream(current.cuda_stream)  # (a torch.cuda.Stream of the same handle)

    def gather_in_place(x: Tensor) -> Tensor:
        out = poisoned(count, dtype)
        with current._stream:  # (PyTorch's copy of x's shard into its place, on its stream)
            out.data[lo:hi] = x.data[lo:hi]
        return comm.all_gather(view(out.data[lo:hi]), out=out)

    # name: (the call on the PyTorch tensor x, the host path's on x's values)
    cases = {
        "all_reduce in place": (lambda x: comm.all_reduce(x), lambda v: host.all_reduce(v.copy())),
        "all_reduce max into out, stream= torch's current": (
            lambda x: comm.all_reduce(x, "max", out=poisoned(count, dtype), stream=current),
            lambda v: host.all_reduce(v.copy(), "max"),
        ),
        "all_reduce into out, stream= a torch ExternalStream of torch's current": (
            lambda x: comm.all_reduce(x, out=poisoned(count, dtype), stream=external),
            lambda v: host.all_reduce(v.copy()),
        ),
        "all_reduce min in place, 2-D": (
            lambda x: comm.all_reduce(view(x.data.reshape(1, count)), "min"),
            lambda v: host.all_reduce(v.copy(), "min"),
        ),
        "reduce_scatter": (lambda x: comm.reduce_scatter(x), lambda v: host.reduce_scatter(v)),
        "reduce_scatter max into out": (
            lambda x: comm.reduce_scatter(x, "max", out=poisoned(hi - lo, dtype)),
            lambda v: host.reduce_scatter(v, "max"),
        ),
        "all_gather": (
            lambda x: comm.all_gather(view(x.data[lo:hi]), out=poisoned(count, dtype)),
            lambda v: host.all_gather(v[lo:hi].copy(), out=np.empty_like(v)),
        ),
        "all_gather in place": (gather_in_place, lambda v: host.all_gather(v[lo:hi].copy(), out=np.empty_like(v))),
        "broadcast from the last rank": (
            lambda x: comm.broadcast(x, root=n - 1),
            lambda v: host.broadcast(v.copy(), root=n - 1),
        ),
        "reduce min into out at 0": (
            lambda x: comm.reduce(x, "min", root=0, out=poisoned(count, dtype)),
            lambda v: host.reduce(v, "min", root=0, out=np.empty_like(v)),
        ),
    }
    errors = []
    rng = np.random.default_rng(shared_seed(mpi) + r)
    ex = None
    for i in range(ROUNDS):
        for name, (call, host_call) in cases.items():
            what = f"{dtype} round {i}, {name}"
            values = rng.standard_normal(count).astype(dtype)
            made.clear()
            x = tensor(values)
            got, want = call(x), host_call(values)
            if (got is None) != (want is None):
                errors.append(f"{what}: returned {got!r}")
                continue
            if got is not None:  # (reduce_scatter's fresh result: a CuPy array, as the full path's)
                seen = torch_reads(got.data if isinstance(got, Tensor) else got)  # (PyTorch's next kernel)
                if seen.tobytes() != want.tobytes():
                    errors.append(f"{what}: {seen[:3]} differs from the host path's {want[:3]}")
            ex = ex or next(iter(comm._executors.values()))
            if ex.last.stream.ptr != current.cuda_stream:
                errors.append(f"{what}: the kernel went on stream {ex.last.stream.ptr}, not PyTorch's current")
            imported = [t.dlpack_streams for t in made if t.dlpack_streams]
            if i and imported:  # (on the lane: no DLPack import of x, out or the shard)
                errors.append(f"{what}: __dlpack__ was called on the lane ({imported})")
            elif not i and not imported:
                errors.append(f"{what}: the full path imported nothing by DLPack")
    if full != [name.split()[0].strip(",") for name in cases]:  # (the first round's calls only)
        errors.append(f"{dtype}: the full path ran {full}, expected the first round's calls alone")
    return errors


def check_full_path(comm: ringcomm.Communicator, full: list) -> list[str]:
    """What the lanes leave to the full path: ``stream=`` another PyTorch stream (its DLPack exchange
    orders that stream after PyTorch's current one), a tensor that requires grad (PyTorch's
    BufferError), is nested (its RuntimeError), lies on another device, or a tensor or CuPy array
    given a PyTorch stream of another device of the same handle (ringcomm's RuntimeError), all
    before any communication. And a CuPy array on ``stream=`` PyTorch's current stream, or a
    ``torch.cuda.ExternalStream`` of its handle: its lane, on that stream."""
    n, errors, before = MPI.COMM_WORLD.size, [], len(full)
    mine = TorchStream(cupy.cuda.Stream(non_blocking=True))
    values = np.full(64, MPI.COMM_WORLD.rank + 1, np.float32)
    for _ in range(2):
        x = tensor(values)  # (written on PyTorch's current stream)
        comm.all_reduce(x, stream=mine)
        mine.synchronize()  # (that stream alone: the exchange made it wait for PyTorch's write)
        if (x.data._np() != n * (n + 1) // 2).any() or x.dlpack_streams != [mine.cuda_stream]:
            errors.append(f"stream= another torch stream: {x.data._np()[:3]}, __dlpack__ {x.dlpack_streams}")
    if len(full) != before + 2:
        errors.append(f"stream= another torch stream: {len(full) - before} full-path calls of 2")
    elsewhere = {"stream": torch.cuda.current_stream(1)}  # (the handle of PyTorch's current stream on GPU 0)
    refused = (  # (what, the array, the call's keywords, the error)
        ("requires grad", lambda: tensor(values, requires_grad=True), {}, BufferError, "require gradient"),
        ("on GPU 1", lambda: tensor(values, device_index=1), {}, RuntimeError, "but the current device is GPU 0"),
        ("a GPU 1 stream", lambda: tensor(values), elsewhere, RuntimeError, "but the current device is GPU 0"),
        ("a CuPy array, a GPU 1 stream", lambda: cupy.asarray(values), elsewhere, RuntimeError, "current device"),
        ("nested", lambda: tensor(values, is_nested=True), {}, RuntimeError, "NestedTensorImpl"),
    )
    for what, make, kw, error, why in refused:
        for _ in range(2):  # (the second like the first: still refused)
            try:
                comm.all_reduce(make(), **kw)
                errors.append(f"all_reduce, {what}: it ran")
            except error as e:
                if why not in str(e):
                    errors.append(f"all_reduce, {what}: {e}")
    current, before = torch.cuda.current_stream(0), len(full)
    for stream in (current, current, torch.cuda.ExternalStream(current.cuda_stream)):
        x = cupy.asarray(values)
        cupy.cuda.Device().synchronize()
        comm.all_reduce(x, stream=stream)
        current.synchronize()
        ex = next(iter(comm._executors.values()))
        if (x._np() != n * (n + 1) // 2).any() or ex.last.stream.ptr != current.cuda_stream:
            errors.append(f"a CuPy array on stream= torch's current: {x._np()[:3]}, on {ex.last.stream.ptr}")
    if len(full) != before:  # (the all-reduce of 64 float32 in place ran above: its lane)
        errors.append(f"a CuPy array on stream= torch's current: {len(full) - before} full-path calls of 0")
    return errors


def main() -> int:
    mpi = MPI.COMM_WORLD
    host = ringcomm.Communicator(mpi, timeout=30, small_bytes=0)
    full: list[str] = []  # the full-path calls of the communicator under test
    run = Communicator._run

    def counted(self, ctx, *args, **kw):
        if self is not host:
            full.append(ctx.collective)
        return run(self, ctx, *args, **kw)

    Communicator._run = counted
    errors = []
    for current in torch_streams():  # (a new communicator each: the lanes start again on PyTorch's stream)
        comm = ringcomm.Communicator(mpi, timeout=30)
        transport = comm.transport_name(cupy.empty(1, np.float32))
        assert transport == "kernel", transport
        full.clear()
        for dtype in (np.dtype(np.float32), bfloat16):
            try:
                errors += [f"{current}: {e}" for e in check_lanes(comm, host, dtype, full)]
            except Exception as e:  # noqa: BLE001 - report, then fail
                errors.append(f"{current}, {dtype}: {type(e).__name__}: {e}")
            full.clear()
        errors += [f"{current}: {e}" for e in check_full_path(comm, full)]
        comm.check_errors()
        comm.close()
    host.close()
    for e in errors:
        print(f"rank {mpi.rank}: {e}")
    print(f"rank {mpi.rank}: {'FAIL' if errors else 'ok'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
