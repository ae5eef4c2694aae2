"""Threads are never started on a thread that runs an event loop: the storage's pools and the
collate threads have them started by the aside thread, and behave as before otherwise."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from guideloom import _process
from guideloom._runtime.threadpool import CollateThreads


@pytest.fixture
def starters(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The idents of the threads that call ``Thread.start``, in order."""
    calls: list[int] = []
    start = threading.Thread.start

    def recorded(self: threading.Thread) -> None:
        calls.append(threading.get_ident())
        start(self)

    monkeypatch.setattr(threading.Thread, "start", recorded)
    _process.aside(lambda: None)  # the aside thread itself, started before the test
    calls.clear()
    yield calls


def on_a_loop(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` called in a coroutine, and the ident of the loop's thread."""

    async def run() -> Any:
        return fn()

    return asyncio.run(run()), threading.get_ident()


def test_a_pool_asked_on_a_loop_starts_its_threads_aside(starters: list[int]) -> None:
    pool = _process._Pool(4, "guideloom-test")
    gate = threading.Event()
    running = threading.Semaphore(0)

    def wait() -> bool:
        running.release()
        return gate.wait(30)

    try:
        futures, loop_thread = on_a_loop(lambda: [pool.submit(wait) for _ in range(4)])
        assert all(running.acquire(timeout=30) for _ in range(4))  # four at once: four threads
        gate.set()
        assert [f.result(timeout=30) for f in futures] == [True] * 4
        assert len(starters) == 4 and loop_thread not in starters
        # idle threads are reused where they are, without the aside thread
        again, _ = on_a_loop(lambda: [pool.submit(pow, 2, i) for i in range(3)])
        assert [f.result(timeout=30) for f in again] == [1, 2, 4]
        assert len(starters) == 4
    finally:
        pool.shutdown(wait=True)


def test_a_pool_off_a_loop_starts_threads_where_it_is_asked(starters: list[int]) -> None:
    pool = _process._Pool(2, "guideloom-test")
    try:
        assert pool.submit(pow, 3, 2).result(timeout=30) == 9
        assert starters == [threading.get_ident()]
    finally:
        pool.shutdown(wait=True)


def test_errors_and_refusals_reach_the_future_of_a_call_submitted_aside() -> None:
    pool = _process._Pool(1, "guideloom-test")
    gate = threading.Event()
    try:
        (busy, failing), _ = on_a_loop(lambda: [pool.submit(gate.wait, 30), pool.submit(int, "x")])
        gate.set()
        assert busy.result(timeout=30) is True
        with pytest.raises(ValueError, match="invalid literal"):
            failing.result(timeout=30)
    finally:
        pool.shutdown(wait=True)
    closed = _process._Pool(1, "guideloom-test")
    closed.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        closed.submit(pow, 2, 2)
    # a call handed aside to a pool shut down meanwhile gets the refusal, never hangs
    late = _process._Pool(1, "guideloom-test")
    hold = threading.Event()
    _process.aside(lambda: hold.wait(30))  # the aside thread busy until the pool is shut down
    refused, _ = on_a_loop(lambda: late.submit(pow, 2, 2))
    late.shutdown()
    hold.set()
    with pytest.raises(RuntimeError, match="after shutdown"):
        refused.result(timeout=30)


def test_collate_threads_asked_on_a_loop_start_aside_and_close_in_time(starters: list[int]) -> None:
    pool = CollateThreads(2)
    futures, loop_thread = on_a_loop(lambda: [pool.submit(pow, 2, i) for i in range(5)])
    assert [f.result(timeout=30) for f in futures] == [1, 2, 4, 8, 16]
    pool.shutdown(wait=True)  # the threads' starts aside included
    assert len(starters) == 2 and loop_thread not in starters
    assert not any(t.is_alive() for t in pool._threads)


def test_collate_threads_shut_down_before_their_start_aside_still_run_what_was_queued() -> None:
    hold = threading.Event()
    _process.aside(lambda: hold.wait(30))  # nothing starts aside until the shutdown is asked
    pool = CollateThreads(1)
    (future,), _ = on_a_loop(lambda: [pool.submit(pow, 2, 5)])
    closer = concurrent.futures.ThreadPoolExecutor(1)
    try:
        done = closer.submit(pool.shutdown, True, grace=30)
        hold.set()
        done.result(timeout=60)
        assert future.result(timeout=0) == 32
    finally:
        closer.shutdown()
