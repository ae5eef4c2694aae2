"""StatefulDataLoader: the reference page and the contract, end to end over memory storage."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

import guideloom as gl
from guideloom.pytorch import StatefulDataLoader

from ._helpers import check_resume_equals_uninterrupted, identity_stream, make, roundtrip, take
from .conftest import stack_collate

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


# -- construction and arguments ----------------------------------------------------------------
def test_same_object_from_both_modules() -> None:
    assert gl.StatefulDataLoader is StatefulDataLoader


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"local_batch_size": 0}, "local_batch_size"),
        ({"world_size": 0}, "world_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"prefetch": -1}, "prefetch"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"parallel_method": "fork"}, "parallel_method"),
    ],
)
def test_bad_arguments_raise_value_error(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(identity_stream(10), **kw)


def test_sequence_length_below_one() -> None:
    with pytest.raises(ValueError, match="sequence_length"):
        StatefulDataLoader.from_storage(identity_stream(10), stack_collate, sequence_length=0)


def test_from_storage_pairing_errors() -> None:
    with pytest.raises(ValueError, match="sequence_length"):
        StatefulDataLoader.from_storage(identity_stream(10), stack_collate)  # type: ignore[call-overload]
    docs = gl.MemoryDocumentStorage([np.arange(3)])
    with pytest.raises(ValueError, match=r"takes no"):
        StatefulDataLoader.from_storage(docs, stack_collate, sequence_length=4)
    with pytest.raises(TypeError, match="StreamStorageAbstract"):
        StatefulDataLoader.from_storage(np.arange(3), stack_collate, sequence_length=4)  # type: ignore[call-overload]


def test_from_storage_builds_the_matching_dataset() -> None:
    s = StatefulDataLoader.from_storage(identity_stream(10), stack_collate, sequence_length=4)
    assert isinstance(s.dataset, gl.StreamDataset) and s.dataset.sequence_length == 4
    d = StatefulDataLoader.from_storage(gl.MemoryDocumentStorage([np.arange(3)]), stack_collate)
    assert isinstance(d.dataset, gl.DocumentDataset)


def test_defaults_and_default_device() -> None:
    loader = StatefulDataLoader(gl.StreamDataset(identity_stream(10), 4), stack_collate)
    assert loader.device == StatefulDataLoader.get_default_device() == torch.device("cpu")
    assert (loader.local_batch_size, loader.rank, loader.world_size, loader.num_workers) == (1, 0, 1, 0)
    assert (loader.parallel_method, loader.shuffle, loader.shuffle_seed) == ("thread", False, None)
    assert (loader.pin_memory, loader.drop_last, loader.prefetch) == (False, True, 0)


def test_construction_does_not_read_and_open_checks_size() -> None:
    class Exploding(gl.MemoryStreamStorage):
        async def open(self) -> None:
            raise AssertionError("construction must not open the storage")

    make(Exploding(np.arange(40)))  # no error
    loader = make(identity_stream(5), local_batch_size=3, world_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        loader.open()
    with pytest.raises(ValueError, match="fewer than one global batch"), loader:
        pass


def test_len_and_global_batch_size() -> None:
    loader = make(identity_stream(10), local_batch_size=2, world_size=2, drop_last=True)
    assert loader.global_batch_size == 4
    with loader:
        assert len(loader) == 2
    assert len(make(identity_stream(10), local_batch_size=2, world_size=2, drop_last=False)) == 3
    # trailing elements that do not fill a sample are not a sample
    assert len(make(identity_stream(10, extra=3), local_batch_size=1)) == 10


# -- order and partitioning --------------------------------------------------------------------
def test_unshuffled_order_and_rank_blocks() -> None:
    per_rank = []
    for rank in range(3):
        with make(identity_stream(20), local_batch_size=2, world_size=3, rank=rank) as loader:
            per_rank.append(take(loader))
    assert per_rank[0] == [[0, 1], [6, 7], [12, 13]]
    assert per_rank[1] == [[2, 3], [8, 9], [14, 15]]
    assert per_rank[2] == [[4, 5], [10, 11], [16, 17]]  # 18, 19 dropped with the last global batch


def test_drop_last_false_gives_empty_lists_to_trailing_ranks() -> None:
    calls: list[int] = []

    def collate(samples: Sequence[np.ndarray]) -> list[int]:
        calls.append(len(samples))
        return [int(s[0]) // 4 for s in samples]

    per_rank = []
    for rank in range(3):
        loader = gl.StatefulDataLoader.from_storage(
            identity_stream(13),
            collate,
            sequence_length=4,
            local_batch_size=2,
            world_size=3,
            rank=rank,
            drop_last=False,
            device=torch.device("cpu"),
        )
        with loader:
            per_rank.append(take(loader))
    assert [len(b) for b in per_rank] == [3, 3, 3]  # lockstep
    assert per_rank[0][-1] == [12] and per_rank[1][-1] == [] and per_rank[2][-1] == []
    assert sorted(flat(per_rank[0]) + flat(per_rank[1]) + flat(per_rank[2])) == list(range(13))
    assert 0 in calls


def test_world_size_one_never_gets_an_empty_list() -> None:
    sizes: list[int] = []

    def collate(samples: Sequence[np.ndarray]) -> int:
        sizes.append(len(samples))
        return len(samples)

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(13),
        collate,
        sequence_length=4,
        local_batch_size=5,
        drop_last=False,
        device=torch.device("cpu"),
    )
    with loader:
        assert take(loader) == [5, 5, 3]
    assert 0 not in sizes


@pytest.mark.parametrize("drop_last", [True, False])
def test_shuffled_epoch_is_a_permutation_and_epochs_differ(drop_last: bool) -> None:
    with make(
        identity_stream(103), local_batch_size=10, shuffle=True, shuffle_seed=3, drop_last=drop_last
    ) as loader:
        e0 = flat(take(loader))
        e1 = flat(take(loader))
        assert loader.state_dict()["epoch"] == 2
    n = 100 if drop_last else 103
    assert len(e0) == len(set(e0)) == n and len(e1) == n
    assert e0 != e1 and e0 != sorted(e0)


def test_order_depends_only_on_seed_epoch_and_n() -> None:
    base = None
    for kw in [
        {"local_batch_size": 1},
        {"local_batch_size": 7},
        {"local_batch_size": 7, "num_workers": 2},
        {"local_batch_size": 3, "prefetch": 5},
        {"local_batch_size": 3, "num_workers": 3, "prefetch": 2},
        {"local_batch_size": 4, "device": torch.device("meta")},
    ]:
        with make(identity_stream(84), shuffle=True, shuffle_seed=11, drop_last=False, **kw) as loader:
            order = flat(take(loader))
        base = base or order
        assert order == base, kw
    # ranks together see the same order, in rank blocks
    blocks = []
    for rank in range(2):
        with make(
            identity_stream(84), shuffle=True, shuffle_seed=11, local_batch_size=3, world_size=2, rank=rank
        ) as lo:
            blocks.append(take(lo))
    assert [i for a, b in zip(*blocks, strict=True) for i in a + b] == base


def test_shuffle_seed_none_is_a_permutation_not_reproducible() -> None:
    orders = []
    for _ in range(2):
        with make(identity_stream(200), shuffle=True, local_batch_size=10) as loader:
            orders.append(flat(take(loader)))
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(200))
    assert orders[0] != orders[1]


# -- checkpoints ---------------------------------------------------------------------------------
def test_state_dict_counts_only_delivered_batches() -> None:
    with make(identity_stream(50), local_batch_size=2, world_size=2, prefetch=4, num_workers=2) as loader:
        assert loader.state_dict() == {
            "epoch": 0,
            "observation_offset": 0,
            "shuffle": False,
            "shuffle_seed": None,
            "drop_last": True,
            "dataset": {"kind": "stream", "observations": 50, "sequence_length": 4, "digest": ""},
        }
        it = iter(loader)
        next(it)
        next(it)
        time.sleep(0.05)  # let the pipeline prefetch
        assert loader.state_dict()["observation_offset"] == 8
        it.close()
        assert loader.state_dict()["observation_offset"] == 8


def test_offset_includes_padding_of_the_final_partial_batch_and_epoch_increments() -> None:
    with make(identity_stream(10), local_batch_size=4, drop_last=False) as loader:
        it = iter(loader)
        assert [next(it) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert loader.state_dict()["observation_offset"] == 12
        assert loader.state_dict()["epoch"] == 0
        with pytest.raises(StopIteration):
            next(it)
        assert (loader.state_dict()["epoch"], loader.state_dict()["observation_offset"]) == (1, 0)


def test_checkpoint_is_plain_and_weights_only_loadable() -> None:
    with make(identity_stream(10), shuffle=True, shuffle_seed=5) as loader:
        take(loader, 3)
        state = roundtrip(loader.state_dict())
    assert state == {
        "epoch": 0,
        "observation_offset": 3,
        "shuffle": True,
        "shuffle_seed": 5,
        "drop_last": True,
        "dataset": {"kind": "stream", "observations": 10, "sequence_length": 4, "digest": ""},
    }


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    "workers", [{}, {"num_workers": 2}, {"prefetch": 3}, {"num_workers": 1, "prefetch": 2}]
)
@pytest.mark.parametrize("stop_after", [0, 1, 4, 9])
def test_resume_equals_uninterrupted(
    shuffle: bool, drop_last: bool, workers: dict[str, int], stop_after: int
) -> None:
    check_resume_equals_uninterrupted(
        37, stop_after, local_batch_size=4, shuffle=shuffle, shuffle_seed=7, drop_last=drop_last, **workers
    )


@pytest.mark.parametrize(("batch2", "world2"), [(2, 1), (5, 1), (3, 3), (1, 4)])
def test_resume_with_other_batch_and_world_size_continues_at_the_global_position(
    batch2: int, world2: int
) -> None:
    n, seed = 60, 21
    with make(
        identity_stream(n), local_batch_size=4, world_size=1, shuffle=True, shuffle_seed=seed, drop_last=False
    ) as full:
        order = flat(take(full))
    # two ranks of batch 3 for 4 steps: 24 observations delivered
    seen = []
    states = []
    for rank in range(2):
        with make(
            identity_stream(n),
            local_batch_size=3,
            world_size=2,
            rank=rank,
            shuffle=True,
            shuffle_seed=seed,
            drop_last=False,
        ) as lo:
            seen += flat(take(lo, 4))
            states.append(lo.state_dict())
    assert states[0] == states[1] and states[0]["observation_offset"] == 24
    assert sorted(seen) == sorted(order[:24])
    after = []
    per_rank = []
    for rank in range(world2):
        with make(
            identity_stream(n),
            local_batch_size=batch2,
            world_size=world2,
            rank=rank,
            shuffle=True,
            shuffle_seed=seed,
            drop_last=False,
        ) as lo:
            lo.load_state_dict(roundtrip(states[0]))
            assert len(lo) == -(-n // (batch2 * world2))  # len stays the whole epoch's
            per_rank.append(take(lo))
    assert len({len(b) for b in per_rank}) == 1
    for step in zip(*per_rank, strict=True):
        after += [i for block in step for i in block]
    assert after == order[24:]


def test_resume_at_an_offset_that_is_not_a_multiple_of_the_batch() -> None:
    with make(identity_stream(20), local_batch_size=4) as loader:
        loader.load_state_dict(
            {
                "dataset": loader.state_dict()["dataset"],
                "epoch": 0,
                "observation_offset": 6,
                "shuffle": False,
                "shuffle_seed": None,
                "drop_last": True,
            }
        )
        assert take(loader) == [[6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16, 17]]
        assert loader.state_dict()["epoch"] == 1


def test_resume_into_a_later_epoch_uses_that_epochs_order() -> None:
    with make(identity_stream(30), local_batch_size=5, shuffle=True, shuffle_seed=1) as loader:
        take(loader)
        epoch1 = take(loader)
    with make(identity_stream(30), local_batch_size=5, shuffle=True, shuffle_seed=1) as loader:
        loader.load_state_dict(
            {
                "dataset": loader.state_dict()["dataset"],
                "epoch": 1,
                "observation_offset": 10,
                "shuffle": True,
                "shuffle_seed": 1,
                "drop_last": True,
            }
        )
        assert take(loader) == epoch1[2:]


def test_load_state_dict_warns_on_mismatch_and_does_not_apply() -> None:
    with make(identity_stream(20), local_batch_size=2, shuffle=True, shuffle_seed=1) as loader:
        with pytest.warns(UserWarning) as record:
            loader.load_state_dict(
                {
                    "dataset": loader.state_dict()["dataset"],
                    "epoch": 0,
                    "observation_offset": 4,
                    "shuffle": True,
                    "shuffle_seed": 2,
                    "drop_last": False,
                }
            )
        messages = [str(w.message) for w in record]
        assert len(messages) == 2
        assert any("shuffle_seed=2" in m for m in messages) and any("drop_last=False" in m for m in messages)
        assert loader.shuffle_seed == 1 and loader.drop_last is True
        assert loader.state_dict()["observation_offset"] == 4
    with make(identity_stream(20)) as loader, warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.load_state_dict(
            {
                "dataset": loader.state_dict()["dataset"],
                "epoch": 0,
                "observation_offset": 4,
                "shuffle": False,
                "shuffle_seed": None,
                "drop_last": True,
            }
        )


def test_load_state_dict_validates() -> None:
    loader = make(identity_stream(20))
    with pytest.raises(ValueError, match="observation_offset"):
        loader.load_state_dict(
            {"epoch": 0, "observation_offset": -1, "shuffle": False, "shuffle_seed": None, "drop_last": True}
        )
    with pytest.raises(ValueError, match="lacks"):
        loader.load_state_dict({"epoch": 0})  # type: ignore[typeddict-item]


def test_load_state_dict_while_iterating_raises() -> None:
    with make(identity_stream(20)) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(RuntimeError, match="active"):
            loader.load_state_dict(loader.state_dict())
        it.close()
        loader.load_state_dict(loader.state_dict())


# -- lifecycle -------------------------------------------------------------------------------------
def test_second_iterator_while_active_raises_and_closing_midway_continues() -> None:
    with make(identity_stream(10), local_batch_size=2, prefetch=2) as loader:
        it = iter(loader)
        assert next(it) == [0, 1]
        with pytest.raises(RuntimeError, match="still active"):
            iter(loader)
        it.close()
        assert take(loader) == [[2, 3], [4, 5], [6, 7], [8, 9]]


def test_abandoned_for_loop_iterator_is_released() -> None:
    with make(identity_stream(10), local_batch_size=2) as loader:
        for batch in loader:
            assert batch == [0, 1]
            break
        assert take(loader, 1) == [[2, 3]]


def test_close_ends_an_active_iterator() -> None:
    loader = make(identity_stream(100), local_batch_size=2, num_workers=2, prefetch=4)
    loader.open()
    it = iter(loader)
    next(it)
    loader.close()
    assert list(it) == []
    loader.close()  # idempotent
    with loader:
        assert take(loader, 1) == [[2, 3]]


def test_iterating_an_unopened_loader_opens_it_for_the_iterator() -> None:
    loader = make(identity_stream(6), local_batch_size=2)
    assert take(loader) == [[0, 1], [2, 3], [4, 5]]
    assert loader.state_dict()["epoch"] == 1


class Tracked(gl.MemoryStreamStorage):
    """Records when the loader opens and closes it."""

    def __init__(self, tokens: npt.ArrayLike) -> None:
        super().__init__(tokens)
        self.events: list[str] = []

    async def open(self) -> None:
        self.events.append("open")

    async def close(self) -> None:
        self.events.append("close")


def test_storage_is_opened_and_closed() -> None:
    with make(tracked := Tracked(np.arange(40))) as loader:
        take(loader)
    assert tracked.events == ["open", "close"]


def _without_the_process_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fresh process that never used process workers: ``concurrent.futures`` has not
    imported its ``process`` submodule (issue 10 item 1)."""
    import concurrent.futures

    monkeypatch.delattr(concurrent.futures, "process", raising=False)


