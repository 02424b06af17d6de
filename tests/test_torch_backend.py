"""ringcomm as a torch.distributed backend (ringcomm.torch): every collective through torch's API.

One parallel test per rank count (N = 2 and 3, one mpiexec launch each) runs all the multi-rank
checks in turn on one default group ("ringcomm") and a Gloo group beside it: every collective, op
and dtype equals Gloo's result (integers, MIN and MAX exactly; float sums, products and averages
within the summation bound of the float64 reference, as Gloo's are) and is bitwise identical on
every rank; async Work; subgroups; the calls ringcomm does not have; ringcomm's errors through torch;
RANK/WORLD_SIZE against MPI's; DDP on ringcomm against DDP on Gloo, and ZeroRedundancyOptimizer
against plain DDP + Adam; then, at N = 2, examples/torch_ddp.py --compare gloo and
benchmarks/torch_allreduce.py run (their main(argv), in the launch's processes: torch starts once).
Single-process tests check the errors off MPI and a world of one.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import io
import os
import re
import socket
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

from conftest import (  # noqa: E402 - after the skip
    ROOT,
    TEST_TIMEOUT,
    assert_identical_on_all_ranks,
    assert_matches,
    gather_all,
    random_input,
    shared_seed,
)
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ringcomm  # noqa: E402
import ringcomm.torch as rtorch  # noqa: E402
from ringcomm.ops import ReduceOp, bfloat16  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=TEST_TIMEOUT)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PROD,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.AVG: ReduceOp.AVG,
}
ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def npy(t: torch.Tensor) -> np.ndarray:
    """A numpy copy of a CPU tensor (bfloat16 as ml_dtypes.bfloat16)."""
    t = t.detach().contiguous()
    return t.view(torch.int16).numpy().view(bfloat16).copy() if t.dtype == torch.bfloat16 else t.numpy().copy()


def tensor(a: np.ndarray) -> torch.Tensor:
    """A torch tensor with a copy of ``a`` (bfloat16 included)."""
    if a.dtype == bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def np_dtype(dtype: torch.dtype) -> np.dtype:
    return bfloat16 if dtype == torch.bfloat16 else np.dtype(str(dtype).replace("torch.", ""))


def is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point


def assert_like_gloo(ours: torch.Tensor, gloo: torch.Tensor, inputs: list[np.ndarray], op: ReduceOp, what: str):
    """Exactly Gloo's result for integers, MIN and MAX; for float sums, products and averages both
    within the summation bound of the float64 reference."""
    a, b = npy(ours), npy(gloo)
    assert ours.dtype == gloo.dtype and ours.shape == gloo.shape, what
    if a.dtype.kind in "iu" or op in (ReduceOp.MIN, ReduceOp.MAX):
        assert a.tobytes() == b.tobytes(), f"{what}: ringcomm {a[:6]} != gloo {b[:6]}"
    else:
        assert_matches(a.ravel(), [x.ravel() for x in inputs], op, what)
        assert_matches(b.ravel(), [x.ravel() for x in inputs], op, f"{what} (Gloo's own result)")


def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------------ multi-rank test
@pytest.mark.parallel(nprocs=[2, 3])
def test_torch_distributed_on_ringcomm(monkeypatch):
    mpi = MPI.COMM_WORLD
    clean_env(monkeypatch)
    check_rank_checks(mpi, monkeypatch)
    # the plain call: ranks from MPI, the store agreed through MPI (no MASTER_ADDR/PORT)
    dist.init_process_group("ringcomm", timeout=TIMEOUT)
    # (no try/finally: a rank whose check fails aborts every rank, conftest.pytest_runtest_makereport;
    # a destroy_process_group of its own would first wait for peers that are elsewhere)
    assert dist.get_backend() == "ringcomm"
    assert (dist.get_rank(), dist.get_world_size()) == (mpi.rank, mpi.size)
    assert isinstance(dist.group.WORLD, rtorch.ProcessGroupRingcomm)
    assert rtorch.communicator().size == mpi.size
    gloo = dist.new_group(backend="gloo", timeout=TIMEOUT)  # on the same store
    rng = np.random.default_rng([shared_seed(mpi), mpi.rank])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch's deprecated names, compared with Gloo's)
        check_stores(mpi)
        check_all_reduce(mpi, gloo, rng)
        check_sharded(mpi, gloo, rng)
        check_rooted(mpi, gloo, rng)
        check_coalesced_and_strided(mpi, rng)
        check_async_work(mpi)
        check_unsupported(mpi)
        check_subgroups(mpi, rng)
        check_errors(mpi)
        check_ddp(mpi, gloo)
        check_zero(mpi)
    check_destroy_after_a_late_error(mpi)
    if mpi.size == 2:
        check_scripts(mpi)  # (each makes its own default group)


def check_destroy_after_a_late_error(mpi: MPI.Intracomm) -> None:
    """destroy_process_group when a group's communicator holds a ring kernel's failure that no call
    raised, on rank 0 alone (injected: the host path has no ring kernels), which its close() raises:
    every group is still shut down on every rank (rank 0 gets a RuntimeWarning instead, so that its
    later groups, WORLD last, close too, and the other ranks do not wait for it), and torch's state
    is reset."""
    sub = dist.new_group(list(range(mpi.size)))
    if mpi.rank == 0:
        rtorch.communicator(sub)._late_error = ringcomm.MismatchError("a ring kernel's failure (injected)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.destroy_process_group()
    assert not dist.is_initialized()
    said = [str(w.message) for w in caught if w.category is RuntimeWarning and "(injected)" in str(w.message)]
    assert len(said) == (mpi.rank == 0), said


def check_rank_checks(mpi: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK/WORLD_SIZE (or rank=/world_size=) that are not MPI's: a ValueError on every rank before
    anything is exchanged, and no process group left behind; where only one rank's are wrong, the
    others raise too (none waits for it). With MASTER_ADDR/MASTER_PORT, torch's own rendezvous runs
    first (other backends' ranks are theirs), and the ringcomm group checks the ranks it gave."""
    n, r = mpi.size, mpi.rank
    port = str(mpi.bcast(_free_port() if r == 0 else None))
    mine = f"but MPI says rank {r} of {n}"
    for env, kwargs, match in (
        ({"RANK": str((r + 1) % n)}, {}, mine),
        ({"WORLD_SIZE": str(n + 1)}, {}, mine),
        ({"RANK": str(r), "WORLD_SIZE": str(n - 1)}, {}, mine),
        ({}, {"rank": (r + 1) % n, "world_size": n}, mine),
        ({"RANK": str(n - 1 if r == 0 else r)}, {}, mine if r == 0 else "another rank's torch rank"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str((r + 1) % n)}, {}, mine),
    ):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=match):
            dist.init_process_group("ringcomm", timeout=TIMEOUT, **kwargs)
        assert not dist.is_initialized()
        for name in env:
            monkeypatch.delenv(name)
    # what MPI says, given explicitly, is accepted (checked by the init below, with RANK/WORLD_SIZE set)
    monkeypatch.setenv("RANK", str(r))
    monkeypatch.setenv("WORLD_SIZE", str(n))
    dist.init_process_group("ringcomm", timeout=TIMEOUT)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [n] * 3
    dist.destroy_process_group()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")


