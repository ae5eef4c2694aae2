"""``collate_mode``: the workers' collate measured (``"auto"``) or pinned (``"workers"``,
``"inline"``), the same batches either way, and ``stats()`` saying where batches were collated
and what the chooser last chose."""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from guideloom._runtime.chooser import LOOP_CHEAP_CALLS
from guideloom._runtime.executors import Threads
from tests.support.data import identity_stream
from tests.support.loader import guideloom_threads, make, take
from tests.support.processes import worker_pids

pytestmark = pytest.mark.usefixtures("no_thread_leak")

PLACES = ("collated_inline", "collated_threads", "collated_processes")


def where(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    """The batch's ids, and the process and thread that collated it."""
    return {
        "ids": [int(s[0]) // 4 for s in samples],
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
    }


def ids_of(batches: list[dict[str, Any]]) -> list[list[int]]:
    return [b["ids"] for b in batches]


def places(stats: dict[str, float]) -> tuple[float, ...]:
    return tuple(stats[k] for k in PLACES)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"collate_mode": "threads"}, "collate_mode must be 'auto', 'workers' or 'inline'"),
        ({"collate_mode": "process"}, "collate_mode must be"),
        ({"collate_mode": "workers"}, r"collate_mode='workers' needs num_workers > 0"),
    ],
)
def test_a_bad_collate_mode_is_a_value_error(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(identity_stream(10), **kw)


def test_the_default_is_auto_and_inline_needs_no_workers() -> None:
    assert make(identity_stream(10)).collate_mode == "auto"
    assert make(identity_stream(10), num_workers=2).collate_mode == "auto"
    assert make(identity_stream(10), collate_mode="inline").collate_mode == "inline"


def test_the_default_with_process_workers_is_the_workers_only() -> None:
    """``collate_fn`` runs in the worker processes only, unless asked otherwise."""
    assert make(identity_stream(10), num_workers=2, parallel_method="process").collate_mode == "workers"
    assert make(identity_stream(10), parallel_method="process").collate_mode == "auto"  # no workers
    asked = make(identity_stream(10), num_workers=2, parallel_method="process", collate_mode="auto")
    assert asked.collate_mode == "auto"


def test_pinned_workers_collate_every_batch_on_the_threads() -> None:
    kw: dict[str, Any] = {"collate": where, "local_batch_size": 3, "shuffle": True, "shuffle_seed": 4}
    with make(identity_stream(200), **kw) as plain:
        expected = ids_of(take(plain))
    loader = make(identity_stream(200), num_workers=2, prefetch=2, collate_mode="workers", **kw)
    with loader:
        it = iter(loader)
        assert isinstance(it._driver.flow.workers, Threads)
        got = list(it)
    assert ids_of(got) == expected
    assert all(b["thread"].startswith("guideloom-collate") for b in got)
    stats = loader.stats()
    assert places(stats) == (0, len(got), 0)
    assert not any(k.startswith("chooser_") for k in stats)  # nothing measured


def test_pinned_inline_collates_in_the_callers_thread_and_starts_no_worker() -> None:
    with make(identity_stream(200), collate=where, local_batch_size=3) as plain:
        expected = ids_of(take(plain))
    loader = make(identity_stream(200), collate=where, local_batch_size=3, num_workers=2, prefetch=4,
                  collate_mode="inline")  # fmt: skip
    me = threading.current_thread().name
    with loader:
        got = []
        for batch in loader:
            got.append(batch)
            assert guideloom_threads() == []
    assert ids_of(got) == expected
    assert {b["thread"] for b in got} == {me}
    assert places(loader.stats()) == (len(got), 0, 0)


def test_auto_reports_the_choosers_verdict_and_where_each_batch_was_collated() -> None:
    """A cheap collate with thread workers: the chooser measures both ways and says so."""
    loader = make(identity_stream(3000), collate=where, local_batch_size=2, num_workers=2, prefetch=2)
    with loader:
        got = take(loader)
    stats = loader.stats()
    on_threads = sum(b["thread"].startswith("guideloom-collate") for b in got)
    assert places(stats) == (len(got) - on_threads, on_threads, 0)
    assert stats["chooser_verdicts"] >= 1 and stats["chooser_workers"] in (0.0, 1.0)
    assert stats["chooser_workers_seconds"] > 0 and stats["chooser_inline_seconds"] > 0


@pytest.mark.parametrize("prefetch", [0, 2])
def test_stats_count_the_collate_thread_of_async_for(prefetch: int) -> None:
    """``async for`` at num_workers=0 collates on a thread of its own; at prefetch=0, a collate
    measured cheap (its first calls, on the thread) then runs on the caller's loop."""
    loader = make(identity_stream(200), local_batch_size=2, prefetch=prefetch)

    async def run() -> int:
        async with loader:
            return len([b async for b in loader])

    n = asyncio.run(run())
    inline, threads, processes = places(loader.stats())
    assert inline + threads == n and processes == 0
    if prefetch:
        assert inline == 0
    else:  # (a call that a loaded machine made slow goes back to the thread for a few more)
        assert threads >= LOOP_CHEAP_CALLS and inline > n // 2, (inline, threads)


def test_collate_mode_can_change_between_epochs() -> None:
    loader = make(identity_stream(40), local_batch_size=2, num_workers=2, collate_mode="inline")
    with loader:
        first = take(loader)
        loader.collate_mode = "workers"
        second = take(loader)
    assert first == second
    assert places(loader.stats()) == (20, 20, 0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["workers", "inline", "auto"])
def test_process_workers_pinned_or_measured(mode: str, request: pytest.FixtureRequest) -> None:
    n = 300
    if mode == "auto":  # the chooser measures the workers once they are up, over a long enough epoch
        request.getfixturevalue("workers_up_first")
        n = 6000  # (its chunks span the workers' tasks: cheap batches go 32 a task)
    kw: dict[str, Any] = {"collate": where, "local_batch_size": 3, "shuffle": True, "shuffle_seed": 4}
    with make(identity_stream(n), **kw) as plain:
        expected = ids_of(take(plain))
    loader = make(identity_stream(n), num_workers=2, parallel_method="process", collate_mode=mode, **kw)
    with loader:
        it = iter(loader)
        if mode == "inline":
            assert it._driver.procs is None
        got = list(it)
        if mode == "inline":
            assert worker_pids() == set()  # none was started
        stats = loader.stats()
        later = stats
        # a chunk with a stall in it (a loaded machine) is set aside as the consumer's pause, not
        # measured: the verdict may take another epoch or two there
        for _ in range(4):
            if mode != "auto" or "chooser_verdicts" in later:
                break
            list(loader)
            later = loader.stats()
    assert ids_of(got) == expected
    in_workers = sum(b["pid"] != os.getpid() for b in got)
    assert places(stats) == (len(got) - in_workers, 0, in_workers)
    if mode == "workers":
        assert in_workers == len(got) and "chooser_workers" not in stats
    elif mode == "inline":
        assert in_workers == 0
    else:
        assert later["chooser_verdicts"] >= 1
        assert not math.isnan(later["chooser_workers_seconds"])
    assert worker_pids() == set()


def test_async_for_with_pinned_workers_collates_on_the_workers() -> None:
    """Where no choice is made (``async for``), ``"workers"`` is what happens anyway."""
    loader = make(identity_stream(40), collate=where, local_batch_size=2, num_workers=2,
                  collate_mode="workers")  # fmt: skip

    async def run() -> list[dict[str, Any]]:
        async with loader:
            return [b async for b in loader]

    got = asyncio.run(run())
    assert all(b["thread"].startswith("guideloom-collate") for b in got)
    assert places(loader.stats()) == (0, len(got), 0)


@pytest.mark.slow
@pytest.mark.usefixtures("workers_up_first")
def test_async_for_with_auto_collates_every_batch_on_workers_that_are_up() -> None:
    """Under ``async for`` with ``"auto"``, batches are made here only while the workers start:
    once they are up (here before the first batch; persistent, in every later epoch), every
    batch is theirs, the first of each epoch too."""
    loader = make(identity_stream(60), collate=where, local_batch_size=3, num_workers=2,
                  parallel_method="process", collate_mode="auto", persistent_workers=True)  # fmt: skip

    async def epochs() -> list[tuple[float, ...]]:
        out = []
        async with loader:
            for _ in range(3):
                before = places(loader.stats())
                got = [b async for b in loader]
                assert ids_of(got) == [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(20)]
                out.append(tuple(a - b for a, b in zip(places(loader.stats()), before, strict=True)))
        return out

    assert asyncio.run(epochs()) == [(0, 0, 20)] * 3