def _slow_ids(samples: Sequence[np.ndarray]) -> list[int]:
    time.sleep(0.01)
    return [int(s[0]) // 4 for s in samples]


def _slow_thread_worker_loader() -> StatefulDataLoader[Any, Any]:
    """Thread workers with a slow collate: an epoch still runs when the loader is closed."""
    return StatefulDataLoader.from_storage(
        identity_stream(400),
        _slow_ids,
        sequence_length=4,
        local_batch_size=2,
        num_workers=2,
        prefetch=4,
        device=torch.device("cpu"),
    )


def test_closing_from_another_thread_with_thread_workers_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_the_process_module(monkeypatch)
    loader = _slow_thread_worker_loader()
    got: list[Any] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def consume() -> None:
        try:
            for b in loader:
                got.append(b)
                started.set()
        except BaseException as exc:
            errors.append(exc)

    loader.open()
    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(10)
    loader.close()
    t.join(10)
    assert not t.is_alive() and errors == [] and 0 < len(got) < 200


@pytest.mark.asyncio
async def test_aclose_from_another_task_with_thread_workers_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_the_process_module(monkeypatch)
    loader = _slow_thread_worker_loader()
    got: list[Any] = []
    started = asyncio.Event()

    async def consume() -> None:
        async for b in loader:
            got.append(b)
            started.set()

    await loader.aopen()
    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    await loader.aclose()
    await asyncio.wait_for(task, 10)  # ends without an error
    assert 0 < len(got) < 200


# -- failures ------------------------------------------------------------------------------------
class Boom(Exception):
    pass


@pytest.mark.parametrize(
    "workers", [{}, {"num_workers": 2}, {"prefetch": 4}, {"num_workers": 2, "prefetch": 3}]
)
def test_collate_error_reaches_consumer_at_its_batch(workers: dict[str, int]) -> None:
    def collate(samples: Sequence[np.ndarray]) -> list[int]:
        out = [int(s[0]) // 4 for s in samples]
        if 12 in out:
            raise Boom(f"bad batch {out}")
        return out

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(40),
        collate,
        sequence_length=4,
        local_batch_size=4,
        device=torch.device("cpu"),
        **workers,
    )
    got = []
    with loader:
        with pytest.raises(Boom, match="bad batch"):
            for b in loader:
                got.append(b)
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert loader.state_dict()["observation_offset"] == 12
        # the failing batch is retried by the next iterator
        with pytest.raises(Boom):
            take(loader)


class FailingStorage(gl.MemoryStreamStorage):
    def __init__(self, tokens: npt.ArrayLike, bad_start: int) -> None:
        super().__init__(tokens)
        self.bad_start = bad_start

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        if self.bad_start in starts.tolist():
            raise OSError(f"disk error at {self.bad_start}")
        return await super().read_many(starts, length)


@pytest.mark.parametrize("workers", [{}, {"num_workers": 2, "prefetch": 2}])
def test_storage_error_surfaces_at_the_failing_batch(workers: dict[str, int]) -> None:
    loader = make(FailingStorage(np.arange(400), bad_start=4 * 57), local_batch_size=5, **workers)
    got = []
    with loader, pytest.raises(OSError, match="disk error at 228"):
        for b in loader:
            got.append(b)
    assert flat(got) == list(range(55))


def test_exception_group_free_errors_in_async() -> None:
    async def main() -> None:
        loader = make(FailingStorage(np.arange(400), bad_start=4 * 7), local_batch_size=5)
        got = []
        async with loader:
            with pytest.raises(OSError, match="disk error"):
                async for b in loader:
                    got.append(b)
        assert got == [[0, 1, 2, 3, 4]]

    asyncio.run(main())


# -- workers ---------------------------------------------------------------------------------------
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


@pytest.mark.slow
def test_process_workers_keep_order_and_errors() -> None:
    import multiprocessing

    loader = make(
        identity_stream(40), local_batch_size=3, num_workers=2, parallel_method="process", prefetch=2
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


@pytest.mark.slow
def test_a_worker_process_that_dies_is_a_worker_error() -> None:
    import multiprocessing

    from ._helpers import die

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
    with loader, pytest.raises(gl.WorkerError, match="died"):
        for b in loader:
            got.append(b)
    assert got == [[0, 4], [8, 12], [16, 20], [24, 28], [32, 36]]
    assert multiprocessing.active_children() == []


# -- samples, collate and device -----------------------------------------------------------------
def test_stream_with_metadata_gives_dict_samples() -> None:
    tokens = np.arange(40, dtype=np.uint16)
    storage = gl.MemoryStreamStorage(tokens, metadata={"loss_mask": tokens % 2 == 0})

    def collate(samples: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64)),
            "loss_mask": torch.from_numpy(np.stack([s["loss_mask"] for s in samples])),
        }

    loader = gl.StatefulDataLoader.from_storage(storage, collate, sequence_length=5, local_batch_size=2)
    with loader:
        first = take(loader, 1)[0]
    assert first["input_ids"].tolist() == [list(range(5)), list(range(5, 10))]
    assert first["loss_mask"][0].tolist() == [True, False, True, False, True]


