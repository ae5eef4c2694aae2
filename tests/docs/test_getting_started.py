"""The docs pages' examples run as is, twice in a row, in a fresh folder and a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.docs import DOCS, python_blocks

PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
RUNNABLE = [p for p in PAGES if python_blocks(DOCS / p)[0]]


def run_page(page: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = "\n\n".join(python_blocks(DOCS / page)[0])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_the_pages_with_examples_are_found() -> None:
    # A page whose blocks all became fragments (or a broken extractor) would run nothing.
    assert {"getting-started.md", "checkpointing.md", "async.md", "reference/loader.md"} <= set(RUNNABLE)
    runnable, fragments = python_blocks(DOCS / "checkpointing.md")
    assert len(runnable) == 1 and fragments == 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUNNABLE)
@pytest.mark.slow
def test_page_runs_as_is_twice(page: str, tmp_path: Path) -> None:
    for attempt in (1, 2):  # the second run finds the first one's files (no FileExistsError)
        proc = run_page(page, tmp_path)
        assert proc.returncode == 0, f"{page}, run {attempt}:\n{proc.stdout}\n{proc.stderr}"


def test_a_failing_block_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nraise SystemExit(3)\n```\n\n<!-- fragment -->\n```python\nnot run\n```\n"
    )
    runnable, fragments = python_blocks(page)
    assert runnable == ["raise SystemExit(3)\n"] and fragments == 1
    proc = subprocess.run([sys.executable, "-c", runnable[0]], check=False, capture_output=True, timeout=30)
    assert proc.returncode == 3
