"""A process worker warns by the warning filters of the process that started its pool, as the
collate would in that process, however the worker started: forked from the main process, or
from a process forked earlier (the standby zygote, the fork server), whose filters are those of
that earlier moment."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import guideloom as gl
from tests.support.processes import SEQ, CollateWarning, loader_for, warning_ids


@pytest.fixture
def another_thread() -> Iterator[None]:
    """A thread of the test's own alive: the workers cannot fork from this process, and start
    from one forked before this test's filters."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="stays")
    other.start()
    yield
    stop.set()
    other.join()


@pytest.mark.usefixtures("another_thread")
@pytest.mark.parametrize("action", ["ignore", "error"])
def test_a_workers_warning_follows_the_filters_of_the_process_that_started_it(
    tmp_path: Path, action: str
) -> None:
    """Ignored here: every batch arrives, where the filters of an earlier moment (the test
    session's, which make warnings errors) would fail the first. An error here: the first batch
    fails with the warning, where an interpreter's default filters would print it."""
    gl.write_stream(tmp_path / "ds", np.arange(64 * SEQ, dtype=np.int64))
    with warnings.catch_warnings():
        warnings.simplefilter(action, CollateWarning)
        loader = loader_for(tmp_path / "ds", warning_ids, collate_mode="workers")
        with loader:
            if action == "error":
                with pytest.raises(CollateWarning, match="finds odd"):
                    next(iter(loader))
            else:
                got = [i for batch in loader for i in batch]
                assert sorted(got) == list(range(64))