def test_document_storage_samples_are_whole_documents() -> None:
    docs = [np.arange(n, dtype=np.int32) for n in (3, 1, 4, 2)]

    def pad(samples: Sequence[np.ndarray]) -> torch.Tensor:
        width = max(len(s) for s in samples)
        out = torch.full((len(samples), width), -1, dtype=torch.int64)
        for i, s in enumerate(samples):
            out[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
        return out

    loader = gl.StatefulDataLoader.from_storage(gl.MemoryDocumentStorage(docs), pad, local_batch_size=2)
    with loader:
        a, b = take(loader)
    assert a.tolist() == [[0, 1, 2], [0, -1, -1]]
    assert b.tolist() == [[0, 1, 2, 3], [0, 1, -1, -1]]


def test_nested_batches_move_to_the_device_whole() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    def collate(samples: Sequence[np.ndarray]) -> dict[str, Any]:
        t = torch.from_numpy(np.stack(samples))
        return {"x": t, "nested": [t, (t, Pair(t, 3))], "n": len(samples)}

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(8),
        collate,
        sequence_length=4,
        local_batch_size=2,
        device=torch.device("meta"),
        pin_memory=True,
    )
    with loader:
        batch = take(loader, 1)[0]
    assert batch["x"].device.type == "meta"
    assert batch["nested"][0].device.type == "meta"
    assert batch["nested"][1][0].device.type == "meta"
    assert isinstance(batch["nested"][1][1], Pair) and batch["nested"][1][1].a.device.type == "meta"
    assert batch["n"] == 2