def check_stores(mpi: MPI.Intracomm) -> None:
    """mpi_store: one store seen by every rank, as a file (one node) and over TCP (across nodes)."""
    n, r = mpi.size, mpi.rank
    for kind in ("file", "tcp"):
        store = rtorch.mpi_store(TIMEOUT, kind=kind)
        store.set(f"rank{r}", str(r * r))
        assert [store.get(f"rank{k}") for k in range(n)] == [str(k * k).encode() for k in range(n)], kind
        assert store.add("count", 1) >= 1
        mpi.Barrier()
        assert int(store.get("count")) == n, kind
        mpi.Barrier()  # (before the TCP server, rank 0's, goes)
    with pytest.raises(ValueError, match="kind"):
        rtorch.mpi_store(kind="nfs")


def check_all_reduce(mpi: MPI.Intracomm, gloo, rng: np.random.Generator) -> None:
    n = mpi.size
    for dtype in DTYPES:
        for top, op in OPS.items():
            for count in (0, 1, 17, 1000, 20_003):  # both of ringcomm's algorithms, on one node in its window
                what = f"all_reduce N={n} {dtype} {op} count={count}"
                x = random_input(rng, count, np_dtype(dtype), op)
                if op is ReduceOp.AVG and is_int(dtype):
                    t = tensor(x)
                    with pytest.raises(TypeError, match="avg"):  # (refused before any communication)
                        dist.all_reduce(t, op=top)
                    continue
                inputs = gather_all(mpi, x)
                ours, theirs = tensor(x), tensor(x)
                assert dist.all_reduce(ours, op=top) is None
                dist.all_reduce(theirs, op=top, group=gloo)
                assert_like_gloo(ours, theirs, inputs, op, what)
                assert_identical_on_all_ranks(mpi, npy(ours), what)
    # shapes are kept; a 0-d tensor works
    t = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4)
    dist.all_reduce(t)
    assert t.shape == (2, 3, 4) and torch.equal(t, torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) * n)
    s = torch.tensor(mpi.rank + 1.0)
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    assert s.item() == n


