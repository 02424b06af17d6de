"""ringcomm's host all_reduce against mpi4py's Allreduce on the same MPI, in the same run.

Run under MPI::

    mpiexec -n 4 python benchmarks/host_allreduce.py            # float32, 8 B .. 256 MiB
    mpiexec -n 2 python benchmarks/host_allreduce.py -b 64M -e 64M

For each size: out-of-place and in-place (MPI_IN_PLACE), the median over iterations of the
slowest rank's time per call after warm-up (one barrier, then the calls back to back, each timed
from the previous call's completion to its own), both implementations on the same buffers and
data, the ratio MPI time / ringcomm time (> 1: ringcomm is faster), and the number of wrong
result elements of each (results checked against an independent numpy reference).
The measuring, checking and data generation are ringcomm.bench's (this script only chooses the
settings and prints its own table). Exit status 1 when a result is wrong, 2 for bad arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from ringcomm.bench import env, report, sizes
from ringcomm.bench.cli import Exit, Out, RankParser, UsageError, add_sweep_options, sweep_settings
from ringcomm.bench.impls import MpiImpl, RingcommImpl
from ringcomm.bench.runner import MODES, Runner, Watchdog, total_wrong
from ringcomm.ops import ReduceOp


def build_parser(quiet: bool) -> RankParser:
    p = RankParser(prog="host_allreduce.py", quiet=quiet, description=__doc__.split("\n\n")[0])
    add_sweep_options(p, maxbytes="256M", iters=50, time_budget=2.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; returns the exit status."""
    from mpi4py import MPI

    quiet = MPI.COMM_WORLD.Get_rank() != 0
    parser = build_parser(quiet)
    try:
        args = parser.parse_args(argv)
        sweep, settings = sweep_settings(args)
    except Exit as e:
        return e.code
    except (UsageError, ValueError) as e:
        return parser.fail(e)

    import ringcomm

    comm = ringcomm.init()
    out = Out(comm.rank)
    watchdog = Watchdog(comm.timeout + 60, comm.rank)
    ring, mpi = RingcommImpl(comm), MpiImpl(comm, "host", cuda_aware=False)
    runner = Runner(comm, [ring, mpi], settings, np, watchdog)
    dtype = np.dtype(np.float32)
    try:
        nodes, per_node = env.node_layout(comm)
        st = settings
        out(
            f"# host_allreduce: ringcomm.all_reduce vs mpi4py Allreduce, {comm.size} ranks "
            f"({nodes} node(s), {per_node} per node), float32 sum, transport {comm.transport_name(np.empty(1, dtype))}"
        )
        out(f"# MPI library: {env.mpi_library()}; ringcomm {ringcomm.__version__}, numpy {np.__version__}")
        out(f"# Time: {st.describe()}; warm-up {st.warmup}, iterations {st.iters}")
        out("# ratio = MPI time / ringcomm time (> 1: ringcomm faster); #wrong = wrong elements summed over ranks")
        keys, group = (
            [("size(B)", 12), ("count", 11)],
            [("ringcomm(us)", 13), ("mpi(us)", 11), ("ratio", 7), ("#wrong(rc)", 11), ("#wrong(mpi)", 12)],
        )
        group_w = sum(w + 1 for _, w in group)
        out("#" + " " * (sum(w + 1 for _, w in keys) - 1) + "".join(m.center(group_w) for m in MODES))
        out("#" + report.cells(keys + group * 2, [name for name, _ in keys + group * 2])[1:])
        rows = []
        counts = sizes.sweep_counts(sweep, dtype.itemsize, "all_reduce", comm.size)
        runner.reserve("all_reduce", max(counts), dtype)
        for count in counts:
            rc_row, mpi_row = runner.run(runner.case("all_reduce", count, dtype, ReduceOp.SUM, 0))
            cells = [str(count * dtype.itemsize), str(count)]
            for mode in MODES:
                a, b = rc_row.results[mode], mpi_row.results[mode]
                cells += [
                    f"{a.time_us:.1f}",
                    f"{b.time_us:.1f}",
                    f"{b.ratio:.2f}" if b.ratio else "N/A",
                    "N/A" if a.wrong is None else str(a.wrong),
                    "N/A" if b.wrong is None else str(b.wrong),
                ]
            out(report.cells(keys + group * 2, cells))
            rows += [rc_row, mpi_row]
        wrong = total_wrong(rows)
        out(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        note = report.budget_note(rows, st.iters, st.warmup)
        if note:
            out(note)
        return 1 if wrong else 0
    finally:
        runner.close()
        mpi.close()
        watchdog.stop()


if __name__ == "__main__":
    sys.exit(main())
