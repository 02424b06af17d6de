"""The README and docs/ stay true: every code block meant to run is run, and every link resolves.

Which blocks run (README.md and docs/*.md):
- ```python: saved to a file and run as ``mpiexec -n 2 python FILE`` from the repository root; a block
  that imports cupy runs on the emulated GPU (tests/emulated), one that imports torch is skipped where
  torch is not installed.
- ```bash: each line that is not blank or a comment is run by bash from the repository root.
- A block whose fence is preceded by ``<!-- norun: REASON -->`` is not run (installs, the whole test
  suite, a minute-long sweep, a GPU); the reason must be given. Other fences (text, console) are shown
  output or sketches and are never run.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, real_cupy, run_emulated

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
NORUN = re.compile(r"^<!--\s*norun:(.*)-->\s*$")
#: the longest a run block may take on the 2-core CI machine
LIMIT_S = 90


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    norun: str | None  # the reason given, "" when the comment has none; None: runs

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines, found, i = page.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a code block is never closed"
        before = NORUN.match(lines[i - 1].strip()) if i > 0 else None
        norun = before.group(1).strip() if before else None
        found.append(Block(page, i + 1, opening.group(1).lower(), "\n".join(lines[i + 1 : end]) + "\n", norun))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
RUN = [b for b in ALL if b.lang in ("python", "bash") and b.norun is None]


def test_the_pages_exist_and_the_readme_stays_short():
    names = {p.name for p in PAGES}
    for page in ("design", "performance", "gpu", "errors", "numerics", "benchmarks", "zero"):
        assert f"{page}.md" in names, f"docs/{page}.md is missing"
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_every_skipped_block_says_why():
    for b in ALL:
        if b.norun is not None:
            assert b.norun, f"{b.where}: <!-- norun: ... --> gives no reason"
            assert b.lang in ("python", "bash"), f"{b.where}: norun on a {b.lang or 'plain'} block, which never runs"


def test_links_stay_inside_the_repository_and_resolve():
    link = re.compile(r"\]\(([^)\s]+)\)")
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert "../shared" not in text, f"{page.relative_to(ROOT)} points outside the repository"
        for target in link.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), f"{page.relative_to(ROOT)}: {target} is outside the repository"
            assert path.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_block_runs(block: Block, request, tmp_path):
    if block.lang == "bash":
        for cmd in block.code.splitlines():
            if not cmd.strip() or cmd.lstrip().startswith("#"):
                continue
            done = subprocess.run(
                ["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S, stdin=subprocess.DEVNULL
            )
            assert done.returncode == 0, f"{block.where}: `{cmd}` failed:\n{done.stdout}\n{done.stderr}"
        return
    script = tmp_path / "block.py"
    script.write_text(block.code)
    cmd = ["mpiexec", "-n", "2", "python", str(script)]
    if re.search(r"^\s*(import|from) torch\b", block.code, re.M) and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    if re.search(r"^\s*(import|from) cupy\b", block.code, re.M) and not real_cupy():
        done = run_emulated(request.getfixturevalue("emulated_gpu_env"), cmd, LIMIT_S)
    else:
        done = subprocess.run(
            [sys.executable if c == "python" else c for c in cmd],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
        )
    assert done.returncode == 0, f"{block.where} failed:\n{done.stdout}\n{done.stderr}"
