"""Epoch order and partitioning across ranks through the loader (contract: order, rank blocks,
drop_last).

The orders themselves, with no loader, are in ``tests/core/test_order.py``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

import guideloom as gl
from tests.support.data import identity_stream
from tests.support.loader import flat, make, take

pytestmark = pytest.mark.usefixtures("no_thread_leak")


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
