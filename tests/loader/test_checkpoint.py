"""Checkpoints through the loader: what ``state_dict`` counts, what ``load_state_dict`` refuses
or warns about, and exact resume with another batch or world size.

The pure checks behind them (the fingerprint, ``restore_position``) are in
``tests/core/test_checkpoint.py``."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch

from tests.support.data import identity_stream
from tests.support.loader import check_resume_equals_uninterrupted, flat, make, roundtrip, take

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def test_state_dict_counts_only_delivered_batches() -> None:
    with make(identity_stream(50), local_batch_size=2, world_size=2, prefetch=4, num_workers=2) as loader:
        assert loader.state_dict() == {
            "epoch": 0,
            "observation_offset": 0,
            "shuffle": False,
            "shuffle_seed": None,
            "drop_last": True,
            "dataset": {"kind": "stream", "observations": 50, "sequence_length": 4, "digest": ""},
            "history": "",  # no batch geometry has read anything yet
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
        "history": "0:0:0:1:1",  # one stretch of epoch 0 from offset 0: batches of 1 on 1 rank
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


def test_load_state_dict_refuses_a_deeply_nested_seed_by_name() -> None:
    nested: list[Any] = []
    for _ in range(100_000):
        nested = [nested]
    with make(identity_stream(20), shuffle=True, shuffle_seed=3) as loader:
        state = loader.state_dict()
        with pytest.raises(ValueError, match="checkpoint 'shuffle_seed' must be an int or None, got list"):
            loader.load_state_dict({**state, "shuffle_seed": nested})  # type: ignore[typeddict-item]
        with pytest.raises(ValueError, match="checkpoint 'dataset' must be a dict"):
            loader.load_state_dict({**state, "dataset": nested})  # type: ignore[typeddict-item]
        loader.load_state_dict(state)  # and the checkpoint itself loads


def test_load_state_dict_while_iterating_raises() -> None:
    with make(identity_stream(20)) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(RuntimeError, match="active"):
            loader.load_state_dict(loader.state_dict())
        it.close()
        loader.load_state_dict(loader.state_dict())


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


def test_the_furthest_padded_offset_resumes_and_one_beyond_it_is_refused() -> None:
    # 10 observations: 3 batches of 3 reach offset 9; a resume with one global batch of 10
    # (2 ranks of 5) delivers sample 9 and pads to 19, the furthest a run can count
    with make(identity_stream(10), local_batch_size=3, drop_last=False) as first:
        take(first, 3)
        state = roundtrip(first.state_dict())
    kw: dict[str, Any] = {"local_batch_size": 5, "world_size": 2, "drop_last": False}
    with make(identity_stream(10), **kw) as second:
        second.load_state_dict(state)
        assert take(second, 1) == [[9]]
        state = roundtrip(second.state_dict())
    assert state["observation_offset"] == 19
    with make(identity_stream(10), **kw) as resumed:
        resumed.load_state_dict(state)
        assert take(resumed) == []  # the epoch is over
        assert (resumed.state_dict()["epoch"], resumed.state_dict()["observation_offset"]) == (1, 0)
    for offset in (20, 10**6, 10**30):
        loader = make(identity_stream(10), **kw)
        with pytest.raises(
            ValueError, match=rf"observation_offset={offset} is past the end .*10 observations"
        ):
            loader.load_state_dict({**state, "observation_offset": offset})
        assert loader.state_dict()["observation_offset"] == 0  # nothing applied


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

    with make(identity_stream(400), local_batch_size=10) as a:
        it = iter(a)
        next(it)
        it.close()
        torch.save({"loader": a.state_dict()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    with make(identity_stream(400), local_batch_size=10) as b:
        b.load_state_dict(state)
        assert next(iter(b)) == list(range(10, 20))


def test_a_history_that_does_not_add_up_is_refused_by_load_state_dict() -> None:
    with make(identity_stream(50), local_batch_size=2) as first:
        take(first, 5)
        saved = first.state_dict()
    with make(identity_stream(50), local_batch_size=4) as second:
        second.load_state_dict(saved)
        take(second, 1)
        state = second.state_dict()
    assert state["history"] == "0:0:0:2:1;0:10:5:4:1"
    for history, match in (
        ("0:0:0:2:1;0:10:3:4:1", r"history\[1\]\.step is 3, expected 5"),  # a step going 5 -> 3
        ("0:0:0:2:1;0:9:5:4:1", r"history\[1\]\.offset is 9, not on a batch boundary"),
        ("0:0:0:2:1000000000000000000;0:10:5:4:1", r"history\[0\]\.world_size is 10+, expected an int"),
    ):
        with make(identity_stream(50), local_batch_size=4) as loader, pytest.raises(ValueError, match=match):
            loader.load_state_dict({**state, "history": history})
    with make(identity_stream(50), local_batch_size=4) as resumed:
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        assert [x["index"] for x in resumed.explain(4)] == [8, 9]
