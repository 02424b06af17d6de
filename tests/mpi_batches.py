"""Multi-rank tests in one mpiexec launch per module and rank count, not one per test.

mpi-pytest runs each ``@pytest.mark.parallel`` test of a plain ``python -m pytest`` in an mpiexec
launch of its own: N fresh interpreters that import numpy, mpi4py and ringcomm and collect the module
again, about 2 s of the 2-core CI machine for every one of some 200 test cases. Here the first such
test of a module (at one rank count) launches one ``mpiexec -n N python -m pytest`` for every selected
test of that module and count; each rank writes a line per test phase (outcome, duration, the
failure's text) to a file of its own as it goes, and each test then reports what its ranks reported.

A rank whose test fails aborts its launch (conftest: its peers would wait for it): the tests of that
launch not reported yet run again in a new one, so one failure never hides another. A test still
unreported after a launch of its own fails with that launch's output.

A test that leaves its processes unusable (a stream stalled for ever, as a hung kernel leaves it) is
marked ``@pytest.mark.alone`` and gets a launch of its own.
``RINGCOMM_TEST_BATCH=0`` turns this off (mpi-pytest's own launch per test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

#: each rank of a launch appends its reports here (a folder), set by the launching process
REPORTS = "RINGCOMM_TEST_REPORTS"
#: mpi-pytest's mark of the processes its mpiexec starts (they run their tests unmodified)
CHILD = "_PYTEST_MPI_CHILD_PROCESS"
#: a launch that takes longer than this has hung (every wait of ringcomm has a deadline; the tests' own
#: deadline is 30 s, 60 s on the emulated GPU)
LAUNCH_TIMEOUT_S = 1800


def _enabled() -> bool:
    return os.environ.get("RINGCOMM_TEST_BATCH", "1") != "0" and MPI.COMM_WORLD.size == 1 and CHILD not in os.environ


def _nprocs(item: pytest.Item) -> int:
    if hasattr(item, "callspec") and "_nprocs" in item.callspec.params:
        return item.callspec.params["_nprocs"]
    (n,) = _as_tuple(item.get_closest_marker("parallel"))
    return n


def _group(item: pytest.Item) -> tuple[str, int]:
    """The launch a test joins: its module's at its rank count, or its own when marked ``alone``."""
    where = item.nodeid if item.get_closest_marker("alone") is not None else str(item.path)
    return where, _nprocs(item)


def _as_tuple(marker) -> tuple[int, ...]:
    arg = marker.args[0] if marker.args else marker.kwargs.get("nprocs", 3)
    return tuple(arg) if isinstance(arg, (list, tuple)) else (arg,)


class Launches:
    """The session's launches: the tests of each (module, rank count), and what their ranks reported."""

    def __init__(self, items: list[pytest.Item]):
        self.groups: dict[tuple[str, int], list[pytest.Item]] = {}
        for item in items:
            if item.get_closest_marker("parallel") is not None and _nprocs(item) > 1:
                self.groups.setdefault(_group(item), []).append(item)
        #: nodeid -> {rank: {phase: report}}
        self.reports: dict[str, dict[int, dict[str, dict]]] = {}
        #: nodeid -> the output of the launch that was to report it
        self.output: dict[str, str] = {}
        self.folder = tempfile.TemporaryDirectory(prefix="ringcomm-launches-")
        self.count = 0

    def done(self, item: pytest.Item, n: int) -> bool:
        """Whether every rank reported the test's teardown (or a failure, which aborts the launch)."""
        got = self.reports.get(item.nodeid, {})
        return any(r["outcome"] == "failed" for ranks in got.values() for r in ranks.values()) or (
            len(got) == n and all("teardown" in phases for phases in got.values())
        )

    def run(self, item: pytest.Item) -> None:
        n = _nprocs(item)
        while not self.done(item, n):
            todo = [i for i in self.groups[_group(item)] if not self.done(i, n)]
            first = todo[0]
            self.count += 1
            self._launch(todo, n, Path(self.folder.name) / f"launch{self.count}")
            if not self.done(first, n):  # it could not even report: no retry would do better
                self.reports.setdefault(first.nodeid, {}).setdefault(0, {})["call"] = {
                    "outcome": "failed",
                    "text": f"no report from every rank; the launch's output:\n{self.output[first.nodeid]}",
                    "duration": 0.0,
                }

    def _launch(self, items: list[pytest.Item], n: int, folder: Path) -> None:
        folder.mkdir()
        py = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--runxfail", "--no-header"]
        quiet = ["--tb=no", "--no-summary", "--disable-warnings", "--show-capture=no"]
        ids = [i.nodeid for i in items]
        cmd = ["mpiexec", "-n", "1", "-genv", CHILD, "1", "-genv", REPORTS, str(folder), *py, *ids]
        cmd += [":", "-n", str(n - 1), *py, *quiet, *ids]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, stdin=subprocess.DEVNULL
            )
            output = f"$ {' '.join(cmd)}\n(exit {done.returncode})\n{done.stdout}\n{done.stderr}"
        except subprocess.TimeoutExpired as e:
            output = f"$ {' '.join(cmd)}\n(killed after {LAUNCH_TIMEOUT_S} s)\n{e.stdout}\n{e.stderr}"
        for path in folder.glob("rank*.jsonl"):
            rank = int(path.stem[4:])
            for line in path.read_text().splitlines():
                r = json.loads(line)
                self.reports.setdefault(r["nodeid"], {}).setdefault(rank, {})[r["when"]] = r
        for i in items:
            self.output[i.nodeid] = output[-20000:]


_KEY = pytest.StashKey[Launches]()


def runtest_setup(item: pytest.Item) -> None:
    """After mpi-pytest's own setup (which points the test at its mpiexec launch): point it at ours."""
    if not _enabled() or item.get_closest_marker("parallel") is None or _nprocs(item) == 1:
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
    """In a rank of a launch: append this phase's report to the rank's file (before any abort)."""
    folder = os.environ.get(REPORTS)
    if not folder or item.get_closest_marker("parallel") is None:
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]
    else:
        text = report.longreprtext
    line = {"nodeid": item.nodeid, "when": report.when, "outcome": report.outcome, "text": text}
    line["duration"] = report.duration
    with open(Path(folder) / f"rank{MPI.COMM_WORLD.rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
