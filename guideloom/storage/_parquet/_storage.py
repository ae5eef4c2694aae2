"""The storage class: the rows of Parquet files as documents, read by index."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from guideloom._core.text import plural
from guideloom._process import cores as process_cores
from guideloom.storage._parquet._decode import I64
from guideloom.storage._parquet._files import _pa
from guideloom.storage._parquet._lengths import _LengthIndex
from guideloom.storage._parquet._rowgroups import _Decoding

#: Threads that decode a read's row groups beside it (:meth:`ParquetStorage._decode_beside`) at
#: most, one fewer than the cores a read may use at most (one in a worker process: none).
BESIDE_THREADS = 3


class _Beside:
    """The threads decoding a read's row groups beside it; :meth:`stop` once the read is done
    (or failed): they claim no other row group, and are joined (one may finish the row group it
    decodes), so that none outlives the read."""

    def __init__(self, end: Callable[[], None] | None = None) -> None:
        self.threads: list[threading.Thread] = []
        self.stopping = False
        self._end = end

    def stop(self) -> None:
        self.stopping = True
        for t in self.threads:
            t.join()
        end, self._end = self._end, None
        if end is not None:
            end()


class ParquetStorage(_LengthIndex):
    """The rows of Parquet files as documents (see :func:`open_parquet`).

    Over an object store, the loader's hint of its upcoming reads (:meth:`will_read`) is walked
    by ``fetch_ahead`` threads that fetch and decode the row groups those reads need, in order
    of first need, within ``max_decoded_bytes``.
    """

    max_concurrent_reads = 1

    def __repr__(self) -> str:
        first = self._shown(self._entries[0].path) if self._entries else "-"
        return (
            f"ParquetStorage({plural(len(self._entries), 'file')} from {first!r}, column={self.column!r}, "
            f"rows={len(self)})"
        )

    # -- what it holds ---------------------------------------------------------------------------
    @property
    def tokenized(self) -> bool:
        """Whether samples are token arrays (a list column, or a text column with a tokenizer)."""
        return self._kind != "text" or (self._encoder is not None and self._tokenize)

    @property
    def dtype(self) -> np.dtype[Any]:
        if self._kind != "text":
            return np.dtype(self._kind.split(":", 1)[1])
        if self._encoder is not None and self._tokenize:
            return self._encoder.dtype
        return np.dtype(object)

    @property
    def files(self) -> list[str]:
        """The files, in the order their rows are numbered."""
        return [self._shown(e.path) for e in self._entries]

    def file_summary(self) -> list[tuple[str, int, int, int]]:
        """Each file's name, rows, row groups and size in bytes, in row order."""
        return [(self._shown(e.path), sum(e.rows), len(e.rows), e.size) for e in self._entries]

    @property
    def num_row_groups(self) -> int:
        """Row groups over all files."""
        return len(self._sizes)

    def row_group_sizes(self) -> I64:
        """Rows in each row group, over all files in order."""
        return self._sizes.copy()

    def natural_blocks(self) -> I64:
        """The row groups' sizes: the blocks a row-group-aware shuffle keeps together."""
        return self._sizes

    def sample_nbytes_hint(self) -> int:
        total = sum(sum(e.nbytes) for e in self._entries)
        return max(1, total // max(1, len(self)))

    def figures(self) -> dict[str, float]:
        """What ``loader.stats()`` reports of this storage (counted in the process that reads)."""
        return {
            "parquet_files": float(len(self._entries)),
            "parquet_row_groups": float(len(self._sizes)),
            **{k: float(v) for k, v in self.counts.items()},
        }

    def reads_inline(self) -> bool:
        return self._plain_reads and not self._files.remote

    def read_by_workers(self) -> bool:
        """Texts that are tokenized elsewhere (by the workers, or by ``collate_fn``) are read by
        the main process and sent: the workers' work is the tokenizing, a batch of texts is small
        next to a window of decoded row groups, and one process holds that window instead of
        every worker. Texts tokenized at read (packing, a mixture) are read by the main process
        too: each row's tokens are kept with its row group there, so a document that sequences
        of several workers' batches hold is tokenized once, not once in each worker, and the
        tokenizer runs on every core. Token arrays are read by the workers, which decode in
        parallel."""
        return self._kind != "text"

    def deferred_step(self) -> tuple[ParquetStorage, Callable[[Sequence[Any]], Sequence[Any]]] | None:
        """Where a loader reads this storage document by document: the storage that reads the
        texts untokenized and the step that tokenizes a batch of them, which the loader runs
        where it collates (in thread or process workers, in parallel). ``None`` for a list
        column or a text column without a tokenizer."""
        if self._kind != "text" or self._encoder is None or not self._tokenize:
            return None
        texts = ParquetStorage.__new__(ParquetStorage)
        texts.__setstate__({**self.__getstate__(), "_tokenize": False})
        return texts, self._encoder.encode_many

    def _rows(self, indices: I64, tokens: bool = False) -> list[Any]:
        """The rows at ``indices``: every row group they touch decoded once, then, for a list
        column, one view per row cut from its group's values (the cuts computed with numpy per
        row group; the only per-row Python work is the slice itself). ``tokens``: a text
        column's rows as token arrays, each row tokenized once while its row group is kept."""
        cut = self._token_rows if tokens else self._cut
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return []
        if indices.min() < 0 or indices.max() >= len(self):
            raise IndexError(f"document index outside [0, {len(self)})")
        groups = np.searchsorted(self._gstarts, indices, side="right") - 1
        local = indices - self._gstarts[groups]
        first = int(groups[0])
        if (groups == first).all():  # the common case under a row-group shuffle's windows
            decoded = self._decode(first)
            self._nulls(first, decoded, local)
            return cut(first, decoded, local)
        if not tokens and self._kind != "text":
            rows = self._list_rows(groups, local)
            if rows is not None:
                return rows
        # the rows of each row group, in read order (not np.unique: it imports numpy.ma, tens
        # of ms in a first batch)
        order = np.argsort(groups, kind="stable")
        ordered = groups[order]
        starts = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
        kept = ordered[np.concatenate(([0], starts))]
        ats = np.split(order, starts)
        # one row group at a time: a read over many (a global row shuffle) holds one decoded
        # group beyond the cache, and for a list column the rows' own values; the row groups it
        # decodes are decoded on the other cores beside it where they all fit the cache
        # (:meth:`_decode_beside`: a resume's first read decodes every row group)
        out: list[Any] = [None] * len(indices)
        groups_list = kept.tolist()
        beside = self._decode_beside(groups_list)
        try:
            for g, at in zip(groups_list, ats, strict=True):
                decoded = self._decode(g)
                self._nulls(g, decoded, local[at])
                for i, row in zip(at.tolist(), cut(g, decoded, local[at]), strict=True):
                    out[i] = row
        finally:
            beside.stop()
        return out

    def _decode_beside(self, groups: list[int]) -> _Beside:
        """Start threads that decode ``groups`` (a read's, in the order it decodes them) from
        the last backwards while the read decodes them from the first: each row group is claimed
        as :meth:`_decode` claims it, and the read waits for one claimed beside it. A read over
        every row group (a resume's first batch under a global shuffle) then decodes on every
        core, where arrow decodes a column chunk on one. Over local files only (an object
        store's row groups are fetched ahead by the hint's threads), with two row groups or more
        to decode, and where every row group the read decodes fits ``max_decoded_bytes``
        beside those kept: none of the read's own is dropped for another. A decode that fails
        beside the read is left to the read, which decodes that row group again and raises its
        own error. Not for a text column: a read of its rows tokenizes them, which costs a hundred
        times their decode, and a decode on a thread of its own left arrow's pages with that
        thread (30-50 MiB at the peak for row groups of 6 MB)."""
        cores = process_cores()
        if self._files.remote or self._kind == "text" or len(groups) < 2 or cores < 2:
            return _Beside()
        with self._lock:
            missing = [g for g in groups if g not in self._decoded and g not in self._decoding]
            fits = self._decoded_bytes + sum(self._estimate(g) for g in missing) <= self.max_decoded_bytes
            if len(missing) < 2 or not fits:
                return _Beside()
            self._beside_reads += 1
        beside = _Beside(self._end_beside)
        for _ in range(min(len(missing) - 1, cores - 1, BESIDE_THREADS)):
            t = threading.Thread(
                target=self._decode_backwards,
                args=(missing, beside),
                name="guideloom-parquet-decode",
                daemon=True,
            )
            beside.threads.append(t)
            t.start()
        return beside

    def _end_beside(self) -> None:
        """A read's decodes beside it are over: arrow's free pages given back if due."""
        with self._lock:
            self._beside_reads -= 1
            release = self._release_due_locked()
        if release:
            _pa().default_memory_pool().release_unused()

    def _decode_backwards(self, groups: list[int], beside: _Beside) -> None:
        """A thread of :meth:`_decode_beside`: ``groups`` not claimed yet, from the last."""
        for g in reversed(groups):
            with self._lock:
                if beside.stopping:
                    return
                if g in self._decoded or g in self._decoding:
                    continue
                mine = self._decoding[g] = _Decoding(ahead=True)
            try:
                self._decode_as(g, mine)
            except BaseException:  # the read decodes it again and raises its own error
                return

    def _list_rows(self, groups: I64, local: I64) -> list[Any] | None:
        """A list column's rows over several row groups, when every group they touch is decoded
        already and holds no null row (the steady state of a global shuffle): the groups taken
        in one hold of the lock, then one slice per row cut with plain ints (a batch of 32 rows
        from 12 groups cost 55 microseconds group by group, most of it each group's lookup and
        numpy's per-call cost); None otherwise (the read goes group by group, decoding)."""
        keys = groups.tolist()
        kept = sorted(set(keys))
        got = self._decoded_now(kept)
        if got is None:
            return None
        cuts: dict[int, tuple[Any, Any]] = {}
        for g, d in zip(kept, got, strict=True):
            assert d.values is not None  # a list column's values stay (a text's alone may go)
            cuts[g] = (d.values, d.bounds)
        out: list[Any] = []
        add = out.append
        for g, row in zip(keys, local.tolist(), strict=True):
            values, bounds = cuts[g]
            add(values[bounds[row] : bounds[row + 1]])
        return out

    def read_many_sync(self, indices: I64) -> Sequence[Any]:
        indices = np.asarray(indices, dtype=np.int64)
        rows = self._rows(
            indices, tokens=self._kind == "text" and self._encoder is not None and self._tokenize
        )
        if self._offsets is not None and self.tokenized:
            self._check_lengths(indices, rows)
        elif self.tokenized:
            self._check_block_lengths(indices, rows)
        if self._kind == "text" and self.tokenized:
            dtype = self.dtype  # kept narrower (the encoder's kept_dtype): delivered in its own copy
            return [row if row.dtype == dtype else row.astype(dtype) for row in rows]
        return rows

    def describe_document(self, index: int) -> dict[str, Any]:
        """Row ``index``: its file, row group and row, and its length in tokens (decoding its row
        group and, for a text, tokenizing that row: the whole length index is not built for it);
        where the length index is built (packing), its elements too. A text column without a
        tokenizer has no tokens: its length is ``None``."""
        place = [self._row_place(index)]
        if self._offsets is not None:
            start, stop = self._offsets[index : index + 2].tolist()
            return {"documents": [[index, 0, stop - start]], "elements": [[start, stop]], "files": [place]}
        (row,) = self._rows(np.asarray([index], dtype=np.int64))
        if self._kind == "text":
            length = None if self._encoder is None else len(self._encoder.encode_many([row])[0])
        else:
            length = len(row)
        return {"documents": [[index, 0, length]], "files": [place]}
