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


class RefusedStarts:
    """``Thread.start`` refused, as in a process out of threads, for threads whose names start
    with ``prefix`` while :attr:`on` (the aside thread itself started before)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
        _process.aside(lambda: None)
        self.on = True
        start = threading.Thread.start

        def failing(thread: threading.Thread) -> None:
            if thread.name.startswith(prefix) and self.on:
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", failing)


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


def test_a_pool_whose_thread_just_finished_a_call_starts_none_on_a_loop(starters: list[int]) -> None:
    """Between the end of a call and its thread's return to idle (its future's callbacks run
    there), a call submitted on a loop needs a thread: it is started aside all the same."""
    pool = _process._Pool(4, "guideloom-test")
    go, entered, gate = threading.Event(), threading.Event(), threading.Event()
    try:
        assert pool.submit(pow, 2, 0).result(timeout=30) == 1  # one thread, idle
        starters.clear()
        (first,), loop_thread = on_a_loop(lambda: [pool.submit(go.wait, 30)])
        first.add_done_callback(lambda _: (entered.set(), gate.wait(30)))
        go.set()
        assert entered.wait(30)  # the call is done; its thread is not idle yet
        (second,), _ = on_a_loop(lambda: [pool.submit(pow, 2, 3)])
        assert second.result(timeout=30) == 8
        gate.set()
        assert first.result(timeout=30) is True
        assert starters and loop_thread not in starters
    finally:
        gate.set()
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
    # a call queued before a shutdown runs, though its thread's start waited aside meanwhile
    late = _process._Pool(1, "guideloom-test")
    hold = threading.Event()
    _process.aside(lambda: hold.wait(30))  # the aside thread busy until the pool is shut down
    queued, _ = on_a_loop(lambda: late.submit(pow, 2, 2))
    late.shutdown(wait=False)
    hold.set()
    assert queued.result(timeout=30) == 4
    late.shutdown(wait=True)


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


def test_a_collate_thread_that_cannot_start_aside_fails_its_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process out of threads: the calls waiting get the error instead of waiting for ever, and
    a later call tries to start a thread again."""
    refused = RefusedStarts(monkeypatch, "guideloom-collate")
    pool = CollateThreads(1)
    (first, second), _ = on_a_loop(lambda: [pool.submit(pow, 2, 3), pool.submit(pow, 2, 4)])
    for future in (first, second):
        with pytest.raises(RuntimeError, match="can't start new thread"):
            future.result(timeout=30)
    refused.on = False
    (third,), _ = on_a_loop(lambda: [pool.submit(pow, 2, 5)])
    assert third.result(timeout=30) == 32
    pool.shutdown(wait=True)


def test_an_async_for_whose_collate_thread_cannot_start_raises_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    import guideloom as gl

    RefusedStarts(monkeypatch, "guideloom-collate")
    loader = gl.StatefulDataLoader.from_storage(
        gl.MemoryStreamStorage(np.arange(4096, dtype=np.uint16)), list, sequence_length=16, local_batch_size=4
    )

    async def epoch() -> None:
        async with loader:
            async for _ in loader:
                pass

    with pytest.raises(RuntimeError, match="can't start new thread"):
        asyncio.run(epoch())


def test_an_idle_aside_thread_lets_workers_fork_from_this_process() -> None:
    """After an ``async for`` (its collate thread started aside), the process may still fork its
    process workers itself: the aside thread waiting for work holds no lock a child would copy."""
    import subprocess
    import sys

    code = (
        "import asyncio, threading\n"
        "import numpy as np\n"
        "import guideloom as gl\n"
        "from guideloom._runtime.processes import zygote\n"
        "loader = gl.StatefulDataLoader.from_storage(\n"
        "    gl.MemoryStreamStorage(np.arange(4096, dtype=np.uint16)), list, sequence_length=16)\n"
        "async def epoch():\n"
        "    async with loader:\n"
        "        return [b async for b in loader]\n"
        "assert len(asyncio.run(epoch())) == 256\n"
        "assert [t.name for t in threading.enumerate()] == ['MainThread', 'guideloom-aside']\n"
        "assert zygote.fork_is_safe()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_pool_thread_that_cannot_start_aside_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    refusing = RefusedStarts(monkeypatch, "guideloom-test")
    pool = _process._Pool(2, "guideloom-test")
    try:
        (refused,), _ = on_a_loop(lambda: [pool.submit(pow, 2, 3)])
        with pytest.raises(RuntimeError, match="can't start new thread"):
            refused.result(timeout=30)
        refusing.on = False
        (taken,), _ = on_a_loop(lambda: [pool.submit(pow, 2, 4)])
        assert taken.result(timeout=30) == 16
    finally:
        pool.shutdown(wait=True)
