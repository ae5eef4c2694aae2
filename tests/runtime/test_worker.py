"""A worker process: its C heap (what it frees is reused by its next batches, not faulted in
again), and how it sees a message waiting in its task pipe."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.processes import run_script

SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from guideloom._runtime.processes.worker import keep_freed_heap

    if sys.argv[1] == "keep" and not keep_freed_heap():
        print("unset")
        raise SystemExit
    def task():  # a task's batches kept until its slot is written, then freed together
        kept = [np.ones(35_000, np.int64) for _ in range(16)]
        del kept
    task()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        task()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_worker_reuses_the_memory_its_last_task_freed(tmp_path: Path) -> None:
    """16 batches of 280 KB allocated and freed 20 times: with the worker's heap setting, the
    pages of the first task serve every later one (glibc's own thresholds give them back to the
    system and fault them in again at each task)."""
    script = tmp_path / "heap.py"
    script.write_text(SCRIPT)
    kept = run_script(script, "keep").stdout.strip()
    if kept == "unset":
        pytest.skip("not glibc: mallopt is not there")
    default = int(run_script(script, "default").stdout)
    assert int(kept) < 100 < default  # 20 tasks x 16 batches x 69 pages each, faulted again


def test_a_worker_sees_each_waiting_message_and_the_pipe_closing() -> None:
    """What a worker checks between its batches: a message sent and not yet read is seen until
    it is read, none otherwise, and the main process's end closing (read next: EOFError)."""
    import multiprocessing

    from guideloom._runtime.processes.worker import _pending

    tasks, main = multiprocessing.Pipe(duplex=False)
    pending = _pending(tasks)
    assert not pending()
    main.send(("task", 1))
    main.send(("task", 2))
    assert pending() and pending()
    assert tasks.recv() == ("task", 1)
    assert pending()
    assert tasks.recv() == ("task", 2)
    assert not pending()
    main.close()
    assert pending()
    with pytest.raises(EOFError):
        tasks.recv()
    tasks.close()
