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
