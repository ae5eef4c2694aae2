"""The epoch order of packed sequences counted block by block as the blocks are first read.

A concat packing over a storage that counts by blocks (Parquet text, tokenized at read) cuts
each block on its own and the blocks' tails together last (``guideloom._core.pack_layout``), so
a block's number of sequences is known once that block is tokenized. :class:`BlockOrder` is the
group order over those blocks (:class:`~guideloom._core.group_order.LazyGroupPermutation`, the
tails run a window of its own after every block's), learning the counts a window of blocks at a
time: a loader's plan reads an epoch's first batch once the first window is counted, not the
whole corpus (:class:`~guideloom._core.plan.Counting`).

An observation is named by its block and its place there, ``KEYED + (block << SHIFT) + j``: a
block's first sequence index in the whole dataset needs the counts of every block before it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from guideloom._core.group_order import LazyGroupPermutation
from guideloom._core.pack_layout import block_counts, tails_count
from guideloom._core.permutation import IndexArray, Order
from guideloom._core.plan import UNBOUNDED

__all__ = ["KEYED", "SHIFT", "BlockOrder", "decode_keys", "encode_keys"]

#: The flag of an index that names its block and place (bit 62: beyond any dataset's length).
KEYED = 1 << 62
#: Bits of a block's place in a keyed index (a block holds fewer than 2**31 sequences).
SHIFT = 31
_MASK = (1 << SHIFT) - 1


def encode_keys(blocks: IndexArray, places: IndexArray) -> IndexArray:
    """Keyed indexes of ``(blocks[i], places[i])``."""
    out: IndexArray = (
        KEYED + (np.asarray(blocks, dtype=np.int64) << SHIFT) + np.asarray(places, dtype=np.int64)
    )
    return out


def decode_keys(indices: IndexArray) -> tuple[IndexArray, IndexArray]:
    """Blocks and places of keyed indexes."""
    k = np.asarray(indices, dtype=np.int64) - KEYED
    return k >> SHIFT, k & _MASK


class BlockCounts(Protocol):
    """What the order asks of the blocks it orders (a packing's
    :class:`~guideloom._datasets.packed_blocks.PackedBlocks`): the blocks' element totals
    (``-1``: not counted) and a count of some blocks (I/O: tokenizing them)."""

    sequence_length: int

    def block_totals(self) -> npt.NDArray[np.int64]: ...

    def count_blocks_sync(self, blocks: IndexArray) -> None: ...


class BlockOrder(Order):
    """An epoch order over a concat-by-blocks packing's sequences, counted a window at a time.

    ``known`` and ``total`` say how far it is counted; :meth:`count_sync` counts the next
    window's blocks (the loader's driver calls it where the plan reaches the count; positions
    looked up beyond it, by ``explain()`` or ``len()``, are counted first, blocking). Each lookup
    gives keyed indexes (:func:`encode_keys`). Once every block is counted the order is the group
    order over the blocks' sequence counts, then the tails run's sequences, whatever was counted
    when: a cold run and a warm one deliver the same sequences in the same order.
    """

    def __init__(
        self, dataset: BlockCounts, blocks: int, *, shuffle: bool, seed: int, epoch: int, window: int
    ) -> None:
        self._dataset: BlockCounts | None = dataset
        self._counting = threading.Lock()  # one count at a time (the driver's, or a lookup's)
        self._blocks = blocks
        self._lazy = LazyGroupPermutation(
            blocks + 1, seed=seed, epoch=epoch, window=window, last=True, shuffle=shuffle
        )
        self._sync()

    def __getstate__(self) -> dict[str, Any]:
        """Sent to process workers with the plan, as a view that counts nothing: they make the
        batches the loader read for them, by steps, and never look positions up (the packed
        text is read where it is counted)."""
        return {"_dataset": None, "_blocks": self._blocks, "_lazy": self._lazy}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._counting = threading.Lock()

    def _counts(self) -> BlockCounts:
        if self._dataset is None:
            raise RuntimeError("a packed order sent to a worker counts nothing (its reader counts)")
        return self._dataset

    def _sync(self) -> None:
        """Learn the counts the dataset knows (counted by this order or otherwise)."""
        dataset = self._counts()
        totals = dataset.block_totals()
        length = dataset.sequence_length
        sizes = self._lazy.sizes
        new = np.flatnonzero((totals >= 0) & (sizes[:-1] < 0))
        if len(new):
            counts = block_counts(totals[new], length)
            for b, c in zip(new.tolist(), counts.tolist(), strict=True):
                self._lazy.learn(b, c)
        if sizes[-1] < 0 and (totals >= 0).all():
            self._lazy.learn(self._blocks, tails_count(totals, length))

    @property
    def known(self) -> int:
        """Positions counted; a worker's view: no bound (the reader counted the steps it sends)."""
        return self._lazy.known if self._dataset is not None else UNBOUNDED

    @property
    def total(self) -> int | None:
        return self._lazy.known if self._lazy.complete else None

    @property
    def windows(self) -> int:
        return self._lazy.windows

    def blocks_ahead(self) -> Iterator[IndexArray]:
        """The blocks of each window not counted yet, in the epoch's order (the tails run left
        out: it reads the last rows of every block): what the counts to come will tokenize."""
        lazy = self._lazy
        for k in range(lazy.counted_windows, lazy.windows):
            groups = lazy.window_groups(k)
            blocks = groups[groups < self._blocks]
            if len(blocks):
                yield blocks

    def count_sync(self) -> None:
        """Count the next window's blocks (decoding and tokenizing them: their tokens stay with
        the storage for the reads)."""
        with self._counting:
            self._sync()
            groups = self._lazy.next_groups()
            blocks = groups[groups < self._blocks]
            if len(blocks):
                self._counts().count_blocks_sync(blocks)
            self._sync()

    async def count(self) -> None:
        """:meth:`count_sync` on a thread (never on the event loop)."""
        await asyncio.to_thread(self.count_sync)

    def _count_to(self, position: int) -> None:
        while position >= self._lazy.known and not self._lazy.complete:
            self.count_sync()

    def __len__(self) -> int:
        """The epoch's sequences: every block counted first (blocking)."""
        while not self._lazy.complete:
            self.count_sync()
        return self._lazy.known

    def window_end(self, position: int) -> int:
        self._count_to(position)
        return self._lazy.window_end(position)

    def take(self, positions: npt.ArrayLike) -> IndexArray:
        given = np.asarray(positions, dtype=np.int64)
        if given.size:
            self._count_to(int(given.max()))
        blocks, places = self._lazy.take_keyed(given.ravel())
        return encode_keys(blocks, places).reshape(given.shape)

    def __getitem__(self, position: int) -> int:
        return int(self.take(np.asarray([position], dtype=np.int64))[0])

    def range(self, start: int, stop: int) -> IndexArray:
        return self.take(np.arange(start, stop, dtype=np.int64))