def check_sharded(mpi: MPI.Intracomm, gloo, rng: np.random.Generator) -> None:
    """reduce_scatter_tensor, reduce_scatter (list), all_gather_into_tensor, all_gather (list)."""
    n, r = mpi.size, mpi.rank
    for dtype in DTYPES:
        for m in (1, 16, 17, 100):  # shards of ringcomm's alignment (no copy) and not (padded)
            for top, op in OPS.items():
                if op is ReduceOp.AVG and is_int(dtype):
                    continue
                what = f"reduce_scatter_tensor N={n} {dtype} {op} m={m}"
                x = random_input(rng, n * m, np_dtype(dtype), op)
                inputs = gather_all(mpi, x)
                ours, theirs = torch.empty(m, dtype=dtype), torch.empty(m, dtype=dtype)
                reduce_scatter_single(ours, tensor(x), op=top)
                reduce_scatter_single(theirs, tensor(x), op=top, group=gloo)
                assert_like_gloo(ours, theirs, [a[r * m : (r + 1) * m] for a in inputs], op, what)
                # the list form: input_list[i] (sizes m + i) goes to rank i
                parts = [random_input(rng, m + i, np_dtype(dtype), op) for i in range(n)]
                everyone = [gather_all(mpi, p) for p in parts]
                out = torch.empty(m + r, dtype=dtype)
                dist.reduce_scatter(out, [tensor(p) for p in parts], op=top)
                ref = torch.empty(m + r, dtype=dtype)
                dist.reduce_scatter(ref, [tensor(p) for p in parts], op=top, group=gloo)
                assert_like_gloo(out, ref, everyone[r], op, f"reduce_scatter (list) {what}")
            what = f"all_gather N={n} {dtype} m={m}"
            x = random_input(rng, m, np_dtype(dtype), ReduceOp.SUM)
            inputs = gather_all(mpi, x)
            want = np.concatenate(inputs)
            ours, theirs = torch.empty(n * m, dtype=dtype), torch.empty(n * m, dtype=dtype)
            all_gather_single(ours, tensor(x))
            all_gather_single(theirs, tensor(x), group=gloo)
            assert npy(ours).tobytes() == npy(theirs).tobytes() == want.tobytes(), what
            listed = [torch.empty(m, dtype=dtype) for _ in range(n)]
            dist.all_gather(listed, tensor(x))
            assert b"".join(npy(t).tobytes() for t in listed) == want.tobytes(), f"{what} (list)"
            # uneven sizes (Gloo refuses them): rank i gives m + i elements
            mine = random_input(rng, m + r, np_dtype(dtype), ReduceOp.SUM)
            every = gather_all(mpi, mine)
            uneven = [torch.empty(m + i, dtype=dtype) for i in range(n)]
            dist.all_gather(uneven, tensor(mine))
            assert all(npy(u).tobytes() == e.tobytes() for u, e in zip(uneven, every)), f"{what} (uneven)"
    # any dtype moves as bytes: bool and complex
    for t in (torch.tensor([True, False, r % 2 == 0]), torch.full((5,), complex(r, -r))):
        out = torch.empty(n * t.numel(), dtype=t.dtype)
        all_gather_single(out, t)
        ref = torch.empty_like(out)
        all_gather_single(ref, t, group=gloo)
        assert torch.equal(out, ref), f"all_gather {t.dtype}"
    # in place: the input is this rank's part of the output
    for m in (16, 5):
        out = torch.full((n * m,), -1.0)
        out[r * m : (r + 1) * m] = r
        all_gather_single(out, out[r * m : (r + 1) * m])
        assert torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(m)), f"in-place m={m}"


