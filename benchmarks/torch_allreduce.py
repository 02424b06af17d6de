"""all_reduce through torch.distributed: the "ringcomm" backend against Gloo (and MPI when torch has it).

Run under MPI::

    mpiexec -n 2 python benchmarks/torch_allreduce.py                 # float32 sum, 8 B .. 64 MiB
    mpiexec -n 4 python benchmarks/torch_allreduce.py -b 1M -e 64M -f 4

One process group per backend in the same processes: the default group on "ringcomm"
(``dist.init_process_group("ringcomm")``), ``dist.new_group(backend="gloo")`` (and "mpi" when
``dist.is_mpi_available()``), all on the same CPU tensors (views of the same buffers, the same
data). For each size: the median over iterations of the slowest rank's time per
``dist.all_reduce(t, group=...)`` (in place: torch's all_reduce has no other form), the ratio
baseline time / ringcomm's (> 1: ringcomm through torch is faster), the time of calling ringcomm's
``comm.all_reduce`` directly on the numpy view of the same buffer (the communicator behind the
ringcomm group), and the overhead per call of going through torch (ringcomm through torch minus
direct). ``#wrong``: wrong result elements summed over ranks (checked against an independent numpy
reference, by default; ``--check 0`` skips it). The measuring, checking and data are
ringcomm.bench's. Exit status 1 when a result is wrong, 2 for bad arguments.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ringcomm.bench import env, report, sizes
from ringcomm.bench.cli import Exit, Out, RankParser, UsageError, add_sweep_options, sweep_settings
from ringcomm.bench.impls import Prepared, RingcommImpl
from ringcomm.bench.runner import Runner, Watchdog
from ringcomm.ops import ReduceOp


def build_parser(quiet: bool) -> RankParser:
    p = RankParser(prog="torch_allreduce.py", quiet=quiet, description=__doc__.split("\n\n")[0])
    add_sweep_options(p, maxbytes="64M", iters=30, time_budget=1.0)
    p.add_argument(
        "-r",
        "--rounds",
        type=int,
        default=1,
        help="measure every backend this many times, interleaved, and keep each one's fastest (default 1)",
    )
    p.add_argument("--no-gloo", action="store_true", help="leave Gloo out")
    p.add_argument("--timeout", type=float, help="seconds a collective may wait (default: torch's)")
    return p


class TorchImpl:
    """``dist.all_reduce`` on a torch process group, on a CPU tensor over the row's buffer."""

    def __init__(self, name: str, group: Any) -> None:
        self.name, self.group = name, group

    def prepare(self, case: Any, arrays: Any, inplace: bool) -> Prepared | str:
        import torch
        import torch.distributed as dist

        if not inplace:
            return "torch.distributed.all_reduce is in place only"
        t, group = torch.from_numpy(arrays.recv), self.group
        return Prepared(lambda: dist.all_reduce(t, group=group), arrays.recv, lambda: None)


class DirectImpl(RingcommImpl):
    """ringcomm's comm.all_reduce called directly (the communicator behind the ringcomm group)."""

    name = "direct"

    def prepare(self, case: Any, arrays: Any, inplace: bool) -> Prepared | str:
        return super().prepare(case, arrays, inplace) if inplace else "compared in place only"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; returns the exit status."""
    from mpi4py import MPI

    quiet = MPI.COMM_WORLD.Get_rank() != 0
    parser = build_parser(quiet)
    try:
        args = parser.parse_args(argv)
        sweep, settings = sweep_settings(args, rounds=args.rounds)
    except Exit as e:
        return e.code
    except (UsageError, ValueError) as e:
        return parser.fail(e)

    import torch
    import torch.distributed as dist

    import ringcomm
    import ringcomm.torch as rtorch

    timeout = {} if args.timeout is None else {"timeout": datetime.timedelta(seconds=args.timeout)}
    dist.init_process_group("ringcomm", **timeout)
    comm = rtorch.communicator()
    out = Out(comm.rank)
    impls: list[Any] = [TorchImpl("ringcomm", dist.group.WORLD)]
    if not args.no_gloo:
        impls.append(TorchImpl("gloo", dist.new_group(backend="gloo", **timeout)))
    if dist.is_mpi_available():
        impls.append(TorchImpl("mpi", dist.new_group(backend="mpi", **timeout)))
    impls.append(DirectImpl(comm))
    watchdog = Watchdog(comm.timeout + 60, comm.rank)
    runner = Runner(comm, impls, settings, np, watchdog)
    dtype = np.dtype(np.float32)
    base = [i.name for i in impls[1:-1]]
    try:
        nodes, per_node = env.node_layout(comm)
        out(
            f"# torch_allreduce: dist.all_reduce on torch {torch.__version__} process groups, {comm.size} ranks "
            f"({nodes} node(s), {per_node} per node), float32 sum, CPU tensors, in place"
        )
        transport = comm.transport_name(np.empty(1, dtype))
        out(f"# backends: ringcomm {ringcomm.__version__} (transport {transport}), {', '.join(base) or 'none else'}")
        out(f"# MPI library: {env.mpi_library()}")
        out(f"# Time: {settings.describe()}; warm-up {settings.warmup}, iterations {settings.iters}")
        out("# ratio = baseline time / ringcomm's time through torch (> 1: ringcomm faster); direct = ringcomm's")
        out("# comm.all_reduce on the same buffer; overhead = ringcomm through torch - direct; #wrong: over ranks")
        cols = [("size(B)", 12), ("count", 11), ("ringcomm(us)", 13)]
        for name in base:
            cols += [(f"{name}(us)", 11), (f"ratio({name})", 7 + len(name) + 2)]
        cols += [("direct(us)", 11), ("overhead(us)", 13)]
        cols += [(f"#wrong({i.name})", 9 + len(i.name)) for i in impls]
        out("#" + report.cells(cols, [name for name, _ in cols])[1:])
        counts = sizes.sweep_counts(sweep, dtype.itemsize, "all_reduce", comm.size)
        runner.reserve("all_reduce", max(counts), dtype)
        rows, overheads = [], []
        for count in counts:
            got = {
                row.impl: row.results["in-place"]
                for row in runner.run(runner.case("all_reduce", count, dtype, ReduceOp.SUM, 0))
            }
            rc, direct = got["ringcomm"], got["direct"]
            cells = [str(count * dtype.itemsize), str(count), f"{rc.time_us:.1f}"]
            for name in base:
                cells += [f"{got[name].time_us:.1f}", f"{got[name].ratio:.2f}" if got[name].ratio else "N/A"]
            overheads.append(rc.time_us - direct.time_us)
            cells += [f"{direct.time_us:.1f}", f"{overheads[-1]:.1f}"]
            cells += ["N/A" if got[i.name].wrong is None else str(got[i.name].wrong) for i in impls]
            out(report.cells(cols, cells))
            rows.append(got)
        wrong = sum(r.wrong or 0 for got in rows for r in got.values())
        out(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        out(f"# torch overhead per call: median {np.median(overheads):.1f} us over the {len(overheads)} sizes")
        return 1 if wrong else 0
    finally:
        runner.close()
        watchdog.stop()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
