"""Pipeline internals that the loader tests reach only indirectly."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.plan import EpochPlan, Permutation
from guideloom._core.schedule import Indexes, _positions
from guideloom._runtime.config import PipelineConfig, group_size, move_to_device
from guideloom._runtime.executors import Here


def _cfg(n: int, batch: int, world: int, rank: int, offset: int) -> PipelineConfig:
    return PipelineConfig(
        dataset=gl.StreamDataset(gl.MemoryStreamStorage(np.arange(n)), 1),
        plan=EpochPlan(n, batch, world, rank, drop_last=False, start_offset=offset),
        order=Permutation(n, shuffle=True, seed=3, epoch=0),
        collate_fn=list,
        device=torch.device("cpu"),
        pin_memory=False,
        num_workers=0,
        parallel_method="thread",
        prefetch=0,
    )


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 500),
    batch=st.integers(1, 7),
    world=st.integers(1, 4),
    offset=st.integers(0, 60),
    block=st.integers(1, 40),
    windows=st.lists(st.integers(1, 9), min_size=1, max_size=30),
    data=st.data(),
)
def test_block_indexes_equal_direct_lookups(
    n: int, batch: int, world: int, offset: int, block: int, windows: list[int], data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world - 1))
    cfg = _cfg(n, batch, world, rank, offset)
    idx = Indexes(cfg.plan, cfg.order)
    idx.BLOCK_POSITIONS = block  # type: ignore[misc]
    step = 0
    for w in windows:
        if step >= len(cfg.plan):
            break
        specs = [cfg.plan.batch(s) for s in range(step, min(len(cfg.plan), step + w))]
        assert idx.of(specs).tolist() == cfg.order.take(_positions(specs)).tolist()
        step += len(specs)


def test_group_size_bounds() -> None:
    assert group_size(0, 2) == 1
    assert group_size(18, 2) == 4
    assert group_size(1000, 1) == 8


def test_move_to_device_keeps_structure_and_non_tensors() -> None:
    t = torch.arange(3)
    obj: Any = {"a": t, "b": [t, "text", 3], "c": (t,)}
    out = move_to_device(obj, torch.device("meta"), pin_memory=False)
    assert out["a"].device.type == "meta" and out["b"][1:] == ["text", 3] and isinstance(out["c"], tuple)
    same = move_to_device(obj, torch.device("cpu"), pin_memory=True)
    assert same["a"] is t


# -- the inline pipeline (num_workers=0, prefetch=0, a storage that reads inline) ----------------------
class AsyncOnlyStream(gl.MemoryStreamStorage):
    """The same data, read only through ``read_many``: the loader must use the event-loop path."""

    async def read_many(self, starts: np.ndarray, length: int) -> Any:
        await asyncio.sleep(0)
        return await super().read_many(starts, length)


def _epoch_and_states(storage: Any, n_steps: int | None = None, **kw: Any) -> tuple[list[Any], list[Any]]:
    loader = gl.StatefulDataLoader.from_storage(
        storage, lambda s: [int(x[0]) for x in s], sequence_length=4, device=torch.device("cpu"), **kw
    )
    batches, states = [], []
    with loader:
        for b in loader:
            batches.append(b)
            states.append(dict(loader.state_dict()))
    return batches, states


def test_reads_inline_only_where_the_blocking_read_is_the_read() -> None:
    from guideloom._datasets import StreamDataset

    assert StreamDataset(gl.MemoryStreamStorage(np.arange(8)), 4)._reads_inline
    # A subclass that overrides only read_many: its own read must be called, so not inline.
    assert not StreamDataset(AsyncOnlyStream(np.arange(8)), 4)._reads_inline

    class SyncOverride(gl.MemoryStreamStorage):
        def read_many_sync(self, starts: np.ndarray, length: int) -> Any:
            return super().read_many_sync(starts, length)

    assert StreamDataset(SyncOverride(np.arange(8)), 4)._reads_inline


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 120),
    batch=st.integers(1, 9),
    world=st.integers(1, 3),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 3),
)
def test_inline_pipeline_equals_the_event_loop_pipeline(
    n: int, batch: int, world: int, drop_last: bool, shuffle: bool, seed: int
) -> None:
    rank = seed % world
    assume(n >= batch * world)  # fewer is an error (tested elsewhere)
    kw: dict[str, Any] = dict(
        local_batch_size=batch,
        world_size=world,
        rank=rank,
        drop_last=drop_last,
        shuffle=shuffle,
        shuffle_seed=seed,
    )
    tokens = np.arange(n * 4 + 3, dtype=np.int64)
    inline = _epoch_and_states(gl.MemoryStreamStorage(tokens), **kw)
    looped = _epoch_and_states(AsyncOnlyStream(tokens), **kw)
    assert inline == looped


def test_inline_iteration_runs_no_event_loop_and_works_inside_one() -> None:
    loader = gl.StatefulDataLoader.from_storage(
        identity_storage := gl.MemoryStreamStorage(np.arange(64)),
        lambda s: [int(x[0]) for x in s],
        sequence_length=4,
        local_batch_size=2,
        device=torch.device("cpu"),
    )
    assert identity_storage.reads_inline()
    threads = set(threading.enumerate())

    async def inside_a_loop() -> list[Any]:
        with loader:
            it = iter(loader)
            assert isinstance(it._driver.flow.here, Here)  # no event loop, no loop thread
            assert it._driver.flow.workers is None
            out = list(it)
            assert set(threading.enumerate()) <= threads  # no loop thread was started
            return out

    got = asyncio.run(inside_a_loop())
    assert [x for b in got for x in b] == list(range(0, 64, 4))


def test_inline_pipeline_reports_a_collate_error_at_its_batch_and_stops() -> None:
    def collate(s: Any) -> list[int]:
        ids_ = [int(x[0]) // 4 for x in s]
        if 5 in ids_:
            raise ValueError("bad sample 5")
        return ids_

    loader = gl.StatefulDataLoader.from_storage(
        gl.MemoryStreamStorage(np.arange(64)),
        collate,
        sequence_length=4,
        local_batch_size=2,
        device=torch.device("cpu"),
    )
    got: list[Any] = []
    with loader:
        with pytest.raises(ValueError, match="bad sample 5"):
            for b in loader:
                got.append(b)
        assert got == [[0, 1], [2, 3]]
        assert loader.state_dict()["observation_offset"] == 4  # the failed batch is not consumed


def test_a_dataset_subclass_that_overrides_read_many_is_read_through_it() -> None:
    from guideloom._datasets import StreamDataset

    class Augmented(StreamDataset[Any]):
        async def read_many(self, indices: np.ndarray) -> Any:
            return [s + 1000 for s in await super().read_many(indices)]

    ds = Augmented(gl.MemoryStreamStorage(np.arange(32)), 4)
    assert not ds._reads_inline
    assert StreamDataset(gl.MemoryStreamStorage(np.arange(32)), 4)._reads_inline


def test_an_eoferror_from_the_storage_is_the_batch_error_not_the_end_of_the_epoch() -> None:
    class Truncated(gl.MemoryStreamStorage):
        def read_many_sync(self, starts: np.ndarray, length: int) -> Any:
            if 8 in starts.tolist():
                raise EOFError("unexpected end of shard")
            return super().read_many_sync(starts, length)

    loader = gl.StatefulDataLoader.from_storage(
        Truncated(np.arange(64)),
        lambda s: [int(x[0]) for x in s],
        sequence_length=4,
        local_batch_size=1,
        device=torch.device("cpu"),
    )
    got: list[Any] = []
    with loader, pytest.raises(EOFError, match="unexpected end of shard"):
        for b in loader:
            got.append(b)
    assert got == [[0], [4]]


def test_an_empty_rank_batch_is_an_empty_sequence_with_the_sample_shape() -> None:
    seen: list[Any] = []

    def collate(samples: Any) -> Any:
        seen.append((samples == [], len(samples), np.asarray(samples).shape, np.asarray(samples).dtype))
        return len(samples)

    loader = gl.StatefulDataLoader.from_storage(
        gl.MemoryStreamStorage(np.arange(25 * 10, dtype=np.uint16)),
        collate,
        sequence_length=10,
        local_batch_size=3,
        world_size=2,
        rank=1,
        drop_last=False,
        device=torch.device("cpu"),
    )
    with loader:
        assert list(loader)[-1] == 0
    assert seen[-1] == (True, 0, (0, 10), np.dtype(np.uint16))


def test_closing_from_another_thread_ends_an_inline_iteration_cleanly() -> None:
    loader = gl.StatefulDataLoader.from_storage(
        gl.MemoryStreamStorage(np.arange(4000)),
        len,
        sequence_length=4,
        local_batch_size=2,
        device=torch.device("cpu"),
    )
    n = 0
    with loader:
        for _ in loader:
            n += 1
            if n == 5:
                t = threading.Thread(target=loader.close)
                t.start()
                t.join()
    assert n == 5 and loader.state_dict()["observation_offset"] == 10
