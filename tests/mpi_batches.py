"""Multi-rank tests in one mpiexec launch per rank count, not one per test.

mpi-pytest runs each ``@pytest.mark.parallel`` test of a plain ``python -m pytest`` in an mpiexec
launch of its own: N fresh interpreters that import numpy, mpi4py and ringcomm and collect the module
again, about 2 s of the 2-core CI machine for every one of some 200 test cases. Here the first such
test at one rank count launches one ``mpiexec -n N python -m pytest`` for every selected test of that
count (in every module); each rank writes a line per test phase (outcome, the failure's text and
what the test printed) to a file of its own as it goes, and each test then reports what its ranks
reported.

A rank whose test fails aborts its launch (conftest: its peers would wait for it): the tests of that
launch not started yet run again in a new one, so one failure never hides another. A launch that
ends inside a test with no failure reported (a crash, the time limit) fails that test with the
launch's output; a launch that runs nothing fails its first test.

A test that leaves its processes unusable (a stream stalled for ever, as a hung kernel leaves it) is
marked ``@pytest.mark.alone`` and gets a launch of its own.
``RINGCOMM_TEST_BATCH=0`` turns this off (mpi-pytest's own launch per test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mpi4py import MPI
from pytest_mpi.plugin import MPIImplementation, detect_mpi_implementation
from pytest_mpi.plugin import _extract_nprocs_for_single_test as _nprocs  # the rank count mpi-pytest gave it

#: each rank of a launch appends its reports here (a folder), set by the launching process; set for the
#: session, a folder under which the launches' reports are kept (gpu_check.sh: a step cut at its limit
#: keeps what its tests reported), else a temporary one
REPORTS = "RINGCOMM_TEST_REPORTS"
#: mpi-pytest's mark of the processes its mpiexec starts (they run their tests unmodified)
CHILD = "_PYTEST_MPI_CHILD_PROCESS"
#: a launch that takes longer than this has hung (every wait of ringcomm has a deadline; the tests' own
#: deadline is 30 s, 60 s on the emulated GPU); its unfinished test fails with the launch's output
LAUNCH_TIMEOUT_S = 900


def _enabled() -> bool:
    return os.environ.get("RINGCOMM_TEST_BATCH", "1") != "0" and MPI.COMM_WORLD.size == 1 and CHILD not in os.environ


def batched(item: pytest.Item) -> bool:
    """Whether ``item`` runs in one of these launches (its body, here, only reports)."""
    return _enabled() and item.get_closest_marker("parallel") is not None and _nprocs(item) > 1


def _group(item: pytest.Item) -> tuple[str, int]:
    """The launch a test joins: the one of its rank count, or its own when marked ``alone``."""
    where = item.nodeid if item.get_closest_marker("alone") is not None else ""
    return where, _nprocs(item)


def _mpiexec(n: int, env: dict[str, str], argv: list[str], quiet: list[str]) -> list[str]:
    """mpiexec running ``argv`` on rank 0 and ``argv + quiet`` on the other n - 1 ranks, with ``env``
    (MPICH's, Open MPI's and MS-MPI's spellings, as mpi-pytest's own launch)."""
    impl = detect_mpi_implementation()
    if impl is MPIImplementation.OPENMPI:
        flags = [f for k, v in env.items() for f in ("-x", f"{k}={v}")]
        return ["mpiexec", "--oversubscribe", "-n", "1", *flags, *argv, ":", "-n", str(n - 1), *argv, *quiet]
    option = "-genv" if impl is MPIImplementation.MPICH else "-env"
    flags = [f for k, v in env.items() for f in (option, k, v)]
    return ["mpiexec", "-n", "1", *flags, *argv, ":", "-n", str(n - 1), *argv, *quiet]


class Launches:
    """The session's launches: the tests of each rank count, and what their ranks reported."""

    def __init__(self, items: list[pytest.Item]):
        self.groups: dict[tuple[str, int], list[pytest.Item]] = {}
        for item in items:
            if batched(item):
                self.groups.setdefault(_group(item), []).append(item)
        #: nodeid -> {rank: {phase: report}}, from the last launch that ran the test
        self.reports: dict[str, dict[int, dict[str, dict]]] = {}
        kept = os.environ.get(REPORTS)
        if kept:
            os.makedirs(kept, exist_ok=True)
        self._temporary = None if kept else tempfile.TemporaryDirectory(prefix="ringcomm-launches-")
        self.folder = Path(tempfile.mkdtemp(prefix="launches-", dir=kept) if kept else self._temporary.name)
        self.count = 0

    def failed(self, item: pytest.Item) -> bool:
        got = self.reports.get(item.nodeid, {})
        return any(r["outcome"] == "failed" for phases in got.values() for r in phases.values())

    def done(self, item: pytest.Item) -> bool:
        """Whether every rank reported the test's teardown, or one its failure (which aborts the launch)."""
        got = self.reports.get(item.nodeid, {})
        return self.failed(item) or (len(got) == _nprocs(item) and all("teardown" in phases for phases in got.values()))

    def run(self, item: pytest.Item) -> None:
        """Launch the tests of ``item``'s group not run yet, until ``item`` has its reports. A failure
        aborts the launch: the tests after it (some ranks may have begun the next one) run again in
        a new launch. A launch that ends inside a test with no failure reported (a crash, the time
        limit) fails that test; one that ends after its last test with an error fails the last."""
        while not self.done(item):
            todo = [i for i in self.groups[_group(item)] if not self.done(i)]
            for i in todo:  # (nothing of an earlier launch is mixed into this one's)
                self.reports.pop(i.nodeid, None)
            self.count += 1
            start = time.monotonic()
            status, output = self._launch(todo, self.folder / f"launch{self.count}")
            took = time.monotonic() - start
            failed = [k for k, i in enumerate(todo) if self.failed(i)]
            if failed:
                for i in todo[failed[0] + 1 :]:  # cut short by the failure's abort: not theirs to report
                    if not self.failed(i):
                        self.reports.pop(i.nodeid, None)
            else:
                died = [i for i in todo if i.nodeid in self.reports and not self.done(i)]
                if status != 0 and not died and all(self.done(i) for i in todo):
                    died = todo[-1:]  # every test done, then an error (in MPI_Finalize, say)
                for i in died:
                    self._fail(i, f"the launch ended while it ran, with no failure reported:\n{output}", took)
            if not self.done(todo[0]):  # the launch ran nothing at all: no retry would do better
                self._fail(todo[0], f"the launch did not run it:\n{output}", took)

    def _fail(self, item: pytest.Item, text: str, took: float) -> None:
        """``item`` failed with ``text``; its duration: its launch's (``took`` s, a hung one's included)."""
        self.reports[item.nodeid] = {0: {"call": {"outcome": "failed", "text": text, "duration": took}}}

    def _launch(self, items: list[pytest.Item], folder: Path) -> tuple[int, str]:
        """Run ``items`` in one mpiexec; collect what each rank reported. (exit status, output)."""
        folder.mkdir()
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--runxfail", "--no-header"]
        if not any(i.get_closest_marker("hypothesis") for i in items):  # (hypothesis' plugin: 0.6 s a rank)
            argv += ["-p", "no:hypothesispytest"]
        argv += [i.nodeid for i in items]
        quiet = ["--no-summary", "--disable-warnings"]
        cmd = _mpiexec(_nprocs(items[0]), {CHILD: "1", REPORTS: str(folder)}, argv, quiet)
        root = items[0].config.rootpath  # (node ids are relative to it)
        proc = subprocess.Popen(
            cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        before = signal.getsignal(signal.SIGTERM)

        def terminated(signum: int, frame: object) -> None:
            """This pytest is ended (``timeout`` does it): the launch, in a session of its own, ends
            too (its ranks would hold the GPU into what runs next), then the signal's own action."""
            os.killpg(proc.pid, signal.SIGKILL)
            signal.signal(signal.SIGTERM, before)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, terminated)
        try:
            out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
            status, end = proc.returncode, f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
            out, _ = proc.communicate()
            status, end = -1, f"killed after {LAUNCH_TIMEOUT_S} s"
        finally:
            signal.signal(signal.SIGTERM, before)
        text = out.decode(errors="replace")
        output = f"$ {' '.join(cmd)}\n({end})\n{text[-20000:]}"
        for path in folder.glob("rank*.jsonl"):
            rank = int(path.stem[4:])
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill
                    continue
                self.reports.setdefault(r["nodeid"], {}).setdefault(rank, {})[r["when"]] = r
        return status, output


