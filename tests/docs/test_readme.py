"""The README's examples run as is, twice in a row, in a fresh folder, each run a program of its own
as ``python -W error -c CODE`` runs it (forked from a zygote, as the docs pages' runs are:
``test_getting_started.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.docs import PRELOAD, python_blocks, run_env
from tests.support.zygote import Zygote, imports_in

README = ROOT / "README.md"


def test_the_readme_has_one_runnable_example_and_marks_the_others() -> None:
    runnable, fragments = python_blocks(README)
    assert len(runnable) == 1 and fragments >= 1  # the object-store block needs a bucket


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_readme_example_runs_twice(tmp_path: Path) -> None:
    code = "\n\n".join(python_blocks(README)[0])
    folder = tmp_path / "readme"
    folder.mkdir()
    preload = [m for m in imports_in(code) if m.split(".")[0] in PRELOAD]
    with Zygote(tmp_path / "zygote.log", preload, cwd=ROOT, env=run_env(), python=["-W", "error"]) as zygote:
        for attempt in (1, 2):  # the second run finds the first one's corpus and checkpoint
            log = tmp_path / f"run-{attempt}.log"
            child = zygote.start([], log, code=code, cwd=folder)
            try:
                status = child.wait(timeout=150)
            except subprocess.TimeoutExpired:
                child.kill()
                status = child.wait()
            assert status == 0, f"README, run {attempt} exited {status}:\n{log.read_text()}"
    assert (folder / "data" / "corpus" / "manifest.json").exists()
