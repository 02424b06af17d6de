"""``python -m ringcomm.bench`` / ``ringcomm-bench``: the nccl-tests style bandwidth benchmark.

Run under MPI, e.g. ``mpiexec -n 4 python -m ringcomm.bench -b 8 -e 128M -f 2``. See ``--help`` and
the README's "Benchmarks" section. Exit status: 0 when every result was right, 1 when some were
wrong, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..communicator import PLAN_BYTES
from ..ops import ACCUMULATE, ReduceOp, check_dtype, parse_op
from ..schedule import COLLECTIVES
from . import data, env, report, sizes
from .cli import Exit, Out, RankParser, UsageError
from .runner import Progress, Row, Runner, Settings, Watchdog

IMPLS = ("ringcomm", "nccl", "mpi")
#: Default largest size per device (bytes): the host default keeps a 4-rank run on 2 cores < 1 min.
DEFAULT_MAX = {"host": 64 << 20, "cuda": 128 << 20}
DEFAULT_TIME_BUDGET = {"host": 1.0, "cuda": 2.0}
#: seconds a timed loop lasts at least (--min-time)
DEFAULT_MIN_TIME = 0.02


def build_parser(quiet: bool = False) -> RankParser:
    """The command line (nccl-tests' option letters where they apply)."""
    p = RankParser(
        prog="ringcomm-bench",
        quiet=quiet,
        description="nccl-tests style bandwidth benchmark of ringcomm's collectives against NCCL and MPI, "
        "run under MPI: mpiexec -n 4 python -m ringcomm.bench -b 8 -e 128M -f 2",
        epilog="Sizes take K, M, G suffixes (powers of 1024). Time is the slowest rank's. busbw as in "
        "nccl-tests' doc/PERFORMANCE.md. Exit status 1 when any result is wrong.",
    )
    a = p.add_argument
    a(
        "-c",
        "--collective",
        default="all_reduce",
        choices=COLLECTIVES + ("all",),
        help="collective to measure, or all (default all_reduce)",
    )
    a("-b", "--minbytes", default="8", help="smallest size in bytes (default 8)")
    a(
        "-e",
        "--maxbytes",
        default=None,
        help=f"largest size in bytes (default {sizes.format_size(DEFAULT_MAX['host'])} on host, "
        f"{sizes.format_size(DEFAULT_MAX['cuda'])} on cuda)",
    )
    a("-f", "--stepfactor", type=int, default=None, help="multiply the size by this between rows (default 2)")
    a("-i", "--stepbytes", default=None, help="add this many bytes between rows instead of -f")
    a("-n", "--iters", type=int, default=20, help="timed iterations per row (default 20)")
    a("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations per row (default 5)")
    a("-o", "--op", default="sum", help="reduction: sum, prod, min, max, avg or all (default sum)")
    a(
        "-d",
        "--datatype",
        default="float",
        help="element type: float, half, double, bfloat16, int8, uint8, int16, uint16, int32, uint32, int64, "
        "uint64 (numpy names work too) or all (default float)",
    )
    a("-r", "--root", type=int, default=0, help="root rank of broadcast and reduce (default 0)")
    a("--check", type=int, default=1, choices=(0, 1), help="check every result (default 1)")
    a(
        "--impl",
        default=None,
        help="comma-separated implementations among ringcomm, nccl, mpi (default ringcomm,mpi on host, "
        "ringcomm,nccl,mpi on cuda)",
    )
    a(
        "--device",
        default="auto",
        choices=("auto", "host", "cuda"),
        help="where the buffers live (default: cuda if CuPy sees a GPU, else host)",
    )
    a(
        "--stat",
        default="avg",
        choices=("avg", "median"),
        help="time per call: mean over the timed loop (avg, nccl-tests) or median of per-call times",
    )
    a(
        "--time-budget",
        type=float,
        default=None,
        help="seconds one timed loop may take before slow sizes get fewer iterations; 0 = never "
        "(default 1 on host, 2 on cuda)",
    )
    a(
        "--min-time",
        type=float,
        default=DEFAULT_MIN_TIME,
        help="seconds a timed loop lasts at least (within --time-budget): fast sizes run more than -n iterations, "
        f"so that a stall of the host weighs less; needs -w >= 1; 0 = exactly -n (default {DEFAULT_MIN_TIME:g})",
    )
    a(
        "--rounds",
        type=int,
        default=1,
        help="measure every implementation and mode this many times, interleaved, and report each one's fastest "
        "round (a loop caught in a slow period of a shared host then decides no ratio); default 1",
    )
    a(
        "--timeout",
        type=float,
        default=None,
        help="abort the job when a measurement makes no progress for this many seconds "
        "(default: ringcomm's timeout + 60, i.e. 360 or RINGCOMM_TIMEOUT + 60)",
    )
    a("--seed", type=int, default=0, help="seed of the test data (default 0)")
    a(
        "--nccl-lib",
        metavar="PATH",
        default=None,
        help="the NCCL library (libnccl.so.2) the NCCL rows use: loaded before CuPy's NCCL bindings, which then "
        f"bind to it; its version must be the one cupy.cuda.nccl reports (default: ${env.NCCL_LIB_ENV}, else "
        "CuPy's own NCCL)",
    )
    a(
        "-a",
        "--accumulate",
        default=None,
        choices=ACCUMULATE,
        help="ringcomm's accumulate= for all_reduce, reduce_scatter and reduce: float16/bfloat16 partial sums "
        "travel and are added in float32, rounded once (default: none)",
    )
    a("--json", metavar="FILE", default=None, help="write every row and the environment to FILE")
    a("--plot", metavar="FILE", default=None, help="draw busbw against size per implementation to FILE (PNG)")
    a("--corrupt-for-tests", type=int, default=0, help=argparse.SUPPRESS)
    return p


@dataclasses.dataclass
class Plan:
    """The validated command line (nothing here needs MPI)."""

    collectives: list[str]
    sweep: tuple[int, int | None, int | None, int | None]  # min, max (None: per device), factor, step
    combos: list[tuple[np.dtype, ReduceOp | None]]  # per reducing collective; all_gather/broadcast: op None
    dtypes: list[np.dtype]
    impls: list[str]
    device: str
    settings: Settings
    root: int
    step: str
    skipped: list[str]
    accumulate: str | None = None
    nccl_lib: tuple[str, str] | None = None  # (path, named by): --nccl-lib, else RINGCOMM_NCCL_LIB; None: CuPy's
    sizes: list[int] = dataclasses.field(default_factory=list)
    argv: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        device = args.device
        collectives = list(COLLECTIVES) if args.collective == "all" else [args.collective]
        minb = _size(args.minbytes, "-b/--minbytes")
        maxb = _size(args.maxbytes, "-e/--maxbytes") if args.maxbytes is not None else None
        if args.stepfactor is not None and args.stepbytes is not None:
            raise UsageError("give -f/--stepfactor or -i/--stepbytes, not both")
        step_bytes = _size(args.stepbytes, "-i/--stepbytes") if args.stepbytes is not None else None
        factor = None if step_bytes is not None else (args.stepfactor if args.stepfactor is not None else 2)
        sweep = (minb, maxb, factor, step_bytes)
        sizes.sweep_sizes(minb, maxb if maxb is not None else max(minb, DEFAULT_MAX["host"]), factor, step_bytes)
        if args.datatype.strip().lower() == "all":
            dtypes = list(data.TYPE_NAMES.values())
        else:
            dtypes = [data.parse_dtype(args.datatype)]
        ops = list(ReduceOp) if args.op.strip().lower() == "all" else [parse_op(args.op)]
        combos: list[tuple[np.dtype, ReduceOp | None]] = []
        skipped = []
        for dt in dtypes:
            for op in ops:
                try:
                    check_dtype(dt, op)
                except TypeError as e:
                    if len(dtypes) == 1 and len(ops) == 1:
                        raise UsageError(f"-d {data.type_name(dt)} -o {op}: {e}") from None
                    skipped.append(f"{data.type_name(dt)} {op} (op not defined for the type)")
                    continue
                combos.append((dt, op))
        names = [s.strip().lower() for s in args.impl.split(",")] if args.impl is not None else None
        if names is not None:
            bad = [s for s in names if s not in IMPLS]
            if bad or not names or len(set(names)) != len(names):
                raise UsageError(f"--impl {args.impl!r}: give distinct names among {', '.join(IMPLS)}")
        if args.root < 0:
            raise UsageError(f"-r/--root must be a rank >= 0; got {args.root}")
        if args.time_budget is not None and not args.time_budget >= 0:
            raise UsageError(f"--time-budget must be >= 0 seconds; got {args.time_budget}")
        if args.timeout is not None and not args.timeout > 0:
            raise UsageError(f"--timeout must be > 0 seconds; got {args.timeout}")
        if args.plot is not None:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
        try:
            settings = Settings(
                iters=args.iters,
                warmup=args.warmup_iters,
                check=bool(args.check),
                stat=args.stat,
                time_budget=args.time_budget if args.time_budget is not None else 1.0,
                min_time=args.min_time,
                rounds=args.rounds,
                seed=args.seed,
                corrupt=args.corrupt_for_tests,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        step = f"{step_bytes}(bytes)" if step_bytes is not None else f"{factor}(factor)"
        try:
            nccl_lib = env.nccl_library_named(args.nccl_lib)
        except ValueError as e:
            raise UsageError(str(e)) from None
        return cls(
            collectives,
            sweep,
            combos,
            dtypes,
            names or [],
            device,
            settings,
            args.root,
            step,
            skipped,
            args.accumulate,
            nccl_lib,
        )

    def resolve(self, device: str, args: argparse.Namespace) -> None:
        """Fill in the device-dependent defaults (max size, time budget, implementations)."""
        self.device = device
        minb, maxb, factor, step = self.sweep
        self.sizes = sizes.sweep_sizes(minb, maxb if maxb is not None else max(minb, DEFAULT_MAX[device]), factor, step)
        if args.time_budget is None:
            self.settings = dataclasses.replace(self.settings, time_budget=DEFAULT_TIME_BUDGET[device])
        if not self.impls:
            self.impls = ["ringcomm", "mpi"] if device == "host" else ["ringcomm", "nccl", "mpi"]


def _size(text: str, what: str) -> int:
    try:
        return sizes.parse_size(text)
    except ValueError as e:
        raise UsageError(f"{what}: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default sys.argv[1:]); returns the exit status."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    parser = build_parser(quiet=rank != 0)
    try:
        args = parser.parse_args(argv)
        plan = Plan.from_args(args)
        plan.argv = list(sys.argv[1:] if argv is None else argv)
    except Exit as e:
        return e.code
    except (UsageError, ValueError) as e:
        return parser.fail(e)

    # The NCCL library named by --nccl-lib or RINGCOMM_NCCL_LIB is loaded now, before anything imports CuPy
    # (whose NCCL bindings bind to the first libnccl.so.2 loaded). A failure here is local; the ranks agree on it
    # first thing in _run, before any other communication.
    nccl_lib: env.NcclLibrary | str | None = None
    if plan.nccl_lib is not None:
        try:
            nccl_lib = env.load_nccl_library(*plan.nccl_lib)
        except env.NcclLibraryError as e:
            nccl_lib = str(e)

    import ringcomm

    comm = ringcomm.init()
    if plan.root >= comm.size:
        if rank == 0:
            sys.stderr.write(f"ringcomm-bench: error: -r/--root {plan.root} is not a rank of {comm.size}\n")
        return 2
    watchdog = Watchdog(args.timeout if args.timeout is not None else comm.timeout + 60, comm.rank)
    try:
        return _run(comm, args, plan, watchdog, Out(comm.rank), nccl_lib)
    except Exception:
        # A failure on some ranks would leave the others waiting for them until their deadlines:
        # end the whole job now, as mpi4py's own runner (python -m mpi4py) does.
        traceback.print_exc()
        sys.stderr.write(f"ringcomm-bench: rank {comm.rank} failed; aborting the MPI job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        raise
    finally:
        watchdog.stop()


def _first_error(comm: Any, error: str) -> str:
    """The error of the lowest rank that has one ("" when none has), this rank's own in full, another
    rank's as gathered (cut to ringcomm.records.TEXT_BYTES). Collective: every rank learns it."""
    errors = env.gather_strings(comm, error)
    failed = [r for r, e in enumerate(errors) if e]
    if not failed:
        return ""
    first = failed[0]
    text = error if first == comm.rank else f"rank {first}: {errors[first]}"
    more = len(failed) - 1
    return text + (f" (and {more} other rank{'s' if more > 1 else ''})" if more else "")


def _run(
    comm: Any,
    args: argparse.Namespace,
    plan: Plan,
    watchdog: Watchdog,
    out: Out,
    nccl_lib: env.NcclLibrary | str | None = None,
) -> int:
    watchdog.beat("start-up (device, implementations)")
    error = _first_error(comm, nccl_lib if isinstance(nccl_lib, str) else "")
    if error:
        if comm.rank == 0:
            sys.stderr.write(f"ringcomm-bench: error: {error}\n")
        return 2
    named = nccl_lib if isinstance(nccl_lib, env.NcclLibrary) else None
    cupy, why = env.cupy_module() if args.device in ("auto", "cuda") else (None, "--device host")
    have_gpu = env.all_true(comm, cupy is not None)
    if args.device == "cuda" and not have_gpu:
        if comm.rank == 0:
            sys.stderr.write(f"ringcomm-bench: error: --device cuda, but not every rank has a GPU ({why})\n")
        return 2
    device = "cuda" if have_gpu else "host"
    plan.resolve(device, args)
    xp, stream = np, None
    if device == "cuda":
        env.select_gpu(comm, cupy)
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.use()
        xp = cupy
        unusable = [dt for dt in plan.dtypes if not env.gpu_dtype_ok(cupy, dt)]
        if unusable:
            names = ", ".join(data.type_name(dt) for dt in unusable)
            plan.dtypes = [dt for dt in plan.dtypes if dt not in unusable]
            plan.combos = [(dt, op) for dt, op in plan.combos if dt not in unusable]
            plan.skipped.append(f"{names} (this CuPy has no such GPU arrays)")
            if not plan.dtypes:
                if comm.rank == 0:
                    sys.stderr.write(f"ringcomm-bench: error: -d {names}: this CuPy has no such GPU arrays\n")
                return 2

    nccl, nccl_why = None, ""
    if device == "cuda" and "nccl" in plan.impls:
        nccl, nccl_why = env.nccl_module()
        # the NCCL library named must be the one CuPy's bindings use: an error on every rank, before any NCCL call
        error = _first_error(comm, named.mismatch(nccl) if named is not None and nccl is not None else "")
        if error:
            if comm.rank == 0:
                sys.stderr.write(f"ringcomm-bench: error: {error}\n")
            return 2
    impls, notes = _make_impls(comm, plan, device, cupy, stream, xp, nccl, nccl_why)
    if not impls:
        if comm.rank == 0:
            sys.stderr.write("ringcomm-bench: error: no implementation can run: " + "; ".join(notes) + "\n")
        return 2
    environment = _header(comm, plan, device, cupy, impls, notes, xp, out, named, nccl)

    runner = Runner(comm, impls, plan.settings, xp, watchdog)
    names = [i.name for i in impls]
    layout = report.Layout.for_impls(names)
    total = sum(len(_counts(plan, c, comm.size, dt)) for c in plan.collectives for dt, _ in _combos(plan, c))
    progress = Progress(total, comm.rank == 0)
    all_rows: list[Row] = []
    failed = False
    try:
        for coll in plan.collectives:
            out("#")
            out(f"# Collective: {coll}")
            for line in report.column_header(layout):
                out(line)
            rows: list[Row] = []
            for dt, op in _combos(plan, coll):
                counts = _counts(plan, coll, comm.size, dt)
                runner.reserve(coll, max(counts), dt, op)
                for count in counts:
                    case = runner.case(coll, count, dt, op, plan.root)
                    new = runner.run(case)
                    for row in new:
                        out(report.format_row(row, layout))
                    rows += new
                    progress.step(f"{coll} {data.type_name(dt)} {sizes.format_size(case.nbytes)}")
            progress.close()
            for line in report.footer(rows, names, plan.settings.check, plan.settings.iters, plan.settings.warmup):
                out(line)
            failed |= any(r.wrong for row in rows for r in row.results.values())
            all_rows += rows
    finally:
        progress.close()
        runner.close()
        for impl in impls:
            close = getattr(impl, "close", None)
            if close is not None:
                close()
    watchdog.beat("writing output")
    if comm.rank == 0:
        if args.json:
            report.write_json(args.json, environment, _settings_dict(plan), all_rows)
            out(f"# Wrote {args.json}")
        if args.plot:
            report.plot(args.plot, all_rows, f"{comm.size} ranks, {device}")
            out(f"# Wrote {args.plot}")
    return 1 if failed else 0


def _combos(plan: Plan, collective: str) -> list[tuple[np.dtype, ReduceOp | None]]:
    """The (dtype, op) pairs of a collective's table: ops only where the collective reduces."""
    if collective in ("all_gather", "broadcast"):
        return [(dt, None) for dt in plan.dtypes]
    return plan.combos


def _counts(plan: Plan, collective: str, nranks: int, dtype: np.dtype) -> list[int]:
    return sizes.sweep_counts(plan.sizes, np.dtype(dtype).itemsize, collective, nranks)


def _make_impls(
    comm: Any, plan: Plan, device: str, cupy: Any, stream: Any, xp: Any, nccl: Any = None, nccl_why: str = ""
) -> tuple[list[Any], list[str]]:
    """The implementations that can run, in --impl order, and a note for each that cannot. ``nccl``:
    cupy.cuda.nccl on this rank (None: ``nccl_why`` says why not)."""
    from ..transports.staged import cuda_aware_mpi  # ringcomm's own probe (RINGCOMM_CUDA_AWARE_MPI overrides)
    from .impls import MpiImpl, NcclImpl, RingcommImpl

    impls, notes = [], []
    for name in plan.impls:
        if name == "ringcomm":
            try:  # the same answer on every rank: it depends on the installation only
                comm.transport_name(xp.empty(16, plan.dtypes[0]))
            except Exception as e:
                notes.append(f"ringcomm: cannot run on {device} ({type(e).__name__}: {e})")
                continue
            impls.append(RingcommImpl(comm, stream, plan.accumulate))
        elif name == "mpi":
            impls.append(MpiImpl(comm, device, device == "cuda" and cuda_aware_mpi()))
        elif name == "nccl":
            if device != "cuda":
                notes.append("nccl: not run: NCCL needs GPU buffers (--device cuda)")
                continue
            if not env.all_true(comm, nccl is not None):
                notes.append(f"nccl: NCCL could not run: {nccl_why or 'not available on another rank'}")
                continue
            impl, why = NcclImpl.create(comm, cupy, nccl, stream, env.ranks_per_gpu(comm, cupy), env.mps_status())
            if impl is None:
                notes.append(f"nccl: NCCL could not run: {why}")
                continue
            impls.append(impl)
    return impls, notes


def _header(
    comm: Any,
    plan: Plan,
    device: str,
    cupy: Any,
    impls: list[Any],
    notes: list[str],
    xp: Any,
    out: Out,
    named: env.NcclLibrary | None = None,
    nccl: Any = None,
) -> dict[str, Any]:
    """Print the header (nccl-tests' first lines, then ringcomm's) and return it as a dict for JSON.
    ``named``: the NCCL library --nccl-lib or RINGCOMM_NCCL_LIB loaded; ``nccl``: cupy.cuda.nccl when
    NCCL was asked for on GPUs (its version goes in the header even when NCCL did not run)."""
    vers = env.versions(cupy, nccl)
    if device != "cuda":
        unused = "NCCL runs with --device cuda only"
    elif "nccl" not in plan.impls:
        unused = "--impl has no nccl"
    else:
        unused = "NCCL could not run: see below"
    nccl_line = env.nccl_library_line(named, nccl, unused)
    nodes, per_node = env.node_layout(comm)
    probe = xp.empty(16, plan.dtypes[0])
    ring = next((i for i in impls if i.name == "ringcomm"), None)
    transport = comm.transport_name(probe) if ring is not None else "n/a (ringcomm not run)"
    edges = comm.ring_edges(probe) if ring is not None else ()
    ranks = env.gather_strings(comm, env.describe_rank(comm, device, cupy))
    st = plan.settings
    out(
        f"# ringcomm.bench: {comm.size} ranks, {nodes} node(s), {per_node} rank(s) per node, device {device}, "
        f"transport {transport}"
    )
    if edges:
        out(
            "# Ring: "
            + " ".join(f"{a} -{t}->" for a, _, t in edges[1:] + edges[:1])
            + f" ({comm.ring[0]})"
            + f"  (nodes: {','.join(comm.nodes)})"
        )
    link = comm._transport("cuda") if ring is not None and device == "cuda" else None
    if link is not None and link.note:  # (RINGCOMM_TRANSPORT=kernel where the ranks' kernels cannot all run at once)
        out(f"# Ring kernel: {link.note}")
    elif link is not None and link.kernel:  # each collective one kernel (ringcomm.executor)
        out(f"# Ring kernel: {comm._executors[cupy.cuda.runtime.getDevice()].summary()}")
    window = comm.shared_memory() if device == "host" else None
    if window is not None:  # every rank on one node: host all-reduces meet in the shared-memory window
        small, direct = window[0], comm._window_limit("all_reduce")
        pieces = direct == math.inf  # (all-reduces at every size, in pieces beyond the inbox)
        bcast, shard, places = (comm._window_limit(c) for c in ("broadcast", "all_gather", "reduce_scatter"))
        algorithm = (
            f"all_reduce up to {min(comm.small_bytes, small)} B: gather-fold (shared memory: whole buffers "
            "in an MPI shared-memory window, then a local fold in the ring's order)"
            + (
                "; above: direct (shared memory: each rank reduces its chunk from every rank's inbox; "
                f"beyond {window[1]} B in pieces)"
                if pieces
                else f"; up to {direct} B: direct (shared memory: each rank reduces its chunk from every rank's inbox)"
                if direct
                else ""
            )
            + "; bitwise the ring's result"
            + (
                f"; broadcast up to {bcast} B: copy (shared memory: the root's buffer in the window, copied "
                "out by the others)"
                if bcast
                else ""
            )
            + (f"; all_gather up to {shard} B a shard: copy (shared memory)" if shard else "")
            + (
                f"; reduce_scatter and reduce up to {places} B: fold (shared memory: each rank folds its shard, "
                "the root the whole buffer, from every rank's buffer in the window)"
                if places
                else ""
            )
            + f"; above{' (not all_reduce)' if pieces else ''}: ring, and chain for broadcast and "
            f"reduce (host buffers up to {PLAN_BYTES >> 20} MiB: cached plans of persistent requests; "
            f"{'' if pieces else 'all_reduce and '}reduce_scatter of 3+ ranks: direct)"
        )
    elif link is not None and link.kernel:
        algorithm = "every collective one kernel launch: the ring, or a one-shot all_reduce (# Ring kernel)"
    else:
        fold = "then a local fold in the ring's order: bitwise the ring's result"
        limit = max(comm._small(device), 0)
        small, above = f"all_reduce up to {limit} B", "above, and every other collective"
        if device == "host":
            small += f": gather-fold (one persistent MPI_Allgather_init of whole buffers, {fold})"
        elif ring is not None and comm._via_host(device, 0):
            small = (
                f"every collective up to {limit} B (all_gather: of out): through the host (copied to "
                "pinned host memory, the host's collective there: in its shared-memory window or by MPI; "
                f"all_reduce: gather-fold, {fold}; copied back)"
            )
            above = "above"
        else:  # GPU arrays that the host does not route (one rank, or small_bytes 0 on a rank)
            small, above = "", "every collective"
        algorithm = (f"{small}; " if small else "") + (
            f"{above}: ring (host buffers up to {PLAN_BYTES >> 20} MiB: cached plans of persistent requests)"
        )
    out(f"# Algorithm: {algorithm} (small_bytes, RINGCOMM_SMALL_BYTES, RINGCOMM_SHM)")
    out(
        f"# minBytes {plan.sizes[0]} maxBytes {plan.sizes[-1]} step: {plan.step} warmup iters: {st.warmup} "
        f"iters: {st.iters} validation: {int(st.check)} seed: {st.seed}"
    )
    out(f"# Time: {st.describe()}")
    out(f"# Accumulate: {plan.accumulate or 'none'} (ringcomm's float16/bfloat16 partial sums; -a/--accumulate)")
    out("# Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items() if k != "MPI"))
    out(f"# MPI library: {vers['MPI']}")
    if nccl_line:
        out(f"# NCCL library: {nccl_line}")
    out("# Implementations:")
    for impl in impls:
        out(f"#   {impl.name:<8} : {impl.describe(probe, plan.dtypes)}")
    for note in notes:
        out(f"#   {note}")
    footnotes = {i.name + i.mark: i.footnote for i in impls if getattr(i, "footnote", None)}
    for text in footnotes.values():
        out(f"# {text}")
    if any(i.name != "ringcomm" for i in impls) and any(i.name == "ringcomm" for i in impls):
        out("# ratio = ringcomm busbw / this row's busbw (= this row's time / ringcomm's time)")
    if plan.skipped:
        out(f"# Skipped: {', '.join(plan.skipped)}")
    counts_note = [c for c in plan.collectives if c in sizes.SHARDED]
    if counts_note:
        multiple = sizes.count_multiple(counts_note[0], comm.size)
        out(
            f"# {'/'.join(counts_note)}: counts rounded down to a multiple of {multiple} (16 x ranks) so that every "
            "rank's shard is equal"
        )
    out("#")
    out("# Using devices")
    for line in ranks:
        out(f"#  {line}")
    return {
        "ranks": comm.size,
        "nodes": nodes,
        "ranks_per_node": per_node,
        "device": device,
        "transport": transport,
        "algorithm": algorithm,
        "small_bytes": comm.small_bytes,
        "ring": list(comm.ring),
        "node_labels": list(comm.nodes),
        "edges": [{"from": a, "to": b, "transport": t} for a, b, t in edges],
        "versions": vers,
        "nccl_library": {
            "path": named.path if named is not None else None,
            "named_by": named.named_by if named is not None else None,
            "version": named.version if named is not None else None,
            "line": nccl_line,
        },
        "time": st.describe(),
        "ranks_detail": ranks,
        "implementations": {i.name: i.describe(probe, plan.dtypes) for i in impls},
        "notes": notes,
        "footnotes": footnotes,
        "argv": plan.argv,
    }


def _settings_dict(plan: Plan) -> dict[str, Any]:
    d = dataclasses.asdict(plan.settings)
    d.update(
        collectives=plan.collectives,
        sizes=plan.sizes,
        root=plan.root,
        step=plan.step,
        types=[data.type_name(t) for t in plan.dtypes],
        impls=plan.impls,
        accumulate=plan.accumulate,
        nccl_lib=plan.nccl_lib[0] if plan.nccl_lib is not None else None,
    )
    return d


if __name__ == "__main__":
    sys.exit(main())