def check_rooted(mpi: MPI.Intracomm, gloo, rng: np.random.Generator) -> None:
    """broadcast and reduce from every root; barrier."""
    n, r = mpi.size, mpi.rank
    for root in range(n):
        for dtype in [*DTYPES, torch.bool, torch.complex64]:
            if dtype == torch.bool:
                x = torch.from_numpy(rng.integers(0, 2, 33).astype(bool))
            elif dtype == torch.complex64:
                x = torch.from_numpy(rng.standard_normal(33).astype(np.complex64))
            else:
                x = tensor(random_input(rng, 33, np_dtype(dtype), ReduceOp.SUM))
            b = x.clone()
            assert dist.broadcast(b, src=root) is None
            c = x.clone()
            dist.broadcast(c, src=root, group=gloo)
            assert torch.equal(b, c), f"broadcast {dtype} root {root}"
            if dtype in (torch.bool, torch.complex64):
                continue
            for top, op in OPS.items():
                if op is ReduceOp.AVG and is_int(dtype):
                    continue
                y = random_input(rng, 40, np_dtype(dtype), op)
                ys = gather_all(mpi, y)
                ours, theirs = tensor(y), tensor(y)
                dist.reduce(ours, dst=root, op=top)
                dist.reduce(theirs, dst=root, op=top, group=gloo)
                if r == root:
                    assert_like_gloo(ours, theirs, ys, op, f"reduce {dtype} {op} root {root}")
                else:
                    assert npy(ours).tobytes() == y.tobytes(), "reduce changed a tensor off the root"
    dist.barrier()
    # object collectives ride on all_gather and broadcast
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "text": "x" * r})
    assert objs == [{"rank": i, "text": "x" * i} for i in range(n)]
    box = [{"from": r}]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [{"from": n - 1}]


