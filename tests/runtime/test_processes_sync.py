"""The sync ``for`` over process workers without an event loop (:class:`SyncRun`): the same
batches as ``num_workers=0`` for every group size, exact resume, nothing left in ``/dev/shm``,
and a ``close()`` from another thread ending a blocked ``next()``."""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._runtime.processes import live_segments
from guideloom._runtime.runners import ProcessRunner
from tests.runtime.test_processes import SEQ, assert_same, ids, loader_for, rich, slow_ids, worker_pids
from tests.support.data import take

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_thread_leak")]


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local stream of 200 samples whose elements are their own positions."""
    folder = tmp_path_factory.mktemp("procpool_sync") / "stream"
    gl.write_stream(folder, np.arange(200 * SEQ, dtype=np.int32), shard_bytes=20_000)
    return folder


def sleepy(samples: Any) -> torch.Tensor:
    """20 ms a batch, and a batch large enough to travel through shared memory."""
    return torch.from_numpy(np.tile(np.asarray(slow_ids(samples)), (1, 2048)))


def loop_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("guideloom-loop")]


# (num_workers, prefetch) -> batches per group: group_size(prefetch + num_workers, num_workers).
GROUPS = [(2, 0, 1), (2, 8, 2), (1, 7, 4), (3, 45, 8), (2, 30, 8)]


@pytest.mark.parametrize(("workers", "prefetch", "group"), GROUPS)
def test_batches_equal_num_workers_0_for_each_group_size(
    stream: Path, workers: int, prefetch: int, group: int
) -> None:
    with loader_for(stream, rich, num_workers=0, shuffle=True, shuffle_seed=11, local_batch_size=3) as inline:
        expected = take(inline)
    loader = loader_for(
        stream,
        rich,
        num_workers=workers,
        prefetch=prefetch,
        shuffle=True,
        shuffle_seed=11,
        local_batch_size=3,
    )
    with loader:
        it = iter(loader)
        assert isinstance(it._runner, ProcessRunner)
        run = it._runner._run
        got = [next(it)]
        assert run.flow.group == group
        token = run.session.pool.token  # this pool's segments (other tests may run meanwhile)
        owner = got[0]["array"]
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert isinstance(owner, ctypes.Array)  # a view of a shared-memory slot, not a copy
        assert run.ahead <= prefetch + workers + 1  # the channel's credits, as on the loop
        assert loop_threads() == []  # no event loop between the workers and the consumer
        got.extend(it)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert_same(a, b)
    assert worker_pids() == set()
    del got, it, owner
    assert live_segments(token) == []


def test_resume_anywhere_with_any_group_size(stream: Path) -> None:
    with loader_for(stream, ids, num_workers=0, shuffle=True, shuffle_seed=4) as inline:
        expected = take(inline)
    loaders = {p: loader_for(stream, ids, shuffle=True, shuffle_seed=4, prefetch=p) for p in (0, 6, 30)}
    start = loaders[0].state_dict()

    @settings(max_examples=15, deadline=None, derandomize=True)
    @given(
        stop=st.integers(0, len(expected) - 1),
        first=st.sampled_from(sorted(loaders)),
        then=st.sampled_from(sorted(loaders)),
    )
    def resume(stop: int, first: int, then: int) -> None:
        a, b = loaders[first], loaders[then]
        a.load_state_dict(start)
        before = take(a, stop)
        b.load_state_dict(a.state_dict())
        assert before + take(b) == expected

    try:
        for lo in loaders.values():
            lo.open()
        resume()
    finally:
        for lo in loaders.values():
            lo.close()
    assert worker_pids() == set()


def test_close_from_another_thread_ends_a_blocked_next(stream: Path) -> None:

    loader = loader_for(stream, sleepy, prefetch=2, num_workers=1)
    with loader:
        it = iter(loader)
        next(it)
        assert isinstance(it._runner, ProcessRunner)
        token = it._runner._run.session.pool.token
        timer = threading.Timer(0.05, it.close)
        timer.start()
        t0 = time.monotonic()
        rest = list(it)  # ends once close() ran, not after the epoch
        timer.join()
        assert time.monotonic() - t0 < 2.0
        assert len(rest) < 40
        assert take(loader, 1)  # the loader goes on from where the iterator stopped
    del rest
    assert live_segments(token) == []


def as_int64(samples: Any) -> torch.Tensor:
    return torch.from_numpy(np.tile(np.stack(samples).astype(np.int64), (1, 16)))


def as_bfloat16(samples: Any) -> torch.Tensor:
    return as_int64(samples).to(torch.bfloat16)  # numpy has no bfloat16: the other view path


def as_transposed(samples: Any) -> torch.Tensor:
    return as_int64(samples).t()  # not contiguous: copied into the slot contiguous


def as_float32_array(samples: Any) -> np.ndarray:
    return np.tile(np.stack(samples).astype(np.float32), (1, 16))


@pytest.mark.parametrize("collate", [as_int64, as_bfloat16, as_transposed, as_float32_array])
def test_a_batch_that_is_one_array_travels_unpickled_and_a_group_shares_one_slot(
    stream: Path, collate: Any
) -> None:
    with loader_for(stream, collate, num_workers=0, shuffle=True, shuffle_seed=2) as inline:
        expected = take(inline)
    with loader_for(stream, collate, prefetch=14, shuffle=True, shuffle_seed=2) as loader:
        it = iter(loader)
        assert isinstance(it._runner, ProcessRunner)
        got = list(it)
        assert it._runner._run.flow.group == 4
        token = it._runner._run.session.pool.token
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)

    def address(x: Any) -> int:
        return int(x.data_ptr()) if isinstance(x, torch.Tensor) else int(x.ctypes.data)

    # One group, one slot: its batches lie one after the other at 64-byte aligned offsets.
    step = (got[0].nbytes + 63) // 64 * 64
    assert [address(b) - address(got[0]) for b in got[:4]] == [0, step, 2 * step, 3 * step]
    if isinstance(got[0], np.ndarray):
        base = got[0]
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, ctypes.Array)  # a view of the slot, not a copy
        del base
    del got
    assert live_segments(token) == []


def test_batches_for_a_device_keep_the_loop_thread_that_overlaps_the_copy(stream: Path) -> None:
    """To a device, the copy runs on the loop thread's mover, overlapped with the next batch
    (``meta`` stands in for an accelerator here), not in the consumer's thread after each batch."""
    from guideloom._runtime.runners import LoopThreadRunner

    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(stream), as_int64, sequence_length=SEQ, local_batch_size=4, num_workers=2,
        parallel_method="process", device=torch.device("meta"),
    )  # fmt: skip
    with loader:
        it = iter(loader)
        assert isinstance(it._runner, LoopThreadRunner)
        batch = next(it)
        assert batch.device.type == "meta" and batch.shape[0] == 4
        it.close()