_KEY = pytest.StashKey[Launches]()


def runtest_setup(item: pytest.Item) -> None:
    """After mpi-pytest's own setup (which points the test at its mpiexec launch): point it at ours."""
    if not batched(item):
        return
    stash = item.session.stash
    if _KEY not in stash:  # the session's final list of tests (after -k, -m and the like)
        stash[_KEY] = Launches(item.session.items)
    launches = stash[_KEY]

    def from_the_launch(*args, **kwargs):
        launches.run(item)
        by_rank = launches.reports[item.nodeid]
        failed = [
            f"rank {rank}, {when}:\n{r['text']}"
            for rank, phases in sorted(by_rank.items())
            for when, r in phases.items()
            if r["outcome"] == "failed"
        ]
        if failed:
            pytest.fail("\n\n".join(failed), pytrace=False)
        skipped = [r for phases in by_rank.values() for r in phases.values() if r["outcome"] == "skipped"]
        if skipped:
            pytest.skip(skipped[0]["text"])

    item.obj = from_the_launch


def report(item: pytest.Item, report: pytest.TestReport) -> None:
    """In a rank of a launch: append this phase's report to the rank's file (before any abort), with
    what the test printed (the seed that replays it) when it failed. Here, for a test run in a launch:
    its call's duration is its slowest rank's set-up, call and teardown there (``--durations`` shows
    each test's own time, not the launch's, which its first test would otherwise carry), or for a test
    its launch ended (a crash, the time limit) the launch's."""
    if batched(item) and report.when == "call":
        launches = item.session.stash.get(_KEY, None)
        by_rank = launches.reports.get(item.nodeid, {}) if launches else {}
        report.duration = max((sum(r.get("duration", 0) for r in p.values()) for p in by_rank.values()), default=0)
        return
    folder = os.environ.get(REPORTS)
    if not folder or CHILD not in os.environ or item.get_closest_marker("parallel") is None:
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2].removeprefix("Skipped: ")
    else:
        text = report.longreprtext
    if report.failed:
        text += "".join(f"\n--- {name} ---\n{body}" for name, body in report.sections if body)
    line = {
        "nodeid": item.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": report.duration,
        "text": text,
    }
    with open(Path(folder) / f"rank{MPI.COMM_WORLD.rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