def check_coalesced_and_strided(mpi: MPI.Intracomm, rng: np.random.Generator) -> None:
    """The coalesced forms (one ringcomm call per dtype) and non-contiguous tensors."""
    n, r = mpi.size, mpi.rank
    xs = [
        tensor(random_input(rng, k, np_dtype(d), ReduceOp.SUM))
        for k, d in ((5, torch.float32), (40, torch.int64), (17, torch.float32), (0, torch.float32), (3, torch.int64))
    ]
    singles = [x.clone() for x in xs]
    for s in singles:
        dist.all_reduce(s)
    for how in ("manager", "all_reduce_coalesced"):  # (the second takes one dtype)
        picked = [k for k, x in enumerate(xs) if how == "manager" or x.dtype == torch.float32]
        ts = [xs[k].clone() for k in picked]
        if how == "manager":
            with dist._coalescing_manager():
                for t in ts:
                    dist.all_reduce(t)
        else:
            dist.all_reduce_coalesced(ts)
        for t, k in zip(ts, picked):
            assert_matches(npy(t), gather_all(mpi, npy(xs[k])), ReduceOp.SUM, f"coalesced all_reduce ({how})")
            if is_int(t.dtype):
                assert torch.equal(t, singles[k])
            assert_identical_on_all_ranks(mpi, npy(t), f"coalesced all_reduce ({how})")
    # coalesced all_gather_into_tensor and reduce_scatter_tensor
    ins = [torch.full((m,), float(r * 100 + m)) for m in (3, 16, 1)]
    outs = [torch.empty(n * t.numel()) for t in ins]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins):
            all_gather_single(o, i)
    for o, i in zip(outs, ins):
        m = i.numel()
        assert torch.equal(o, torch.tensor([float(k * 100 + m) for k in range(n)]).repeat_interleave(m))
    big = [torch.arange(n * m, dtype=torch.float64) * (r + 1) for m in (3, 16, 1)]
    res = [torch.empty(t.numel() // n, dtype=torch.float64) for t in big]
    with dist._coalescing_manager():
        for o, i in zip(res, big):
            reduce_scatter_single(o, i)
    for o in res:
        m = o.numel()
        assert torch.equal(o, torch.arange(r * m, (r + 1) * m, dtype=torch.float64) * (n * (n + 1) // 2))
    # non-contiguous tensors: copied to a contiguous buffer and back, the rest untouched
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8) + r
    view = base[:, ::2]
    dist.all_reduce(view)
    want = sum(torch.arange(40, dtype=torch.float32).reshape(5, 8) + k for k in range(n))
    assert torch.equal(base[:, ::2], want[:, ::2]) and torch.equal(
        base[:, 1::2], (torch.arange(40.0).reshape(5, 8) + r)[:, 1::2]
    )
    src = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 10 * r).t()  # (4, 3), not contiguous
    gathered = torch.empty(n, 3, 4).transpose(1, 2)  # (n, 4, 3), not contiguous
    all_gather_single(gathered, src)
    for k in range(n):
        assert torch.equal(gathered[k], (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 10 * k).t())
    wide = torch.ones(n * 4, 2)[:, 0] * (r + 1)  # strided input
    shard = torch.empty(4)
    reduce_scatter_single(shard, wide)
    assert torch.equal(shard, torch.full((4,), float(n * (n + 1) // 2)))
    # a tensor that requires grad (as DDP's parameters): reduced without complaint
    p = torch.ones(4, requires_grad=True)
    dist.broadcast(p, src=0)
    dist.all_reduce(p.data)
    assert p.data.tolist() == [n] * 4


def check_async_work(mpi: MPI.Intracomm) -> None:
    n = mpi.size
    t = torch.ones(8)
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, dist.Work)
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.wait() is True
    fut = work.get_future()
    assert fut.done() and fut.wait()[0] is t and work.result()[0] is t
    assert t.tolist() == [float(n)] * 8
    assert work.get_future().then(lambda f: f.value()[0].sum().item()).wait() == 8 * n
    out = torch.empty(n * 3)
    w = all_gather_single(out, torch.full((3,), float(mpi.rank)), async_op=True)
    assert w.wait() and w.get_future().wait()[0] is out
    assert torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(3))
    b = torch.full((2,), float(mpi.rank))
    dist.broadcast(b, src=n - 1, async_op=True).wait()
    assert b.tolist() == [n - 1.0] * 2
    assert dist.barrier(async_op=True).wait() is True


def check_unsupported(mpi: MPI.Intracomm) -> None:
    """What ringcomm has not: NotImplementedError naming a backend that has it, raised before any
    communication (so every rank goes on); bad arguments: TypeError/ValueError."""
    n, r = mpi.size, mpi.rank
    t = torch.ones(4)
    calls = {
        "send": lambda: dist.send(t, (r + 1) % n),
        "recv": lambda: dist.recv(t, (r - 1) % n),
        "isend": lambda: dist.isend(t, (r + 1) % n),
        "irecv": lambda: dist.irecv(t, (r - 1) % n),
        "gather": lambda: dist.gather(t, [torch.empty(4) for _ in range(n)] if r == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(t, [torch.ones(4) for _ in range(n)] if r == 0 else None, src=0),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n)),
        "all_to_all": lambda: dist.all_to_all([torch.empty(1) for _ in range(n)], [torch.ones(1) for _ in range(n)]),
        "batch_isend_irecv": lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, t, (r + 1) % n)]),
    }
    for call in calls.values():
        with pytest.raises(NotImplementedError, match="gloo or nccl"):
            call()
    with pytest.raises(NotImplementedError, match="BAND"):
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
    with pytest.raises(NotImplementedError, match="reduce op"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    with pytest.raises(TypeError, match="does not reduce torch.bool"):
        dist.all_reduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="must have"):
        all_gather_single(torch.empty(n * 4 + 1), t)
    with pytest.raises(ValueError, match="must have"):
        reduce_scatter_single(torch.empty(3), torch.ones(n * 4))
    with pytest.raises(TypeError, match="dtypes"):  # (torch's all_gather checks that itself: the group's own check)
        dist.group.WORLD.allgather([[torch.empty(4, dtype=torch.float64) for _ in range(n)]], [t])
    with pytest.raises(ValueError, match="elements"):
        dist.all_gather([torch.empty(3) for _ in range(n)], t)
    u = torch.ones(3)
    dist.all_reduce(u)  # every rank raised alone: the group still works
    assert u.tolist() == [n] * 3


