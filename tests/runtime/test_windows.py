"""The windows an epoch reads from a storage that asks for blocks (an object store): a shuffled
epoch reads the largest windows (its samples scattered, coalesced only in a large read), an
epoch in order reads a share of them at a time, so that the windows read ahead together end one
after the other and each one's batches are made while the next are fetched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

import guideloom as gl
from tests.support.data import ids


class Blocks(gl.MemoryStreamStorage):
    """Read on the loop, four windows ahead, of up to 64 batches, in blocks (as an object
    store): each read's length recorded."""

    shuffle_block_bytes = 64
    read_window_batches = 64
    max_concurrent_reads = 4

    def __init__(self, tokens: npt.ArrayLike) -> None:
        super().__init__(tokens)
        self.reads: list[int] = []

    def reads_inline(self) -> bool:
        return False

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        self.reads.append(len(starts))
        return await super().read_many(starts, length)


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epoch_in_order_reads_a_share_of_the_largest_windows(shuffle: bool) -> None:
    n, batch = 4096, 4
    storage = Blocks(np.arange(n, dtype=np.int64))
    loader = gl.StatefulDataLoader.from_storage(
        storage, ids, sequence_length=1, local_batch_size=batch, shuffle=shuffle, shuffle_seed=3,
        shuffle_block_size=None, prefetch=2, device=torch.device("cpu"),
    )  # fmt: skip
    with loader:
        got = sorted(i for b in loader for i in b)
    assert got == list(range(n))
    first, rest = storage.reads[0], storage.reads[1:]
    assert first == batch  # the first batch alone
    largest = 64 * batch
    assert max(rest) == (largest if shuffle else largest // 4), storage.reads
    assert sum(storage.reads) == n
