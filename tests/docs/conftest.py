"""The documentation site, built once per test session with ``mkdocs build --strict``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh build of the site (the working tree's docs and docstrings) in a temporary folder.

    A strict build fails on any warning; the test then shows mkdocs' output.
    """
    pytest.importorskip("mkdocs", reason='the docs extra is not installed: pip install -e ".[docs]"')
    pytest.importorskip("mkdocstrings", reason='the docs extra is not installed: pip install -e ".[docs]"')
    site = tmp_path_factory.mktemp("site")
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