def test_pin_memory_is_harmless_on_cpu() -> None:
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(8), stack_collate, sequence_length=4, local_batch_size=2, pin_memory=True
    )
    with loader:
        assert take(loader, 1)[0].shape == (2, 4)


# -- async -----------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("workers", [{}, {"num_workers": 2, "prefetch": 3}])
async def test_async_for_matches_sync(workers: dict[str, int]) -> None:
    kw = {"local_batch_size": 3, "shuffle": True, "shuffle_seed": 4, "drop_last": False, **workers}
    with make(identity_stream(31), **kw) as loader:
        expected = take(loader)
    loader = make(identity_stream(31), **kw)
    got = []
    async with loader:
        async for b in loader:
            got.append(b)
        assert loader.state_dict()["epoch"] == 1
    assert got == expected


@pytest.mark.asyncio
async def test_async_iterator_close_midway_and_active_check() -> None:
    loader = make(identity_stream(20), local_batch_size=2, prefetch=2)
    async with loader:
        it = aiter(loader)
        assert await anext(it) == [0, 1]
        with pytest.raises(RuntimeError, match="still active"):
            aiter(loader)
        await it.aclose()
        assert loader.state_dict()["observation_offset"] == 2
        it2 = aiter(loader)
        assert await anext(it2) == [2, 3]
    # leaving the context closed it
    with pytest.raises(StopAsyncIteration):
        await anext(it2)


