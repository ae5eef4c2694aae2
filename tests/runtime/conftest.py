"""Fixtures for the runtime tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.processes import write_positions


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local stream of 200 samples whose elements are their own positions (one per module)."""
    return write_positions(tmp_path_factory.mktemp("processes") / "stream")
