"""The documentation site, built once per test session with ``mkdocs build --strict`` (once for
all the workers of a ``pytest -n`` run: the first to need it builds it, the others wait for it)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh build of the site (the working tree's docs and docstrings) in a temporary folder.

    A strict build fails on any warning; the test then shows mkdocs' output (in every worker that
    uses the site, when the workers of a ``pytest -n`` run share one build).
    """
    pytest.importorskip("mkdocs", reason='the docs extra is not installed: pip install -e ".[docs]"')
    pytest.importorskip("mkdocstrings", reason='the docs extra is not installed: pip install -e ".[docs]"')
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _build(tmp_path_factory.mktemp("site"))
    shared = tmp_path_factory.getbasetemp().parent  # this run's folder, above each worker's own
    with open(shared / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        site, failed = shared / "site", shared / "site.failed"
        if failed.exists():
            pytest.fail(failed.read_text())
        if not (site / "index.html").exists():
            try:
                _build(site)
            except AssertionError as e:
                failed.write_text(str(e))
                raise
        return site


def _build(site: Path) -> Path:
    site.mkdir(exist_ok=True)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    return site