class SlowBlockingStream(gl.MemoryStreamStorage):
    """A storage whose reads block (like a cold disk); it offloads them as local storage does."""

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        import anyio.to_thread

        def blocking() -> Sequence[Any]:
            time.sleep(0.3)
            return asyncio.run(super(SlowBlockingStream, self).read_many(starts, length))

        return await anyio.to_thread.run_sync(blocking)


@pytest.mark.asyncio
async def test_async_iteration_keeps_the_event_loop_responsive() -> None:
    from ._helpers import loop_gaps

    loader = make(SlowBlockingStream(np.arange(400)), local_batch_size=4)
    async with loop_gaps() as gaps, loader:
        n = 0
        async for _ in loader:
            n += 1
    assert n == 25
    assert max(gaps) < 0.2, max(gaps)  # each read blocks 300 ms, but off the loop


def test_sync_iteration_inside_a_running_loop_thread_is_independent() -> None:
    """The sync facade runs its own loop: it works from code that has no loop at all."""
    with make(identity_stream(12), local_batch_size=4) as loader:
        assert take(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_sync_close_of_an_async_opened_loader_closes_the_storage() -> None:
    loader = make(tracked := Tracked(np.arange(40)))

    async def open_it() -> None:
        await loader.aopen()

    asyncio.run(open_it())
    loader.close()
    assert tracked.events == ["open", "close"]


def test_many_open_close_cycles_leave_no_threads() -> None:
    loader = make(identity_stream(30), local_batch_size=2, num_workers=2, prefetch=2)
    sizes = []
    for _ in range(20):
        with loader:
            sizes.append(len(take(loader, 3)))
    # 15 batches an epoch; an iterator started at the epoch's end is exhausted at once (epoch + 1)
    assert sizes == [3, 3, 3, 3, 3, 0] * 3 + [3, 3]
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["observation_offset"] == 12


def test_stats_count_batches_samples_and_waiting() -> None:
    def slow(samples: Sequence[np.ndarray]) -> int:
        time.sleep(0.02)
        return len(samples)

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(10),
        slow,
        sequence_length=4,
        local_batch_size=3,
        drop_last=False,
        device=torch.device("cpu"),
    )
    with loader:
        assert take(loader) == [3, 3, 3, 1]
    stats = loader.stats()
    assert stats["batches"] == 4 and stats["samples"] == 10
    assert stats["wait_seconds"] >= 4 * 0.02 * 0.9 and 0 < stats["last_wait_seconds"] <= stats["wait_seconds"]


