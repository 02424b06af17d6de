"""Bad arguments raise clear TypeError/ValueError on the local rank, before any communication."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_comm
from mpi4py import MPI

import ringcomm
from ringcomm import ReduceOp
from ringcomm.devices import HostDevice
from ringcomm.ops import parse_op


class FakeCudaArray:
    """Looks like a GPU array (has __cuda_array_interface__) without needing a GPU."""

    def __init__(self, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (0, False), "version": 3}


@pytest.fixture(scope="module")
def comm():
    return make_comm()


def test_public_names():
    assert issubclass(ringcomm.TimeoutError, ringcomm.RingcommError)
    assert issubclass(ringcomm.TimeoutError, TimeoutError)
    assert issubclass(ringcomm.MismatchError, ringcomm.RingcommError)
    assert [o.value for o in ReduceOp] == ["sum", "prod", "min", "max", "avg"]
    assert parse_op("SUM") is ReduceOp.SUM and parse_op(ReduceOp.MAX) is ReduceOp.MAX


def test_ops_and_dtypes(comm):
    x = np.arange(4, dtype=np.float32)
    with pytest.raises(ValueError, match="unsupported op 'mean'.*sum, prod, min, max, avg"):
        comm.all_reduce(x, "mean")
    with pytest.raises(ValueError, match="unsupported op"):
        comm.reduce_scatter(x, 3)
    with pytest.raises(TypeError, match="avg.*integer dtype int32"):
        comm.all_reduce(np.arange(4, dtype=np.int32), "avg")
    with pytest.raises(TypeError, match="unsupported dtype complex64; accepted: float16, bfloat16"):
        comm.all_reduce(np.zeros(4, np.complex64))
    with pytest.raises(TypeError, match="unsupported dtype bool"):
        comm.broadcast(np.zeros(4, bool))
    with pytest.raises(TypeError, match="expected a numpy array.*got builtins.list"):
        comm.all_reduce([1.0, 2.0])


def test_memory_layout(comm):
    x = np.zeros((4, 4), np.float32)
    with pytest.raises(TypeError, match=r"shape \(4, 2\).*not C-contiguous.*ascontiguousarray"):
        comm.all_reduce(x[:, ::2])
    with pytest.raises(TypeError, match="not C-contiguous"):
        comm.all_gather(x.T, out=np.zeros(16, np.float32))
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        comm.all_reduce(ro)
    assert comm.broadcast(ro) is ro  # the root's x is only read, so read-only is fine there
    assert comm.all_reduce(ro, out=np.zeros(8, np.float32)).sum() == 0  # out of place reads only
    assert comm.reduce_scatter(ro).size == 8


def test_out_arguments(comm):
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="out: has 9 elements, expected 10"):
        comm.all_reduce(x, out=np.zeros(9, np.float32))
    with pytest.raises(TypeError, match="dtype float64 differs from the input's float32"):
        comm.all_reduce(x, out=np.zeros(10, np.float64))
    with pytest.raises(ValueError, match="partly overlaps"):
        big = np.ones(20, np.float32)
        comm.all_reduce(big[:10], out=big[5:15])
    with pytest.raises(ValueError, match="out: has 3 elements, expected 10"):
        comm.reduce_scatter(x, out=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"shard: has 3 elements, but rank 0's shard of out \(10 elements\)"):
        comm.all_gather(np.zeros(3, np.float32), out=np.zeros(10, np.float32))
    ro = np.zeros(10, np.float32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="out: the array is read-only"):
        comm.all_reduce(x, out=ro)


def test_root_and_stream(comm):
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"root must be an integer rank in \[0, 1\); got 1"):
        comm.broadcast(x, root=1)
    with pytest.raises(ValueError, match="root must be"):
        comm.reduce(x, root=-1)
    with pytest.raises(ValueError, match="root must be"):
        comm.reduce(x, root=True)
    with pytest.raises(TypeError, match="stream= applies to GPU arrays only"):
        comm.all_reduce(x, stream=object())


def test_host_and_gpu_arrays_do_not_mix(comm, monkeypatch):
    from ringcomm import arrays, collectives

    # without CuPy a GPU array cannot even be looked at: that is its own clear error
    monkeypatch.setattr(arrays, "_cupy", lambda name: (_ for _ in ()).throw(TypeError(f"{name}: ... needs CuPy")))
    with pytest.raises(TypeError, match="out: ... needs CuPy"):
        comm.all_reduce(np.ones(4, np.float32), out=FakeCudaArray(4))
    # with CuPy, a GPU out beside a numpy x (and the reverse) is refused before any communication
    monkeypatch.setattr(collectives, "classify", lambda a, name, stream=None: ("cuda", np.ones(4, np.float32)))
    with pytest.raises(TypeError, match="the input is a host array but out is a cuda array; use one kind for both"):
        collectives._output(FakeCudaArray(4), "host", np.dtype(np.float32), 4, HostDevice())


def test_shard_bounds(comm):
    assert comm.shard_bounds(0) == [(0, 0)]
    assert comm.shard_bounds(37) == [(0, 37)]
    with pytest.raises(ValueError, match="non-negative integer"):
        comm.shard_bounds(-1)
    with pytest.raises(ValueError, match="non-negative integer"):
        comm.shard_bounds(2.5)


def test_communicator_arguments(monkeypatch):
    with pytest.raises(TypeError, match="intracommunicator"):
        ringcomm.Communicator("world")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ringcomm.Communicator(MPI.COMM_WORLD, timeout=0)
    monkeypatch.setenv("RINGCOMM_TIMEOUT", "2.5")
    monkeypatch.setenv("RINGCOMM_CHECK", "1")
    monkeypatch.setenv("RINGCOMM_SLICE_BYTES", "4096")
    monkeypatch.setenv("RINGCOMM_SMALL_BYTES", "0")
    c = ringcomm.Communicator(MPI.COMM_WORLD, timeout=100)
    assert (c.timeout, c.check, c.slice_bytes, c.small_bytes) == (2.5, True, 4096, 0)
    monkeypatch.setenv("RINGCOMM_CHECK", "maybe")
    with pytest.raises(ValueError, match="RINGCOMM_CHECK='maybe' is not valid"):
        ringcomm.Communicator(MPI.COMM_WORLD)
    monkeypatch.delenv("RINGCOMM_CHECK")
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="RINGCOMM_TRANSPORT='carrier-pigeon' is not a transport"):
        ringcomm.Communicator(MPI.COMM_WORLD)
    assert repr(c).startswith("<ringcomm.Communicator rank 0 of 1")


def test_single_rank_results(comm):
    """N = 1: every collective is the identity (AVG included), in place and out of place."""
    x = np.random.default_rng().standard_normal(33)
    assert comm.all_reduce(x.copy(), "avg").tobytes() == x.tobytes()
    assert comm.all_reduce(x, out=np.empty_like(x)).tobytes() == x.tobytes()
    assert comm.reduce_scatter(x).tobytes() == x.tobytes()
    assert comm.all_gather(x).tobytes() == x.tobytes()
    assert comm.reduce(x, out=np.empty_like(x)).tobytes() == x.tobytes()
    assert comm.broadcast(x.copy()).tobytes() == x.tobytes()
    comm.barrier()


def test_close_and_context_manager():
    with make_comm() as c:
        assert (c.all_reduce(np.ones(3)) == 1).all()
    with pytest.raises(ringcomm.RingcommError, match="closed by Communicator.close"):
        c.all_reduce(np.ones(3))
    c.close()  # a second close does nothing


def test_an_array_interface_that_raises_is_not_taken_for_one(comm):
    class Raises:  # PyTorch's __cuda_array_interface__ raises TypeError for bfloat16 tensors
        @property
        def __cuda_array_interface__(self):
            raise TypeError("dtype not supported by the interface")

    with pytest.raises(TypeError, match="expected a numpy array.*got .*Raises"):
        comm.all_reduce(Raises())


def test_single_process_parts_import_without_mpi():
    import subprocess
    import sys

    code = "import sys, ringcomm, ringcomm.schedule, ringcomm.devices; assert 'mpi4py.MPI' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
