"""A process worker warns by the warning filters of the process that started its pool, as the
collate would in that process, however the worker started: forked from the main process, or
from a process forked earlier (the standby zygote, the fork server), whose filters are those of
that earlier moment."""

from __future__ import annotations

import sys
import threading
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import guideloom as gl
from guideloom._runtime.processes.worker import use_warning_filters, warning_filters
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


def _made_at_run_time(monkeypatch: pytest.MonkeyPatch) -> type[Warning]:
    """A warning category of a module made at run time: only this process can import it (as a
    class under a script's main guard, which the workers' ``__main__`` does not run)."""
    module = types.ModuleType("made_at_run_time")

    class OnlyHere(UserWarning):
        pass

    OnlyHere.__module__, OnlyHere.__qualname__ = module.__name__, "OnlyHere"
    setattr(module, "OnlyHere", OnlyHere)  # noqa: B010 - a module made here
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return OnlyHere


def test_a_filter_whose_category_cannot_be_imported_is_left_out_and_the_others_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    only_here = _made_at_run_time(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", only_here)
        warnings.simplefilter("error", CollateWarning)
        sent = warning_filters()
        kept = [f for f in warnings.filters if f[2] is not only_here]
    assert sent is not None
    monkeypatch.delitem(sys.modules, "made_at_run_time")  # as in a worker
    with warnings.catch_warnings():
        use_warning_filters(sent)
        assert [(f[0], f[2], f[4]) for f in warnings.filters] == [(f[0], f[2], f[4]) for f in kept]


@pytest.mark.usefixtures("another_thread")
def test_the_workers_start_with_a_filter_of_a_category_only_this_process_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers start, and follow the filters they can import: the collate's warning,
    ignored here, does not fail its batch (the test session makes warnings errors)."""
    only_here = _made_at_run_time(monkeypatch)
    gl.write_stream(tmp_path / "ds", np.arange(64 * SEQ, dtype=np.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", only_here)
        warnings.simplefilter("ignore", CollateWarning)
        loader = loader_for(tmp_path / "ds", warning_ids, collate_mode="workers")
        with loader:
            got = [i for batch in loader for i in batch]
    assert sorted(got) == list(range(64))


def test_a_filter_that_does_not_pickle_leaves_the_others_sent() -> None:
    """A category defined in a function does not pickle: the other filters are sent all the
    same. A worker that has it too (forked from the pool's process) keeps it in its place; one
    that does not (another process's) leaves it out."""

    class Local(UserWarning):
        pass

    def described() -> list[tuple[str, object, int]]:
        return [(f[0], f[2], f[4]) for f in warnings.filters]

    with warnings.catch_warnings():
        warnings.simplefilter("error", CollateWarning)
        warnings.simplefilter("ignore", Local)
        warnings.simplefilter("ignore", DeprecationWarning)
        here = described()
        sent = warning_filters()
        assert sent.count(None) == 1 and len(sent) == len(here)
        use_warning_filters(sent)  # a worker forked from here
        assert described() == here
        warnings.resetwarnings()  # a worker of another process
        use_warning_filters(sent)
        assert described() == [f for f in here if f[1] is not Local]
