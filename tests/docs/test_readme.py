"""The README's examples run as is, twice in a row, in a fresh folder and a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.docs import python_blocks

README = ROOT / "README.md"


def test_the_readme_has_one_runnable_example_and_marks_the_others() -> None:
    runnable, fragments = python_blocks(README)
    assert len(runnable) == 1 and fragments >= 1  # the object-store block needs a bucket


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_readme_example_runs_twice(tmp_path: Path) -> None:
    code = "\n\n".join(python_blocks(README)[0])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for attempt in (1, 2):  # the second run finds the first one's corpus and checkpoint
        proc = subprocess.run(
            [sys.executable, "-W", "error", "-c", code],
            check=False,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert proc.returncode == 0, f"README, run {attempt}:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "data" / "corpus" / "manifest.json").exists()
