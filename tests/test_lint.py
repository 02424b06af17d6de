"""The code passes ruff's lint and format checks (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("check", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(check):
    done = subprocess.run([sys.executable, "-m", "ruff", *check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff {' '.join(check)} found:\n{done.stdout}{done.stderr}"
