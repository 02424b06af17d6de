"""Command-line helpers shared by ``ringcomm-bench`` and the scripts in benchmarks/.

Under ``mpiexec`` every rank parses the same arguments; :class:`RankParser` prints help and errors
on one rank only and raises instead of exiting, so ``main(argv)`` can also run inside a test.
:class:`Out` prints the output on rank 0 only.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


class UsageError(Exception):
    """Bad command-line arguments (exit status 2)."""


class Exit(Exception):
    """argparse asked to exit (``--help``): ``code`` is the status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Out:
    """Prints on rank 0 only (to the sys.stdout of the moment, so tests can capture it)."""

    def __init__(self, rank: int) -> None:
        self.on = rank == 0

    def __call__(self, line: str = "") -> None:
        if self.on:
            print(line, flush=True)


class RankParser(argparse.ArgumentParser):
    """An ArgumentParser that is silent when ``quiet`` (ranks other than 0), raises
    :class:`UsageError` on bad arguments and :class:`Exit` where argparse would exit."""

    def __init__(self, *args: Any, quiet: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def _print_message(self, message: str, file: Any = None) -> None:
        if not self.quiet and message:
            (file or sys.stdout).write(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            self._print_message(message, sys.stderr)
        raise Exit(status)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def fail(self, error: Exception) -> int:
        """Print ``error`` with the usage line (unless quiet); returns the exit status 2."""
        self._print_message(f"{self.format_usage()}{self.prog}: error: {error}\n", sys.stderr)
        return 2


def add_sweep_options(p: argparse.ArgumentParser, *, maxbytes: str, iters: int, time_budget: float) -> None:
    """The size sweep and timing options of the all-reduce scripts in benchmarks/ (-b -e -f -n -w
    --time-budget --check), with their defaults; :func:`sweep_settings` reads them."""
    p.add_argument("-b", "--minbytes", default="8", help="smallest size in bytes, K/M/G suffixes (default 8)")
    p.add_argument("-e", "--maxbytes", default=maxbytes, help=f"largest size in bytes (default {maxbytes})")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("-n", "--iters", type=int, default=iters, help=f"timed iterations per row (default {iters})")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations per row (default 5)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=time_budget,
        help=f"seconds one timed loop may take; slow sizes get fewer iterations, at least 3 (default {time_budget:g}; "
        "0: never)",
    )
    p.add_argument("--check", type=int, default=1, choices=(0, 1), help="check the results (default 1)")


def sweep_settings(args: argparse.Namespace, **settings: Any) -> tuple[list[int], Any]:
    """(the sizes, the runner's Settings: median of per-call times) of :func:`add_sweep_options`'s
    options; ``settings`` adds to them. ValueError or UsageError for bad values."""
    from .runner import Settings
    from .sizes import parse_size, sweep_sizes

    sweep = sweep_sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    return sweep, Settings(
        iters=args.iters,
        warmup=args.warmup_iters,
        check=bool(args.check),
        stat="median",
        time_budget=args.time_budget,
        **settings,
    )