def test_no_thread_runs_between_iterators_even_while_open() -> None:
    from .conftest import guideloom_threads

    def boom(samples: Sequence[np.ndarray]) -> list[int]:
        if int(samples[0][0]) >= 16:
            raise Boom("late failure")
        return [int(s[0]) for s in samples]

    before = set(guideloom_threads())
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(40),
        boom,
        sequence_length=4,
        local_batch_size=2,
        num_workers=2,
        prefetch=2,
        device=torch.device("cpu"),
    )
    with loader:
        assert take(loader, 1) == [[0, 4]]
        assert set(guideloom_threads()) == before
        with pytest.raises(Boom):
            take(loader)
        assert set(guideloom_threads()) == before  # the failure shut everything down


def test_without_workers_or_prefetch_batches_load_on_demand_in_the_callers_thread() -> None:
    threads: list[str] = []

    def collate(samples: Sequence[np.ndarray]) -> list[int]:
        threads.append(threading.current_thread().name)
        return [int(s[0]) // 4 for s in samples]

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(20), collate, sequence_length=4, local_batch_size=2, device=torch.device("cpu")
    )
    with loader:
        it = iter(loader)
        assert next(it) == [0, 1]
        time.sleep(0.05)
        assert len(threads) == 1  # nothing collated ahead of the request
        assert next(it) == [2, 3]
        it.close()
    assert set(threads) == {threading.current_thread().name}


