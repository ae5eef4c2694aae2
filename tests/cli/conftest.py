"""The ``cli`` fixture: run the command line in-process and capture its output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from guideloom._cli import main
from tests.support.cli import Run


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """``cli("prepare", ...)`` runs the command line in-process and captures its output."""

    def run(*args: Any) -> Run:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run
