"""The docs pages' examples run as is, twice in a row, in a fresh folder, each run a program of its
own as ``python -W error -c CODE`` runs it.

Each run is forked from a zygote (``tests/support/zygote.py``) that imported those of
``PRELOAD`` (``tests/support/docs.py``) the page imports once, with the same interpreter options
(a warning those imports give is an error there, as in a fresh interpreter): a page's two runs,
and pages that import the same of them, share one. The run imports the page's other modules
itself.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.docs import DOCS, PRELOAD, python_blocks, run_env
from tests.support.zygote import Zygote, imports_in

PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
RUNNABLE = [p for p in PAGES if python_blocks(DOCS / p)[0]]


def page_code(page: str) -> str:
    return "\n\n".join(python_blocks(DOCS / page)[0])


@pytest.fixture(scope="module")
def zygote_for(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Zygote]]:
    """The zygote that has imported those of ``PRELOAD`` that ``code`` imports (one for each set
    of modules)."""
    zygotes: dict[tuple[str, ...], Zygote] = {}
    logs = tmp_path_factory.mktemp("zygotes")

    def get(code: str) -> Zygote:
        preload = tuple(m for m in imports_in(code) if m.split(".")[0] in PRELOAD)
        if preload not in zygotes:
            log = logs / f"zygote-{len(zygotes)}.log"
            zygotes[preload] = Zygote(log, preload, cwd=ROOT, env=run_env(), python=["-W", "error"])
        return zygotes[preload]

    try:
        yield get
    finally:
        for zygote in zygotes.values():
            zygote.close()


def run_page(page: str, cwd: Path, zygote: Zygote) -> tuple[int, str]:
    """The run's exit status and what it printed."""
    log = cwd.parent / f"{cwd.name}-run.log"
    log.unlink(missing_ok=True)
    child = zygote.start([], log, code=page_code(page), env=run_env(), cwd=cwd)
    try:
        code = child.wait(timeout=150)
    except subprocess.TimeoutExpired:
        child.kill()
        code = child.wait()
    return code, log.read_text()


def test_the_pages_with_examples_are_found() -> None:
    # A page whose blocks all became fragments (or a broken extractor) would run nothing.
    assert {"getting-started.md", "checkpointing.md", "async.md", "reference/loader.md"} <= set(RUNNABLE)
    runnable, fragments = python_blocks(DOCS / "checkpointing.md")
    assert len(runnable) == 1 and fragments == 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUNNABLE)
@pytest.mark.slow
def test_page_runs_as_is_twice(page: str, tmp_path: Path, zygote_for: Callable[[str], Zygote]) -> None:
    folder = tmp_path / "page"
    folder.mkdir()
    zygote = zygote_for(page_code(page))
    for attempt in (1, 2):  # the second run finds the first one's files (no FileExistsError)
        code, output = run_page(page, folder, zygote)
        assert code == 0, f"{page}, run {attempt} exited {code}:\n{output}"


def test_a_failing_block_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nraise SystemExit(3)\n```\n\n<!-- fragment -->\n```python\nnot run\n```\n"
    )
    runnable, fragments = python_blocks(page)
    assert runnable == ["raise SystemExit(3)\n"] and fragments == 1
    proc = subprocess.run([sys.executable, "-c", runnable[0]], check=False, capture_output=True, timeout=30)
    assert proc.returncode == 3
