"""Thread and process workers: parallel collate, plan order kept, worker death."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import guideloom as gl
from tests.support.data import identity_stream
from tests.support.loader import flat, make, take

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def test_thread_workers_run_collate_in_parallel() -> None:
    active = 0
    peak = 0
    lock = threading.Lock()

    def collate(samples: Sequence[np.ndarray]) -> list[int]:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.02)
        with lock:
            active -= 1
        return [int(s[0]) // 4 for s in samples]

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(40),
        collate,
        sequence_length=4,
        local_batch_size=2,
        num_workers=3,
        device=torch.device("cpu"),
    )
    with loader:
        assert flat(take(loader)) == list(range(40))
    assert peak >= 2


@pytest.mark.usefixtures("workers_up_first")  # its batches come from the workers
@pytest.mark.slow
def test_process_workers_keep_order_and_errors() -> None:
    import multiprocessing

    loader = make(
        identity_stream(40),
        local_batch_size=3,
        num_workers=2,
        parallel_method="process",
        prefetch=2,
        persistent_workers=False,  # the default keeps them until the loader closes
    )
    with loader:
        it = iter(loader)
        assert next(it) == [0, 1, 2]
        assert multiprocessing.active_children()
        assert [next(it) for _ in range(3)] == [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
        it.close()
        assert multiprocessing.active_children() == []  # closing the iterator reaped the workers
        assert flat(take(loader)) == list(range(12, 39))
    assert multiprocessing.active_children() == []
    with pytest.raises(TypeError, match="picklable"):
        take(
            gl.StatefulDataLoader.from_storage(
                identity_stream(10),
                lambda s: s,
                sequence_length=4,
                num_workers=1,
                parallel_method="process",
                device=torch.device("cpu"),
            )
        )


@pytest.mark.usefixtures("workers_up_first")  # its batches come from the workers
@pytest.mark.slow
def test_a_worker_process_that_dies_is_a_worker_error() -> None:
    import multiprocessing

    from tests.support.data import die

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(20),
        die,
        sequence_length=4,
        local_batch_size=2,
        num_workers=2,
        parallel_method="process",
        device=torch.device("cpu"),
    )
    got = []
    with loader, pytest.raises(gl.WorkerError, match="died") as raised:
        for b in loader:
            got.append(b)
    # Every batch before the error, none after it: the batches of the task the worker died in
    # (sent together when done) are lost with it, and the error names them.
    assert got == [[0, 4], [8, 12], [16, 20], [24, 28], [32, 36]][: len(got)]
    first = len(got)
    assert f"batch {first}" in str(raised.value) or f"batches {first}-" in str(raised.value)
    assert multiprocessing.active_children() == []


@pytest.mark.usefixtures("workers_up_first")  # its batches come from the workers
@pytest.mark.slow
def test_a_worker_killed_between_batches_is_a_worker_error(caplog: pytest.LogCaptureFixture) -> None:
    import multiprocessing
    import os
    import signal

    from tests.support.data import IdsOf

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(400),
        IdsOf(4),
        sequence_length=4,
        local_batch_size=2,
        num_workers=2,
        parallel_method="process",
        prefetch=2,
        device=torch.device("cpu"),
    )
    got: list[list[int]] = []
    with loader, pytest.raises(gl.WorkerError, match="died"):
        for b in loader:
            got.append(b)
            if len(got) == 3:
                for child in multiprocessing.active_children():
                    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
                time.sleep(0.5)  # the pool notices before the next groups are handed over
    assert got[:3] == [[0, 1], [2, 3], [4, 5]]
    assert [i for b in got for i in b] == list(range(2 * len(got)))  # in order, none lost before
    assert multiprocessing.active_children() == []
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.slow
def test_open_begins_the_persistent_workers_the_first_iterator_uses() -> None:
    """``open()`` starts the persistent process workers while the dataset opens: the first
    iterator is served by that pool, its workers the same processes; ``inline`` starts none."""
    loader = make(
        identity_stream(40),
        local_batch_size=2,
        num_workers=2,
        parallel_method="process",
        collate_mode="workers",
    )
    with loader:
        pool = loader._state.life.pool
        assert pool is not None and (pool.starting() or any(p is not None for p in pool.procs))
        assert flat(take(loader)) == list(range(40))
        assert loader._state.life.pool is pool
        pool.join_start()  # the epoch may end before the second worker is up: it serves the next
        pids = [p.proc.pid for p in pool.procs if p is not None]
        assert len(pids) == 2
        assert flat(take(loader)) == list(range(40))
        assert [p.proc.pid for p in pool.procs if p is not None] == pids
    inline = make(identity_stream(40), local_batch_size=2, num_workers=2, parallel_method="process",
                  collate_mode="inline")  # fmt: skip
    with inline:
        assert inline._state.life.pool is None
        assert flat(take(inline)) == list(range(40))


def test_an_open_that_fails_leaves_no_worker_running() -> None:
    """The workers begun by ``open()`` stop when the open fails (here the size check)."""
    loader = make(identity_stream(3), local_batch_size=4, num_workers=2, parallel_method="process")
    with pytest.raises(ValueError, match="observations"):
        loader.open()
    assert loader._state.life.pool is None
    loader.close()