def check_subgroups(mpi: MPI.Intracomm, rng: np.random.Generator) -> None:
    """new_group(ranks): a ringcomm communicator over those MPI ranks; the others are non-members."""
    n, r = mpi.size, mpi.rank
    for ranks in ([n - 1, 0], list(range(1, n))):
        members = sorted(ranks)
        sub = dist.new_group(ranks, timeout=TIMEOUT)
        sub_gloo = dist.new_group(ranks, backend="gloo", timeout=TIMEOUT)
        x = random_input(rng, 33, np.dtype(np.float32), ReduceOp.SUM)
        every = gather_all(mpi, x)  # (on every rank: MPI's world)
        if r not in members:
            assert sub == dist.GroupMember.NON_GROUP_MEMBER and dist.get_rank(sub) == -1
            continue
        comm = rtorch.communicator(sub)
        assert (comm.rank, comm.size) == (members.index(r), len(members)) == (dist.get_rank(sub), sub.size())
        ours, theirs = tensor(x), tensor(x)
        dist.all_reduce(ours, group=sub)
        dist.all_reduce(theirs, group=sub_gloo)
        assert_like_gloo(ours, theirs, [every[k] for k in members], ReduceOp.SUM, f"subgroup {members} all_reduce")
        b = torch.full((3,), float(r))
        dist.broadcast(b, src=members[-1], group=sub)  # a global rank, as torch takes it
        assert b.tolist() == [float(members[-1])] * 3
        out = torch.empty(len(members) * 2)
        all_gather_single(out, torch.full((2,), float(r)), group=sub)
        assert out.tolist() == [float(k) for k in members for _ in range(2)]


