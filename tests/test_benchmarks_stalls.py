"""The stall benchmark's split of a wake-up's lateness: the run-queue wait it takes off is the
calling thread's own, in seconds, and only grows."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from benchmarks.stalls import RunQueue

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_run_queue_wait_is_the_calling_thread_s_and_grows() -> None:
    queue = RunQueue()
    assert queue.tid == threading.get_native_id()
    first = queue.waited()
    assert 0.0 <= first < 1e6
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:  # on a core, or waiting for one: never less than before
        pass
    assert queue.waited() >= first

    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(RunQueue().tid))
    t.start()
    t.join()
    assert seen and seen[0] != queue.tid
