"""Measuring one row: warm-up, timed iterations, result check, for every implementation.

Per implementation and mode (out-of-place, then in-place):

1. load the timing input, run the first warm-up call alone and take the slowest rank's time t1;
2. run the other warm-up calls; with a time budget B > 0, when w * t1 > B only max(1, B / t1)
   warm-up calls are made, and when the timed loop would exceed B (n * t > B, t the slowest rank's
   warm-up time per call) only max(min(n, 3), B / t) timed iterations run; with a shortest loop
   M > 0 (``min_time``) and warm-up calls, when the loop would last less than M, min(M, B) / t
   iterations run (same count on every rank: a stall of a shared host weighs on the mean or
   median of 20 short calls);
3. time: ``avg`` = one barrier, n calls, wait for completion, elapsed / n on each rank;
   ``median`` = one barrier, n calls back to back, each timed alone (from the previous call's
   completion to its own); the slowest rank's value of each iteration, then the median over
   iterations. The table's time is the slowest rank's in both cases;
4. check: fresh input (another seed), poisoned output, one call, compare with the independent
   expected result (:mod:`ringcomm.bench.data`), wrong elements summed over ranks.

With R > 1 ``rounds``, steps 1-3 run R times for every implementation and mode, interleaved (all of
them once, then again), and each reports its fastest round (its iterations and warm-up those of that
round); the check (4) runs once, in the last round. On a host whose speed changes from one second
to the next (a virtual machine whose host moves its CPUs: benchmarks/cross_core.py), a loop that
falls into a slow period then decides neither its own time nor a ratio.

Every wait on other ranks is a ringcomm collective (with its deadline) or an implementation under
test; the :class:`Watchdog` aborts the MPI job when a phase makes no progress for ``timeout`` seconds
(the MPI and NCCL baselines have no deadline of their own).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..ops import ReduceOp
from . import data, sizes
from .impls import Arrays, Buffers, Prepared, stream_sync

MODES = ("out-of-place", "in-place")

#: Fewest timed iterations the time budget leaves (unless -n asks for fewer).
MIN_ITERS = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    """How each row is measured (see the module docstring)."""

    iters: int = 20
    warmup: int = 5
    check: bool = True
    stat: str = "avg"  # "avg" or "median"
    time_budget: float = 1.0  # seconds per (implementation, mode) timed loop; 0: no limit
    min_time: float = 0.0  # seconds a timed loop lasts at least (more iterations for fast calls); 0: n exactly
    rounds: int = 1  # measurements of every (implementation, mode), interleaved; the fastest is reported
    seed: int = 0
    corrupt: int = 0  # tests only: plant this many wrong elements per rank in ringcomm's results

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise ValueError(f"iterations (-n) must be >= 1; got {self.iters}")
        if self.warmup < 0:
            raise ValueError(f"warm-up iterations (-w) must be >= 0; got {self.warmup}")
        if self.stat not in ("avg", "median"):
            raise ValueError(f"stat must be 'avg' or 'median'; got {self.stat!r}")
        if not self.time_budget >= 0:
            raise ValueError(f"the time budget must be >= 0 seconds; got {self.time_budget}")
        if not self.min_time >= 0:
            raise ValueError(f"the shortest timed loop must be >= 0 seconds; got {self.min_time}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1; got {self.rounds}")
        if self.corrupt < 0:
            raise ValueError(f"corrupt must be >= 0; got {self.corrupt}")

    def describe(self) -> str:
        """The header's sentence about what the time column is."""
        if self.stat == "avg":
            what = "slowest rank's mean time per call over the timed loop (max over ranks of each rank's mean)"
        else:
            what = (
                "median over iterations of the slowest rank's time per call (calls back to back after one "
                "barrier, each timed from the previous call's completion)"
            )
        budget = (
            f"; time budget {self.time_budget:g} s per loop: slow sizes run fewer warm-up/timed "
            f"iterations (at least 1/{MIN_ITERS}; listed under the table)"
            if self.time_budget > 0
            else ""
        )
        shortest = (
            f"; timed loops last at least {self.min_time:g} s: fast sizes run more iterations"
            if self.min_time > 0
            else ""
        )
        rounds = (
            f"; the fastest of {self.rounds} rounds, every implementation and mode measured once per round"
            if self.rounds > 1
            else ""
        )
        return what + budget + shortest + rounds


@dataclasses.dataclass
class Result:
    """One implementation in one mode for one row, reduced over ranks. ``note`` says why it did not
    run (the table prints N/A); ``wrong`` is None when checking is off."""

    time_us: float | None = None
    algbw: float | None = None
    busbw: float | None = None
    wrong: int | None = None
    iters: int = 0
    warmup: int = 0
    ratio: float | None = None  # ringcomm's busbw over this one's (= this time / ringcomm's time)
    note: str | None = None