def check_errors(mpi: MPI.Intracomm) -> None:
    """ringcomm's errors through torch: a MismatchError with pg_options={"check": True}; a rank
    left alone in a collective: ringcomm.TimeoutError, and the others then ringcomm.AbortError."""
    n, r = mpi.size, mpi.rank
    checked = dist.new_group(backend="ringcomm", pg_options={"check": True}, timeout=TIMEOUT)
    with pytest.raises(ringcomm.MismatchError, match="count"):
        dist.all_reduce(torch.ones(5 + r), group=checked)
    t = torch.ones(5)
    dist.all_reduce(t, group=checked)  # a mismatch is found before any data moves: the group goes on
    assert t.tolist() == [n] * 5
    with pytest.raises(TypeError, match="pg_options"):
        dist.new_group(backend="ringcomm", pg_options={"colour": 1})
    short = dist.new_group(backend="ringcomm", timeout=datetime.timedelta(seconds=1))
    big = torch.ones(1 << 18)  # beyond the gather path: two waits (the late ranks see rank 0's abort)
    if r == 0:
        with pytest.raises(ringcomm.TimeoutError, match="waited 1 s"):
            dist.all_reduce(big, group=short)
    mpi.Barrier()
    if r != 0:
        with pytest.raises(ringcomm.AbortError, match="rank 0 aborted"):
            dist.all_reduce(big, group=short)
    with pytest.raises(ringcomm.RingcommError, match="aborted"):
        dist.all_reduce(torch.ones(2), group=short)


def small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(8 + rank, 10, generator=g), torch.randn(8 + rank, 3, generator=g)) for _ in range(steps)]


def train(model: nn.Module, opt, data) -> None:
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_ddp(mpi: MPI.Intracomm, gloo) -> None:
    """20 steps of DDP (several buckets) on ringcomm and on Gloo: the same parameters within float32
    rounding, and ringcomm's bitwise the same on every rank."""
    data = batches(mpi.rank, 20)
    runs = {}
    for name, group in (("ringcomm", None), ("gloo", gloo)):
        model = DDP(small_model(7 + mpi.rank), process_group=group, bucket_cap_mb=0.002)  # (DDP syncs rank 0's)
        train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), data)
        runs[name] = flat_params(model)
    assert_identical_on_all_ranks(mpi, runs["ringcomm"].numpy(), "DDP parameters on ringcomm")
    torch.testing.assert_close(runs["ringcomm"], runs["gloo"], rtol=1e-5, atol=1e-6)
    assert runs["ringcomm"].abs().sum() > 0


def check_zero(mpi: MPI.Intracomm) -> None:
    """ZeroRedundancyOptimizer(Adam) on ringcomm matches DDP + Adam (PyTorch's own parity test, on
    ringcomm), with and without parameters as bucket views; its state consolidates on rank 0."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    data = batches(mpi.rank, 20)
    plain = DDP(small_model(11))
    train(plain, torch.optim.Adam(plain.parameters(), lr=0.01), data)
    for bucket_view in (False, True):
        model = DDP(small_model(11))
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01, parameters_as_bucket_view=bucket_view
        )
        train(model, opt, data)
        torch.testing.assert_close(flat_params(model), flat_params(plain), rtol=1e-6, atol=1e-7)
        assert_identical_on_all_ranks(mpi, flat_params(model).numpy(), f"ZeRO bucket_view={bucket_view}")
        opt.consolidate_state_dict(to=0)
        if mpi.rank == 0:
            assert len(opt.state_dict()["state"]) == len(list(model.parameters()))


# ------------------------------------------------------------------------- single-process tests
def test_refused_when_not_under_mpi(monkeypatch):
    """World size 2 asked of a process that MPI runs alone: a ValueError that says to use mpiexec,
    through the env:// rendezvous and through an explicit store alike."""
    clean_env(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="not under MPI.*mpiexec -n 2"):
        dist.init_process_group("ringcomm")
    clean_env(monkeypatch)
    with pytest.raises(ValueError, match="not under MPI"):
        dist.init_process_group("ringcomm", store=dist.HashStore(), rank=0, world_size=2)
    with pytest.raises(TypeError, match="pg_options"):
        dist.init_process_group("ringcomm", pg_options=["check"])
    assert not dist.is_initialized()


