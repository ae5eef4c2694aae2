"""The layout of a concat packing counted block by block as it is read.

Over a storage that counts its documents' lengths block by block (a Parquet text column with a
tokenizer: :meth:`~guideloom.storage.base.DocumentStorageAbstract.block_counter`), concat cuts
each block on its own and the blocks' tails together last (``guideloom._core.pack_layout``), so
a block's sequences follow from that block alone. :class:`PackedBlocks` holds the blocks (each a
row group's rows in equal runs of at most ``part_bytes`` of stored text), what is counted of
them (each counted block's document offsets), counts them as the order reaches them
(:class:`~guideloom._datasets.counted.BlockOrder`), and turns sequences, keyed by block and
place (:mod:`guideloom._datasets.counted`) or plain ``[0, len)`` (a mixture's), into the parts
of documents they hold.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import functools
import hashlib
import os
import zlib
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._core.pack_layout import Pieces, block_counts, block_pieces, tails_count
from guideloom._datasets.base import Call
from guideloom._datasets.counted import KEYED, BlockOrder, decode_keys
from guideloom._errors import DatasetIntegrityError
from guideloom.storage.base import BlockCounter, DocumentStorageAbstract

__all__ = ["COUNT_WINDOW_BYTES", "PART_BYTES", "BlockRead", "PackedBlocks"]

I64 = npt.NDArray[np.int64]
#: Stored text bytes of a block of a packing counted block by block, at most (a row group's rows
#: cut into equal runs of rows, as few as keep each below this; a row group a block where it is
#: smaller): what a count tokenizes at a time.
PART_BYTES = 2**20
#: Stored text bytes of the blocks a window of such a packing's order holds, at least one block:
#: the first batch waits for one window's tokenizing (about a quarter of a second on two free
#: cores), and the loader's shuffle mixes the sequences of a window's blocks.
COUNT_WINDOW_BYTES = 2 * 2**20
#: Threads a count of several blocks runs on, at most (``min(2, cores)``): two keep a decode and
#: a tokenizer call, or two calls, going at once; more would only share the same cores.
COUNT_THREADS = min(2, os.cpu_count() or 1)
#: A read of sequences counted by blocks: its storage calls, then the rows' elements and pieces.
BlockRead = Generator[list[Call], list[Any], tuple[npt.NDArray[Any], Pieces]]


class PackedBlocks:
    """The blocks of a concat packing counted by blocks, their counts, and the document parts of
    its sequences.

    ``window`` is the number of blocks a window of the order holds (the fewest holding
    ``window_bytes`` of stored text, at least one); it may be set before a loader plans.
    """

    def __init__(
        self,
        storage: DocumentStorageAbstract[Any, Any],
        counter: BlockCounter,
        rows: npt.ArrayLike,
        sequence_length: int,
        *,
        part_bytes: int,
        window_bytes: int,
    ) -> None:
        self._storage = storage
        self._counter = counter
        self.sequence_length = sequence_length
        sizes = np.asarray(rows, dtype=np.int64)
        nbytes = counter.block_nbytes()
        # each row group's rows in equal runs of at most part_bytes of text: the blocks
        parts = np.clip(-(-nbytes // part_bytes), 1, np.maximum(sizes, 1))
        group = np.repeat(np.arange(len(sizes), dtype=np.int64), parts)
        cuts = [
            np.linspace(0, r, p + 1).astype(np.int64)
            for r, p in zip(sizes.tolist(), parts.tolist(), strict=True)
        ]
        self._group = group
        self._lo = np.concatenate([c[:-1] for c in cuts]).astype(np.int64)
        self._hi = np.concatenate([c[1:] for c in cuts]).astype(np.int64)
        self._docs = np.append(np.cumsum(sizes)[group] - sizes[group] + self._lo, int(sizes.sum()))
        self._totals = np.full(len(group), -1, dtype=np.int64)
        self._offsets: dict[int, I64] = {}
        #: Blocks whose counts came from ``cache_dir`` with documents counted as empty: a read
        #: checks each document it reads against its count, and an empty one is never read, so
        #: the first read of such a block reads those too (a count that hid a document is refused).
        self._unchecked: set[int] = set()
        self._latest: BlockOrder | None = None  # the order made last (the loader's epoch)
        #: The sequences of each block read so far this epoch (by place; the tails run's as
        #: block ``len(blocks)``), and the blocks read whole: what the storage may let go.
        self._seen: dict[int, set[int]] = {}
        self._spent: set[int] = set()
        self._epoch: tuple[bool, int, int] | None = None  # (shuffle, seed, epoch) they are of
        self.part_bytes = part_bytes
        mean = max(1, int(nbytes.sum()) // max(1, len(group)))
        self.window = max(1, window_bytes // mean)

    @classmethod
    def over(
        cls,
        storage: DocumentStorageAbstract[Any, Any],
        sequence_length: int,
        part_bytes: int,
        window_bytes: int,
    ) -> PackedBlocks | None:
        """Concat's blocks over ``storage`` where it counts by blocks (its
        :meth:`~guideloom.storage.base.DocumentStorageAbstract.block_counter`, over its natural
        blocks); ``None`` where it does not (the layout is then built whole at open)."""
        counter = storage.block_counter()
        rows = storage.natural_blocks() if counter is not None else None
        if counter is None or rows is None:
            return None
        return cls(storage, counter, rows, sequence_length, part_bytes=part_bytes, window_bytes=window_bytes)

    # -- counting -------------------------------------------------------------------------------
    def learn_known(self) -> None:
        """The blocks' lengths the storage knows without counting (``cache_dir``)."""
        known = self._counter.known_block_lengths
        for b in [b for b in range(len(self._totals)) if b not in self._offsets]:
            lengths = known(int(self._group[b]))
            if lengths is not None:
                mine = lengths[self._lo[b] : self._hi[b]]
                self._learn(b, mine)
                if not mine.all():
                    self._unchecked.add(b)
        self._refuse_empty()
        if self._unchecked:  # a block counted as all empty holds no sequence: no read meets it
            for b in [b for b in self._unchecked if self._totals[b] == 0]:
                self._storage.read_many_sync(np.arange(self._docs[b], self._docs[b + 1]))
                self._unchecked.discard(b)

    def _empty_docs(self, docs: I64) -> tuple[I64, list[int]]:
        """Documents counted as empty (from ``cache_dir``, unread so far) of the blocks that hold
        ``docs``, and those blocks: read with them, so that the storage checks their counts too."""
        blocks: list[int] = []
        if self._unchecked and len(docs):
            held = np.unique(np.searchsorted(self._docs, docs, side="right") - 1).tolist()
            blocks = [b for b in held if b in self._unchecked]
        empty = [self._docs[b] + np.flatnonzero(np.diff(self._offsets[b]) == 0) for b in blocks]
        return (np.concatenate(empty).astype(np.int64) if empty else np.zeros(0, dtype=np.int64)), blocks

    def _learn(self, block: int, lengths: I64) -> None:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        was = int(self._totals[block])
        if was >= 0 and was != int(offsets[-1]):  # a total a checkpoint carried, now counted
            self._refuse_saved_count(block, int(offsets[-1]), was)
        self._offsets[block] = offsets
        self._totals[block] = int(offsets[-1])

    def _refuse_saved_count(self, block: int, counted: int, saved: int) -> None:
        raise DatasetIntegrityError(
            f"{self._storage!r}: block {block} (row group {int(self._group[block])}, rows "
            f"[{int(self._lo[block])}, {int(self._hi[block])})) holds {counted} tokens, the "
            f"checkpoint's counts say {saved}: the checkpoint was saved over documents that tokenize "
            "otherwise (a tokenizer changed under its tokenizer_key); resume from a checkpoint "
            "saved with this tokenizer, or load it with allow_dataset_change=True"
        )

    def state(self) -> str:
        """The blocks' totals as a checkpoint carries them (``-1``: not counted): a resume in
        another process then counts only the blocks it reads, not every window before its
        offset. ``"1:<digest>:<base64 of the zlib'd little-endian int64 totals>"``."""
        raw = self._totals.astype("<i8").tobytes()
        digest = hashlib.sha256(raw).hexdigest()[:16]
        return f"1:{digest}:{base64.b64encode(zlib.compress(raw)).decode('ascii')}"

    def load_state(self, state: str) -> None:
        """The totals of a checkpoint's :meth:`state`: those not counted here are taken (each
        checked against its documents when a read counts them); a damaged one is refused."""
        try:
            version, digest, body = state.split(":")
            raw = zlib.decompress(base64.b64decode(body, validate=True))
        except (ValueError, zlib.error, binascii.Error):
            raise ValueError(
                "the checkpoint's counts are malformed (expected what state_dict() saved); pass the "
                "checkpoint as state_dict() returned it"
            ) from None
        totals = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        intact = version == "1" and hashlib.sha256(raw).hexdigest()[:16] == digest
        if not intact or len(totals) != len(self._totals):
            raise ValueError(
                f"the checkpoint's counts are damaged or for another layout ({len(totals)} blocks, "
                f"this packing has {len(self._totals)}); pass the checkpoint as state_dict() returned it"
            )
        bad = np.flatnonzero((totals >= 0) & (self._totals >= 0) & (totals != self._totals))
        if len(bad):
            b = int(bad[0])
            self._refuse_saved_count(b, int(self._totals[b]), int(totals[b]))
        take = (totals >= 0) & (self._totals < 0)
        self._totals[take] = totals[take]

    def block_totals(self) -> I64:
        """Each block's elements (``-1``: not counted yet)."""
        return self._totals

    def count_blocks_sync(self, blocks: npt.ArrayLike) -> None:
        """Count ``blocks``: decode and tokenize their documents (which the storage keeps for the
        reads that follow). Several blocks (a window's) are counted on :data:`COUNT_THREADS`
        threads at once: one decodes a row group while another tokenizes, and the tokenizer's
        calls run side by side on the cores where they would not spread over them themselves (in
        a process worker, or a block of a few long documents)."""
        todo = [b for b in np.asarray(blocks, dtype=np.int64).tolist() if b not in self._offsets]
        count = self._counter.block_lengths

        def one(b: int) -> I64:
            return count(int(self._group[b]), int(self._lo[b]), int(self._hi[b]))

        threads = min(len(todo), COUNT_THREADS)
        if threads > 1:
            with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="guideloom-count") as pool:
                counted = list(pool.map(one, todo))
        else:
            counted = [one(b) for b in todo]
        for b, lengths in zip(todo, counted, strict=True):
            self._learn(b, lengths)
        self._refuse_empty()

    def _refuse_empty(self) -> None:
        """Once every block is counted: a column of fewer elements than one sequence is refused,
        as the layout built at open refuses it (not an epoch of no batch)."""
        if self.counted() and int(self._totals.sum()) < self.sequence_length:
            raise ValueError(
                f"{self._storage!r} holds {int(self._totals.sum())} elements, fewer than one sequence "
                f"of sequence_length={self.sequence_length}; pass a smaller sequence_length (or use "
                "mode='best_fit')"
            )

    def count_all(self) -> None:
        """Count every block not counted yet (blocking)."""
        self.learn_known()
        self.count_blocks_sync(np.flatnonzero(self._totals < 0))

    def counted(self) -> bool:
        """Whether every block is counted."""
        return bool((self._totals >= 0).all())

    def __len__(self) -> int:
        """Sequences of all blocks and the tails run: every block counted first (blocking)."""
        self.count_all()
        length = self.sequence_length
        return int(block_counts(self._totals, length).sum()) + tails_count(self._totals, length)

    def nbytes(self) -> int:
        """Memory held: the totals and the document offsets of each block counted so far."""
        return int(self._totals.nbytes) + sum(int(o.nbytes) for o in self._offsets.values())

    def order(self, *, shuffle: bool, seed: int, epoch: int) -> BlockOrder:
        """The group order over the blocks (windows of ``window`` blocks), then the tails run,
        counted a window at a time."""
        order = BlockOrder(
            self, len(self._totals), shuffle=shuffle, seed=seed, epoch=epoch, window=self.window
        )
        self._latest = order
        if self._epoch != (shuffle, seed, epoch):  # (an order made again, by len() or explain(), keeps them)
            self._seen, self._spent, self._epoch = {}, set(), (shuffle, seed, epoch)
        return order

    def documents_ahead(self) -> Iterator[I64]:
        """The documents of each window the latest order (the loader's epoch) has not counted
        yet, in its order: a hint that continues the loader's past its count, so that a storage
        tokenizes the windows to come ahead of their counts (on its own thread)."""
        order = self._latest
        if order is None:
            return
        for blocks in order.blocks_ahead():
            yield np.concatenate([np.arange(self._docs[b], self._docs[b + 1]) for b in blocks.tolist()])

    # -- sequences to document parts ------------------------------------------------------------
    def keys(self, indices: I64) -> tuple[I64, I64]:
        """Blocks and places of ``indices``: keyed ones as they say; plain ones (``[0, len)``,
        a mixture's) by the whole count (the blocks' sequences in block order, then the tails)."""
        keyed = indices >= KEYED
        if keyed.all():
            return decode_keys(indices)
        self.count_all()
        counts = np.append(
            block_counts(self._totals, self.sequence_length), tails_count(self._totals, self.sequence_length)
        )
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if len(indices) and (indices[~keyed].min() < 0 or indices[~keyed].max() >= starts[-1]):
            raise IndexError(f"packed sequence index outside [0, {int(starts[-1])})")
        blocks = np.searchsorted(starts, indices, side="right") - 1
        places = indices - starts[np.minimum(blocks, len(starts) - 1)]
        kb, kp = decode_keys(indices)
        return np.where(keyed, kb, blocks), np.where(keyed, kp, places)

    def parts(self, indices: I64) -> tuple[I64, I64, I64, I64, I64]:
        """The document parts of sequences ``indices`` (row-major, each row's in column order):
        row, document, first element in the document, elements, column in the row."""
        blocks, places = self.keys(np.asarray(indices, dtype=np.int64))
        tails = len(self._totals)
        has_tails = bool((blocks == tails).any())
        if has_tails:
            self.count_all()
        pieces = block_pieces(
            blocks, places, self.sequence_length, self._totals if has_tails else None, tails
        )
        rows, docs, firsts, sizes, cols = [], [], [], [], []
        for row, b, lo, hi, at in zip(
            pieces.row.tolist(),
            pieces.block.tolist(),
            pieces.lo.tolist(),
            pieces.hi.tolist(),
            pieces.at.tolist(),
            strict=True,
        ):
            offsets = self._offsets.get(b)
            if offsets is None:
                self.count_blocks_sync(np.asarray([b], dtype=np.int64))
                offsets = self._offsets[b]
            if hi > int(offsets[-1]):
                raise IndexError(f"packed sequence {places} of block {b} outside the block's sequences")
            d0 = int(np.searchsorted(offsets, lo, side="right")) - 1
            d1 = int(np.searchsorted(offsets, hi - 1, side="right")) - 1
            base = int(self._docs[b])
            for d in range(d0, d1 + 1):
                a, z = max(lo, int(offsets[d])), min(hi, int(offsets[d + 1]))
                if z > a:  # an empty document holds no element
                    rows.append(row)
                    docs.append(base + d)
                    firsts.append(a - int(offsets[d]))
                    sizes.append(z - a)
                    cols.append(at + a - lo)
        as64 = functools.partial(np.asarray, dtype=np.int64)
        return as64(rows), as64(docs), as64(firsts), as64(sizes), as64(cols)

    def documents_of(self, indices: I64) -> I64:
        """The documents of the blocks sequences ``indices`` come from, sorted (what a storage is
        told to prepare ahead: it counts nothing, so that a storage may ask it under its own
        lock; the tails run's, spread over every block, are left to its reads)."""
        indices = np.asarray(indices, dtype=np.int64)
        blocks = self.keys(indices)[0]
        tails = len(self._totals)
        ranges = [
            np.arange(self._docs[b], self._docs[b + 1]) for b in np.unique(blocks).tolist() if b < tails
        ]
        if len(self._offsets) == tails and (blocks == tails).any():  # all counted: the tails' own
            ranges.append(self.parts(indices[blocks == tails])[1])
        return np.unique(np.concatenate(ranges)) if ranges else np.zeros(0, dtype=np.int64)

    def read(self, indices: I64) -> BlockRead:
        """Packed sequences ``indices``: the documents they hold read with one ``read_many`` call
        (tokens the storage keeps from the count: none tokenized again) and cut into their rows;
        the rows' elements and pieces."""
        rows, docs, firsts, sizes, cols = self.parts(indices)
        empty, checked = self._empty_docs(docs)
        ids, where = np.unique(np.concatenate([docs, empty]), return_inverse=True)
        where = where[: len(docs)]
        storage = self._storage
        (got,) = yield [
            Call(
                functools.partial(storage.read_many_sync, ids),
                functools.partial(storage.read_many, ids),
            )
        ]
        self._unchecked.difference_update(checked)  # read, and so checked against their counts
        self._note_read(indices)
        n, length = len(indices), self.sequence_length
        out = np.empty((n, length), dtype=storage.dtype)
        flat = out.reshape(-1)
        for w, f, k, r, c in zip(
            where.tolist(), firsts.tolist(), sizes.tolist(), rows.tolist(), cols.tolist(), strict=True
        ):
            at = r * length + c
            flat[at : at + k] = got[w][f : f + k]
        segments = np.ones(len(rows), dtype=np.int32)
        if len(rows):
            new_row = np.flatnonzero(np.diff(rows, prepend=-1))
            segments = (
                np.arange(len(rows)) - np.repeat(new_row, np.diff(np.append(new_row, len(rows)))) + 1
            ).astype(np.int32)
        return out, Pieces(sizes, docs, segments, rows * length + cols)

    def _note_read(self, indices: I64) -> None:
        """Sequences ``indices`` were read: a block whose every sequence is read this epoch has
        its documents let go by the storage (their tokens), but those holding its tail, which
        the tails run reads last; once the tails run is read whole, those too. A sequence read
        again (a resume in this process) is counted once; a block read again after it was let
        go is tokenized again."""
        blocks, places = self.keys(np.asarray(indices, dtype=np.int64))
        tails = len(self._totals)
        for b, p in zip(blocks.tolist(), places.tolist(), strict=True):
            if b in self._spent:
                continue
            seen = self._seen.setdefault(b, set())
            seen.add(p)
            if b == tails:
                whole = tails_count(self._totals, self.sequence_length)
            else:
                whole = int(self._totals[b]) // self.sequence_length
            if len(seen) < whole:
                continue
            self._spent.add(b)
            self._seen.pop(b, None)  # (two reads may end the block at once: both let go, alike)
            if b == tails:
                spent = [
                    self._docs[c] + np.arange(self._tail_from(c), len(o) - 1)
                    for c, o in self._offsets.items()
                ]
            else:
                spent = [self._docs[b] + np.arange(self._tail_from(b))]
            self._counter.let_go(np.concatenate(spent).astype(np.int64))

    def _tail_from(self, block: int) -> int:
        """The first of block ``block``'s documents (by its place in the block) that holds part
        of its tail (the elements after its last whole sequence): the block's document count
        where it has none."""
        offsets = self._offsets[block]
        total = int(offsets[-1])
        whole = total // self.sequence_length * self.sequence_length
        if whole == total:
            return len(offsets) - 1
        return int(np.searchsorted(offsets, whole, side="right")) - 1

    def describe(self, index: int) -> dict[str, Any]:
        """Sequence ``index``'s ``block`` and ``sequence`` (its place in the block; the tails run
        is block ``len(blocks)``), the parts of documents it holds and their files."""
        at = np.asarray([index], dtype=np.int64)
        _, docs, firsts, sizes, _ = self.parts(at)
        (block,), (place,) = self.keys(at)
        place_of = self._counter.document_place
        return {
            "block": int(block),
            "sequence": int(place),
            "documents": [
                [d, f, f + k] for d, f, k in zip(docs.tolist(), firsts.tolist(), sizes.tolist(), strict=True)
            ],
            "files": [[place_of(d)] for d in docs.tolist()],
        }