@dataclasses.dataclass
class Row:
    """One line of the table."""

    collective: str
    nbytes: int
    count: int
    type: str
    redop: str
    root: int
    impl: str
    results: dict[str, Result]
    mark: str = ""  # printed after the impl name ("*": see the implementation's footnote in the header)


class Watchdog:
    """Aborts the MPI job when no :meth:`beat` came for ``timeout`` seconds (0: never).

    The message on stderr names this rank and the phase that did not finish. Runs as a daemon thread.
    """

    def __init__(self, timeout: float, rank: int, abort: Callable[[int], Any] | None = None) -> None:
        self.timeout, self.rank = timeout, rank
        self._abort = abort
        self._phase, self._last = "start-up", time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout > 0:
            self._thread = threading.Thread(target=self._watch, name="ringcomm.bench watchdog", daemon=True)
            self._thread.start()

    def beat(self, phase: str) -> None:
        """Progress was made; ``phase`` is what runs next."""
        self._phase, self._last = phase, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if time.monotonic() - self._last > self.timeout:
                sys.stderr.write(
                    f"ringcomm.bench: rank {self.rank}: no progress for {self.timeout:g} s in {self._phase}; "
                    "aborting the MPI job (a peer is dead or stuck; raise --timeout for slower runs)\n"
                )
                sys.stderr.flush()
                if self._abort is not None:
                    self._abort(3)
                else:
                    from mpi4py import MPI

                    MPI.COMM_WORLD.Abort(3)
                return


def stderr_is_terminal() -> bool:
    """Whether what this process writes to stderr ends on a terminal.

    True when stderr is a tty, or when it is a pipe read by the parent (mpiexec forwards the
    ranks' output through pipes: rank -> proxy -> mpiexec) and, following such pipes up the
    parents (Linux /proc), the launcher's own stderr is a tty. A file, or a pipe read by anything
    but the parent (``mpiexec ... 2>&1 | tee log``): False.
    """
    if sys.stderr.isatty():
        return True
    try:
        target = os.readlink("/proc/self/fd/2")
        pid = os.getppid()
        for _ in range(4):
            if not target.startswith("pipe:") or not _holds(pid, target):
                return False
            target = os.readlink(f"/proc/{pid}/fd/2")
            if target.startswith(("/dev/pts/", "/dev/tty")):
                return True
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: the parent's pid
    except (OSError, ValueError, IndexError):
        pass
    return False


def _holds(pid: int, target: str) -> bool:
    """Whether process ``pid`` has a file descriptor on ``target`` (e.g. "pipe:[1234]")."""
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            if os.readlink(f"{base}/{fd}") == target:
                return True
        except OSError:
            continue
    return False


class Progress:
    """A one-line progress bar on stderr, shown only on rank 0, when stderr ends on a terminal
    (:func:`stderr_is_terminal`), and once the sweep has run for more than ``delay`` seconds."""

    def __init__(self, total: int, enabled: bool, delay: float = 2.0, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.done = total, 0
        tty = getattr(self.stream, "isatty", lambda: False)() or (stream is None and stderr_is_terminal())
        self.enabled = enabled and self.total > 0 and tty
        self.delay, self.t0, self._shown = delay, time.monotonic(), False

    def step(self, label: str) -> None:
        """One more unit done; ``label`` says what comes next."""
        self.done += 1
        if not self.enabled or time.monotonic() - self.t0 < self.delay:
            return
        width = 30
        fill = int(width * self.done / self.total)
        elapsed = time.monotonic() - self.t0
        bar = "#" * fill + "." * (width - fill)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f} s  {label[:40]:<40}")
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self._shown = False


@dataclasses.dataclass
class _Local:
    """One measurement on this rank, before the cross-rank reduction."""

    times: np.ndarray  # seconds: one mean (avg) or one per iteration (median)
    wrong: int  # -1: not checked
    iters: int
    warmup: int


def _load(dst: Any, host: np.ndarray) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, host)
    else:
        dst.set(host)


