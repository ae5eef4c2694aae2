"""Fixtures for the whole suite: a check that a test leaves no guideloom thread running."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.support.loader import guideloom_threads
from tests.support.processes import own_segments, workers_up_first  # noqa: F401 - fixtures, for every test


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    """Fail if a test leaves guideloom threads running."""
    before = set(guideloom_threads())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t for t in guideloom_threads() if t not in before and t.is_alive()]
        if not left:
            return
        time.sleep(0.02)
    pytest.fail(f"threads left running: {[t.name for t in left]}")