def test_world_of_one(monkeypatch):
    """Without mpiexec and without env: a world of one (the plain call); with MASTER_ADDR and
    MASTER_PORT set, torch's own env:// rendezvous (as torchrun's) runs and ringcomm accepts it."""
    clean_env(monkeypatch)
    dist.init_process_group("ringcomm")
    try:
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "ringcomm")
        t = torch.arange(5.0)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out = torch.empty(5)
        all_gather_single(out, t)
        shard = torch.empty(5)
        reduce_scatter_single(shard, t)
        assert torch.equal(t, torch.arange(5.0)) and torch.equal(out, t) and torch.equal(shard, t)
        assert dist.all_reduce(t, async_op=True).get_future().wait()[0] is t
    finally:
        dist.destroy_process_group()
    port = _free_port()
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    dist.init_process_group("ringcomm", timeout=TIMEOUT)
    try:
        assert isinstance(dist.group.WORLD, rtorch.ProcessGroupRingcomm) and dist.get_world_size() == 1
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ the scripts
def load_script(path: str):
    """A script of the repository as a module (its main(argv) runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"script_{os.path.basename(path)[:-3]}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(mpi: MPI.Intracomm, path: str, argv: list[str]) -> str:
    """``main(argv)`` of a script on every rank (as ``mpiexec -n N python path argv`` runs it, in
    the processes of this launch: no second start of torch); rank 0's output (the others print
    nothing). A non-zero exit status on any rank fails."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = load_script(path).main(argv)
    statuses = mpi.allgather(rc)
    out = mpi.bcast(buf.getvalue())
    assert statuses == [0] * mpi.size, f"{path} {' '.join(argv)}: exit statuses {statuses}\n{out}"
    return out


def check_scripts(mpi: MPI.Intracomm) -> None:
    """examples/torch_ddp.py --compare gloo: every step's loss on ringcomm and on Gloo agree, ringcomm's
    parameters are the same on every rank. benchmarks/torch_allreduce.py at tiny sizes: every row
    measured on ringcomm, Gloo and ringcomm directly, and no wrong element."""
    timeout = ["--timeout", str(TEST_TIMEOUT)]
    out = run_script(mpi, "examples/torch_ddp.py", ["--compare", "gloo", "--steps", "6", "--width", "16", *timeout])
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [int(row[0]) for row in rows] == list(range(1, 7)), out
    for _, ours, gloo, diff in rows:
        a, b = float(ours), float(gloo)
        assert a > 0 and abs(a - b) <= 1e-5 * abs(b) and float(diff) == pytest.approx(abs(a - b), abs=1e-12), out
    assert "parameters bitwise identical on every rank: yes" in out, out
    assert re.search(r"largest relative loss difference \S+ \(at most \S+: yes\)", out), out

    argv = ["-b", "8", "-e", "1K", "-f", "4", "-n", "3", "-w", "1", *timeout]
    out = run_script(mpi, "benchmarks/torch_allreduce.py", argv)
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("#") and "size(B)" in line)[1:].split()
    rows = [dict(zip(header, line.split())) for line in lines if re.match(r"\s+\d+\s", line)]
    assert [int(row["size(B)"]) for row in rows] == [8, 32, 128, 512], out
    wrong = [c for c in header if c.startswith("#wrong(")]
    assert wrong[:2] == ["#wrong(ringcomm)", "#wrong(gloo)"] and wrong[-1] == "#wrong(direct)", out
    for row in rows:
        assert all(row[c] == "0" for c in wrong), out
        assert all(float(row[c]) > 0 for c in ("ringcomm(us)", "gloo(us)", "direct(us)")), out
        assert float(row["overhead(us)"]) == pytest.approx(
            float(row["ringcomm(us)"]) - float(row["direct(us)"]), abs=0.11
        )
    assert "# Out of bounds values : 0 OK" in out, out
