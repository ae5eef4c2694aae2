"""Fixtures for the whole suite: a check that a test leaves no guideloom thread running; the ranks
of a module's tests forked from zygotes kept for the module; and the order in which
pytest-xdist's workers take the tests (``tests/support/schedule.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import schedule
from tests.support.loader import guideloom_threads
from tests.support.processes import own_segments, workers_up_first  # noqa: F401 - fixtures, for every test
from tests.support.ranks import shared_zygotes

#: Module fixtures that only save work where a module's tests share a worker (a zygote each worker
#: starts for itself): the tests that use them are still dealt out one by one.
PER_WORKER = frozenset({"_ranks_share_zygotes", "zygote_for"})

_seconds: dict[str, float] = {}  # each test's setup, call and teardown in this run


def _durations(config: pytest.Config) -> dict[str, float]:
    known = schedule.committed_durations()
    if getattr(config, "cache", None) is not None:
        known.update(config.cache.get(schedule.CACHE_KEY, {}))
    return known


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """The controller hands each worker the same durations, so that all order the tests alike."""
    node.workerinput["guideloom_durations"] = _durations(node.config)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and "guideloom_durations" in workerinput:
        ids = [item.nodeid for item in items]
        units = [_unit(item) for item in items]
        schedule.reorder(items, ids, workerinput["guideloom_durations"], workerinput["workercount"], units)


def _unit(item: pytest.Item) -> str:
    """The test's module where it uses a fixture set up once per module (or class), else itself."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else []
    shared = any(
        d.scope in ("module", "class", "package") and d.argname not in PER_WORKER for seq in defs for d in seq
    )
    return item.nodeid.split("::")[0] if shared else item.nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controller (or a run without workers) keeps this run's durations for the next."""
    config = session.config
    if hasattr(config, "workerinput") or getattr(config, "cache", None) is None or not _seconds:
        return
    known = config.cache.get(schedule.CACHE_KEY, {})
    known.update({nodeid: round(s, 2) for nodeid, s in _seconds.items()})
    config.cache.set(schedule.CACHE_KEY, known)


@pytest.fixture(scope="module", autouse=True)
def _ranks_share_zygotes() -> Iterator[None]:
    """The ranks that a module's tests start with ``run_ranks`` fork from zygotes kept for the
    module on this worker: a program's modules (torch, a framework) imported once, not once a
    run (``tests/support/ranks.py``). Each rank is still a process of its own."""
    with shared_zygotes():
        yield


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