def test_sync_iteration_from_inside_a_running_event_loop() -> None:
    """Code that runs an event loop (a notebook) can still use the sync facade."""

    async def main() -> list[list[int]]:
        with make(identity_stream(12), local_batch_size=4) as loader:
            return take(loader)

    assert asyncio.run(main()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_an_inline_iterator_closed_from_another_thread() -> None:
    with make(identity_stream(20), local_batch_size=2) as loader:
        it = iter(loader)
        assert next(it) == [0, 1]
        t = threading.Thread(target=it.close)
        t.start()
        t.join()
        with pytest.raises(StopIteration):
            next(it)
        assert take(loader, 1) == [[2, 3]]


class _Batch:
    """A collated batch that can be watched with a weak reference."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


@pytest.mark.parametrize("workers", [{}, {"prefetch": 2}, {"num_workers": 2, "prefetch": 1}])
def test_the_pipeline_keeps_no_reference_to_a_delivered_batch(workers: dict[str, int]) -> None:
    import gc
    import weakref

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(64),
        lambda s: _Batch([int(x[0]) for x in s]),
        sequence_length=4,
        local_batch_size=2,
        device=torch.device("cpu"),
        **workers,
    )
    with loader:
        it = iter(loader)
        next(it)
        batch = next(it)
        ref = weakref.ref(batch)
        del batch
        deadline = time.monotonic() + 2
        while ref() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert ref() is None, "a delivered batch must be freed once the consumer drops it"
        it.close()


class LengthAfterOpen(gl.MemoryStreamStorage):
    """A storage that learns its length only when opened (as a remote listing would)."""

    def __init__(self, tokens: npt.ArrayLike) -> None:
        super().__init__(tokens)
        self.opened = False

    async def open(self) -> None:
        self.opened = True

    async def close(self) -> None:
        self.opened = False

    def __len__(self) -> int:
        if not self.opened:
            raise RuntimeError("open me first")
        return super().__len__()


@pytest.mark.parametrize("workers", [{}, {"prefetch": 2}])
def test_a_storage_that_knows_its_length_only_once_open(workers: dict[str, int]) -> None:
    loader = make(LengthAfterOpen(np.arange(24)), local_batch_size=2, **workers)
    assert take(loader) == [[0, 1], [2, 3], [4, 5]]  # the iterator opens the loader first
    with loader:
        assert len(loader) == 3

    async def main() -> list[list[int]]:
        got = []
        async for b in make(LengthAfterOpen(np.arange(24)), local_batch_size=2, **workers):
            got.append(b)
        return got

    assert asyncio.run(main()) == [[0, 1], [2, 3], [4, 5]]


def test_a_failed_open_closes_the_storage_again() -> None:
    storage = Tracked(np.arange(8))
    loader = make(storage, local_batch_size=3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        loader.open()
    assert storage.events == ["open", "close"]


# -- issue 10: a checkpoint knows its dataset; options are type-checked ----------------------------
def test_checkpoint_of_a_larger_dataset_is_refused_not_an_epoch_skipped() -> None:
    with make(identity_stream(2000), local_batch_size=10) as big:
        it = iter(big)
        for _ in range(30):
            next(it)
        it.close()
        state = big.state_dict()
    small = make(identity_stream(200), local_batch_size=10)
    with pytest.raises(ValueError, match=r"another dataset.*allow_dataset_change=True"):
        small.load_state_dict(state)
    assert small.state_dict()["observation_offset"] == 0  # nothing applied
    with pytest.raises(ValueError, match="past the end"):
        small.load_state_dict(state, allow_dataset_change=True)


def test_allow_dataset_change_resumes_at_the_saved_position() -> None:
    with make(identity_stream(400), local_batch_size=10) as a:
        it = iter(a)
        next(it)
        it.close()
        state = a.state_dict()
    with make(identity_stream(300), local_batch_size=10) as b:
        b.load_state_dict(state, allow_dataset_change=True)
        assert next(iter(b)) == list(range(10, 20))


def test_checkpoint_round_trips_through_torch_save_weights_only(tmp_path: Any) -> None:
    import torch

    with make(identity_stream(400), local_batch_size=10) as a:
        it = iter(a)
        next(it)
        it.close()
        torch.save({"loader": a.state_dict()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    with make(identity_stream(400), local_batch_size=10) as b:
        b.load_state_dict(state)
        assert next(iter(b)) == list(range(10, 20))


@pytest.mark.parametrize("name", ["shuffle", "drop_last", "pin_memory"])
@pytest.mark.parametrize("value", ["no", "yes", 1, None])
def test_bool_options_refuse_truthy_values(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        make(identity_stream(100), **{name: value})


def test_numpy_integers_are_accepted_everywhere() -> None:
    loader = make(
        identity_stream(100), local_batch_size=np.int64(5), shuffle_seed=np.int32(3), prefetch=np.int64(0)
    )
    assert type(loader.local_batch_size) is int and loader.local_batch_size == 5
    assert type(loader.shuffle_seed) is int and loader.state_dict()["shuffle_seed"] == 3


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        make(identity_stream(100), device="cuda")


@pytest.mark.slow
def test_a_worker_killed_between_batches_is_a_worker_error(caplog: pytest.LogCaptureFixture) -> None:
    import multiprocessing
    import os
    import signal

    from ._helpers import IdsOf

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


def test_remaining_counts_what_is_left_after_a_resume() -> None:
    with make(identity_stream(100), local_batch_size=10) as loader:
        assert len(loader) == loader.remaining() == 10
        it = iter(loader)
        assert len(it) == 10
        next(it)
        next(it)
        assert len(it) == 8 and loader.remaining() == 8
        it.close()
        assert len(it) == 0
        state = loader.state_dict()
    with make(identity_stream(100), local_batch_size=5) as resumed:  # another batch size
        resumed.load_state_dict(state)
        assert len(resumed) == 20  # len(loader) stays the whole epoch
        assert resumed.remaining() == 16
        it = iter(resumed)
        assert len(it) == 16 == len(list(it))
        assert resumed.remaining() == 20  # the next epoch, whole


@pytest.mark.asyncio
async def test_remaining_of_an_async_iterator() -> None:
    loader = make(identity_stream(100), local_batch_size=10)
    loader.load_state_dict({**loader.state_dict(), "observation_offset": 30})
    async with loader:
        it = loader.__aiter__()
        assert len(it) == 7
        await it.__anext__()
        assert len(it) == 6
        await it.aclose()