def _fetch(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


class Runner:
    """Measures rows on one device with a list of implementations (all ranks call the same methods
    in the same order: every method here is collective over ``comm``)."""

    def __init__(
        self, comm: Any, impls: Sequence[Any], settings: Settings, xp: Any = np, watchdog: Watchdog | None = None
    ) -> None:
        self.comm, self.impls, self.settings, self.xp = comm, list(impls), settings, xp
        self._settle = stream_sync(comm) if xp is not np else None  # GPU runs: the current stream's work
        self.watchdog = watchdog
        self.bufs = Buffers(xp)
        self.host = Buffers(np)  # timing and check data, expected results

    def close(self) -> None:
        self.bufs.release()
        self.host.release()

    # -------------------------------------------------------------------------------------- rows
    def case(self, collective: str, count: int, dtype: np.dtype, op: ReduceOp | None, root: int) -> data.Case:
        """The :class:`~ringcomm.bench.data.Case` of a row on this communicator."""
        rooted = collective in ("broadcast", "reduce")
        return data.Case(
            collective,
            count,
            np.dtype(dtype),
            op,
            root if rooted else -1,
            self.comm.size,
            self.comm.rank,
            tuple(self.comm.shard_bounds(count)),
        )

    def reserve(self, collective: str, count: int, dtype: np.dtype, op: ReduceOp | None = None) -> None:
        """Allocate and touch the buffers of the sweep's largest row now, so that rows do not pay
        for fresh memory (page faults) one size after the other."""
        case = self.case(collective, count, dtype, op, 0)
        arrays = Arrays.of(case, self.bufs)
        for a in (arrays.send, arrays.recv):
            a.view(np.uint8).fill(0)
        lo, hi = case.input_range()
        out_n = case.shard[1] - case.shard[0] if collective == "reduce_scatter" else count
        for name, n, dt in (
            ("timing", hi - lo, dtype),
            ("check", hi - lo, dtype),
            ("expected", out_n, np.float64 if op is ReduceOp.AVG else dtype),
        ):
            self.host.get(name, n, dt).view(np.uint8).fill(0)

    def run(self, case: data.Case) -> list[Row]:
        """Measure ``case`` with every implementation; one :class:`Row` per implementation."""
        st = self.settings
        arrays = Arrays.of(case, self.bufs)
        lo, hi = case.input_range()
        tdata = data.input_data(
            case,
            data.derive_seed(st.seed, "timing", case.collective, case.count),
            self.host.get("timing", hi - lo, case.dtype),
        )
        cseed = data.derive_seed(st.seed, "check", case.collective, case.count, str(case.dtype), str(case.op))
        cdata = expected = None
        if st.check:
            cdata = data.input_data(case, cseed, self.host.get("check", hi - lo, case.dtype))
            out_n = case.shard[1] - case.shard[0] if case.collective == "reduce_scatter" else case.count
            expected = data.expected_result(case, cseed, self.host.get("expected", out_n, data.expected_dtype(case)))
        # per implementation and mode: its rounds' measurements, or why it did not run
        local: list[list[list[_Local] | str]] = [[[], []] for _ in self.impls]
        for r in range(st.rounds):
            last = r == st.rounds - 1
            for impl, per_mode in zip(self.impls, local):
                for inplace in (False, True):
                    if isinstance(per_mode[inplace], str):
                        continue
                    label = f"{impl.name} {case.collective} {sizes.format_size(case.nbytes)} {MODES[inplace]}"
                    if self.watchdog is not None:
                        self.watchdog.beat(label)
                    prep = impl.prepare(case, arrays, inplace)
                    if isinstance(prep, str):
                        per_mode[inplace] = prep
                        continue
                    # in-place prod/sum timing loops may overflow to inf: expected, and not worth a warning
                    with np.errstate(over="ignore", invalid="ignore"):
                        per_mode[inplace].append(
                            self._measure(
                                impl.name, case, arrays, inplace, prep, tdata, cdata if last else None, expected
                            )
                        )
        return self._reduce(case, local)

    # ------------------------------------------------------------------------------ measurement
    def _slowest(self, seconds: float) -> float:
        return float(self.comm.all_reduce(np.array([seconds], np.float64), "max")[0])

    def _block(self, prep: Prepared, k: int) -> float:
        """Seconds this rank takes for ``k`` calls after a barrier (completion included)."""
        self.comm.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            prep.run()
        prep.sync()
        return time.perf_counter() - t0

    def _each(self, prep: Prepared, k: int) -> np.ndarray:
        """Seconds of each of ``k`` back-to-back calls after one barrier (call i's time is from the
        completion of call i-1 to its own: the rate a loop of calls runs at, with no barrier skew)."""
        stamps = np.empty(k + 1, np.float64)
        run, sync, clock = prep.run, prep.sync, time.perf_counter
        self.comm.barrier()
        stamps[0] = clock()
        for i in range(1, k + 1):
            run()
            sync()
            stamps[i] = clock()
        return np.diff(stamps)

    def _measure(
        self,
        name: str,
        case: data.Case,
        arrays: Arrays,
        inplace: bool,
        prep: Prepared,
        tdata: np.ndarray,
        cdata: np.ndarray | None,
        expected: np.ndarray | None,
    ) -> _Local:
        st = self.settings
        w, n, budget = st.warmup, st.iters, st.time_budget
        _load(arrays.input(case, inplace), tdata)
        if self._settle is not None:  # the load runs on the current stream: settle it before any implementation reads
            self._settle()
        if w > 0:
            t1 = self._slowest(self._block(prep, 1))
            if budget > 0 and w * t1 > budget:
                w = max(1, int(budget / t1))
            tw = self._slowest(self._block(prep, w - 1)) / (w - 1) if w > 1 else t1
            if budget > 0 and n * tw > budget:
                n = max(min(n, MIN_ITERS), int(budget / tw))
            elif tw > 0 and n * tw < st.min_time:  # (tw: the slowest rank's, so every rank makes this count)
                n = int((min(st.min_time, budget) if budget > 0 else st.min_time) / tw) + 1
        times = np.array([self._block(prep, n) / n]) if st.stat == "avg" else self._each(prep, n)
        wrong = -1
        if cdata is not None:
            poison = arrays.poisoned(case, inplace)
            if poison is not None:
                poison.fill(data.poison_value(case.dtype))
            _load(arrays.input(case, inplace), cdata)
            if self._settle is not None:
                self._settle()
            prep.run()
            prep.sync()
            if st.corrupt and name == "ringcomm":
                idx = data.plant_indices(prep.result.size, st.corrupt)
                prep.result[self.xp.asarray(idx)] = data.poison_value(case.dtype)
            wrong = data.count_wrong(_fetch(prep.result), expected, case.dtype, case.op)
        return _Local(times, wrong, n, w)

    def _reduce(self, case: data.Case, local: list[list[list[_Local] | str]]) -> list[Row]:
        """Slowest-rank times (the fastest round's) and summed wrong counts (the last round's) for all
        measurements of the row at once."""
        ran = [rounds for per in local for rounds in per if not isinstance(rounds, str)]
        every = [m for rounds in ran for m in rounds]
        times = self.comm.all_reduce(np.concatenate([m.times for m in every]) if every else np.zeros(0), "max")
        wrong = self.comm.all_reduce(np.array([rounds[-1].wrong for rounds in ran], np.int64), "sum")
        rows, k, offset = [], 0, 0
        typ = data.type_name(case.dtype)
        redop = str(case.op) if case.op is not None else "none"
        for impl, per in zip(self.impls, local):
            results = {}
            for mode, rounds in zip(MODES, per):
                if isinstance(rounds, str):
                    results[mode] = Result(note=rounds)
                    continue
                secs = []
                for m in rounds:
                    t = times[offset : offset + m.times.size]
                    offset += m.times.size
                    secs.append(float(t[0]) if self.settings.stat == "avg" else float(np.median(t)))
                sec = min(secs)
                m = rounds[secs.index(sec)]
                results[mode] = Result(
                    time_us=sec * 1e6,
                    algbw=sizes.algbw(case.nbytes, sec),
                    busbw=sizes.busbw(case.collective, case.nbytes, sec, case.nranks),
                    wrong=int(wrong[k]) if self.settings.check else None,
                    iters=m.iters,
                    warmup=m.warmup,
                )
                k += 1
            rows.append(
                Row(
                    case.collective,
                    case.nbytes,
                    case.count,
                    typ,
                    redop,
                    case.root,
                    impl.name,
                    results,
                    getattr(impl, "mark", ""),
                )
            )
        add_ratios(rows)
        return rows


def add_ratios(rows: list[Row], reference: str = "ringcomm") -> None:
    """Set each baseline row's ``ratio``: the reference's busbw over its busbw, per mode (computed as
    time ratio, so it is defined on one rank too, where busbw is 0)."""
    ref = next((r for r in rows if r.impl == reference), None)
    if ref is None:
        return
    for row in rows:
        if row is ref:
            continue
        for mode, res in row.results.items():
            mine = ref.results.get(mode)
            if mine is not None and mine.time_us and res.time_us:
                res.ratio = res.time_us / mine.time_us


def average_busbw(rows: Sequence[Row], impl: str) -> float:
    """nccl-tests' "Avg bus bandwidth": the mean busbw over every measured row and mode of ``impl``."""
    values = [r.busbw for row in rows if row.impl == impl for r in row.results.values() if r.busbw is not None]
    return float(np.mean(values)) if values else 0.0


def total_wrong(rows: Sequence[Row]) -> int:
    """Wrong elements over all rows, modes and implementations."""
    return sum(r.wrong for row in rows for r in row.results.values() if r.wrong)
