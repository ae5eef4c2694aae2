"""Decoded row groups: each decoded once by the first reader that asks (others wait for it),
kept within ``max_decoded_bytes`` (the loader's upcoming reads first, Belady's rule), and over
an object store fetched and decoded ahead of the reads on ``fetch_ahead`` threads.

:class:`_RowGroups` holds what every layer of the storage shares (the files' index, the lock,
the per-process state a pickle leaves out) and the decoding; the length index and the storage's
reads are built on it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError, DatasetIntegrityError, StorageError
from guideloom._process import Live
from guideloom.storage._format._blocks import distinct
from guideloom.storage._parquet._decode import I64, OnNull, _Decoded, check_values
from guideloom.storage._parquet._files import _pa, _Stat
from guideloom.storage._parquet._footers import _chunk_range, _FileEntry, _leaves
from guideloom.storage._parquet._options import DEFAULT_FETCH_AHEAD
from guideloom.storage._text import TextEncoder
from guideloom.storage.base import DocumentStorageAbstract

#: Bytes of a token column decoded between two calls that give arrow's free pages back to the
#: system (each call costs about as much as a decode: its pages are faulted in again). Arrow's
#: allocator keeps some 20 MiB of a decode's freed pages otherwise. A text column's pages are
#: given back after every decode: its rows are tokenized next, which costs a hundred times more.
RELEASE_EVERY_BYTES = 16 * 2**20
_OPEN_FILES = 64  # local ParquetFile handles kept open per process
#: Uses of row groups by the loader's upcoming reads recorded at most (how far the walk of its
#: hint may run ahead of the reads where every row group it meets is decoded already).
_AHEAD_MAX_USES = 1 << 16
#: Stopped before the interpreter joins its threads: the fetches ahead start no new GET after it.
_LIVE: Live[_RowGroups] = Live(lambda storage: storage._stop_ahead(join=False))


class _Decoding(concurrent.futures.Future[_Decoded]):
    """A row group being decoded; ``ahead``: by a fetch ahead (whose failure is not the reads'
    own: a read that waited for it reads the row group itself)."""

    def __init__(self, ahead: bool) -> None:
        super().__init__()
        self.ahead = ahead


class _RowGroups(DocumentStorageAbstract[Any, Any]):
    """The files' row groups, decoded on demand and kept (the base of
    :class:`~guideloom.storage._parquet.ParquetStorage`).

    Over an object store, the loader's hint of its upcoming reads (:meth:`will_read`) is walked
    by ``fetch_ahead`` threads that fetch and decode the row groups those reads need, in order
    of first need, within ``max_decoded_bytes``.
    """

    max_concurrent_reads = 1

    def __init__(
        self,
        files: Any,
        entries: list[_FileEntry],
        column: str,
        *,
        encoder: TextEncoder | None,
        on_null: OnNull,
        max_decoded_bytes: int,
        cache_dir: str | None,
        tokenize: bool = True,
        fetch_ahead: int = DEFAULT_FETCH_AHEAD,
        tokenizer_key: str | None = None,
    ) -> None:
        self.fetch_ahead = fetch_ahead
        self._tokenizer_key = tokenizer_key
        self._files, self._entries, self.column = files, entries, column
        self._encoder, self.on_null, self.max_decoded_bytes = encoder, on_null, max_decoded_bytes
        self._cache_dir, self._tokenize = cache_dir, tokenize
        self._shown: Callable[[str], str] = files.name
        rows = [np.asarray(e.rows, dtype=np.int64) for e in entries]
        self._sizes = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        self._gstarts = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
        self._file_of = np.repeat(np.arange(len(entries)), [len(e.rows) for e in entries]).astype(np.int64)
        firsts = np.concatenate([[0], np.cumsum([len(e.rows) for e in entries])]).astype(np.int64)
        self._group_in_file = np.arange(len(self._sizes), dtype=np.int64) - firsts[self._file_of]
        self._kind = entries[0].kind if entries else "text"
        self._digest = self._make_digest()
        self.max_concurrent_reads = 4 if files.remote else 1
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Condition()
        self._decoded: OrderedDict[int, _Decoded] = OrderedDict()
        self._decoded_bytes = 0
        #: Row groups being decoded, each by the first reader (or fetch ahead) that asked for it.
        self._decoding: dict[int, _Decoding] = {}
        # -- the fetches ahead (over an object store), all under _lock ---------------------------
        #: The rest of the loader's hint: the indices of its upcoming reads, in order.
        self._plan: Iterator[Any] | None = None
        self._plan_seq = 0  # the number of the next window of the hint walked
        #: Row group -> the numbers of the walked windows that read it, not yet read: a row group
        #: with uses is kept before one without, and the nearer use before the farther.
        self._uses: dict[int, deque[int]] = {}
        self._use_count = 0
        self._horizon: dict[int, int] = {}  # row group with uses -> its estimated bytes
        self._horizon_bytes = 0
        self._queue: deque[int] = deque()  # row groups to fetch ahead, in order of first need
        self._queued: set[int] = set()
        self._ahead: dict[int, int] = {}  # row group -> its bytes, fetched ahead now
        self._ahead_failed: set[int] = set()  # left to their reads (which raise the error)
        self._fetchers: list[threading.Thread] = []
        self._stopping = False
        self._bytes_ratio = 1.0  # see _estimate
        self._since_release = 0  # bytes decoded since arrow's pool last gave back its free pages
        self._beside_reads = 0  # reads whose row groups are decoded beside them now
        self._readers: OrderedDict[int, Any] = OrderedDict()
        self._offsets: I64 | None = None
        self.counts = dict.fromkeys(
            (
                "parquet_row_group_decodes",
                "parquet_null_rows",
                "parquet_tokens_tokenized",
                "parquet_tokens_tokenized_again",
            ),
            0,
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without what it decoded or opened: a process worker decodes its own."""
        keep = (
            "_lock",
            "_decoded",
            "_decoded_bytes",
            "_decoding",
            "_since_release",
            "_beside_reads",
            "_readers",
            "counts",
            "_plan",
            "_plan_seq",
            "_uses",
            "_use_count",
            "_horizon",
            "_horizon_bytes",
            "_queue",
            "_queued",
            "_ahead",
            "_ahead_failed",
            "_fetchers",
            "_stopping",
            "_bytes_ratio",
        )
        return {k: v for k, v in self.__dict__.items() if k not in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        offsets = state.get("_offsets")
        self.__dict__.update(state)
        self._reset()
        self._offsets = offsets

    def __len__(self) -> int:
        return int(self._gstarts[-1])

    def content_digest(self) -> str:
        """A digest of every file's path, size, version and row groups, the column and the
        tokenizer: a checkpoint over other files (or the same ones changed) is refused."""
        return self._digest

    def _make_digest(self) -> str:
        h = hashlib.sha256()
        parts: list[Any] = [self.column, self._kind, self.on_null]
        if self._encoder is not None:
            parts.append(self._encoder.describe())
            if self._tokenizer_key is not None:
                parts.append(self._tokenizer_key)
        parts += [[self._shown(e.path), e.size, e.version, e.footer, list(e.rows)] for e in self._entries]
        h.update(json.dumps(parts).encode())
        return "parquet-" + h.hexdigest()[:32]

    # -- decoding --------------------------------------------------------------------------------
    def _where(self, group: int) -> str:
        e = self._entries[int(self._file_of[group])]
        return f"{self._shown(e.path)}: row group {int(self._group_in_file[group])}, column {self.column!r}"

    def _reader(self, f: int) -> Any:
        with self._lock:
            got = self._readers.get(f)
            if got is not None:
                self._readers.move_to_end(f)
                return got
        e = self._entries[f]
        self._files.check_unchanged(e.path, _Stat(e.size, e.version))
        try:
            md, footer = self._files.footer(e.path, e.size)
            if footer != e.footer:
                raise DatasetIntegrityError(
                    f"{self._shown(e.path)}: the file changed since the dataset was opened (its footer "
                    "differs); open it again (a checkpoint made over the old files is refused)"
                )
            reader = self._files.reader(e.path, md)
        except (DatasetFormatError, StorageError, FileNotFoundError, PermissionError):
            raise
        except (OSError, ValueError) as exc:
            raise DatasetFormatError(f"{self._shown(e.path)}: its footer cannot be read ({exc})") from None
        got = (md, reader, _leaves(md, self.column))
        with self._lock:
            self._readers[f] = got
            while len(self._readers) > _OPEN_FILES:
                self._readers.popitem(last=False)
        return got

    def _decode(self, group: int, *, read: bool = True) -> _Decoded:
        """Row group ``group`` decoded: kept, or read and decoded once (a reader that asks for
        it while another decodes it waits for that one's, as concurrent reads of a window do; a
        fetch ahead that failed leaves the row group to the read, which raises its own error).
        ``read``: a read's use of it (one of the hint's uses is done)."""
        with self._lock:
            if read:
                self._use_locked(group)
        while True:
            with self._lock:
                got = self._decoded.get(group)
                if got is not None:
                    self._decoded.move_to_end(group)
                    return got
                pending = self._decoding.get(group)
                if pending is None:
                    mine = self._decoding[group] = _Decoding(ahead=False)
                    break
            try:
                return pending.result()  # the first reader's, or what it raised
            except BaseException:
                if not pending.ahead:
                    raise
        return self._decode_as(group, mine)

    def _decoded_now(self, groups: list[int]) -> list[_Decoded] | None:
        """Row groups ``groups``, each decoded and kept, with no null row, taken for a read in
        one hold of the lock (each a use, as :meth:`_decode` records); None, and no use
        recorded, where one is not (the read then goes through :meth:`_decode`)."""
        with self._lock:
            decoded = self._decoded
            got = []
            for g in groups:
                d = decoded.get(g)
                if d is None or d.nulls is not None:
                    return None
                got.append(d)
            for g in groups:
                self._use_locked(g)
                decoded.move_to_end(g)
        return got

    def _decode_as(self, group: int, mine: _Decoding) -> _Decoded:
        """Decode ``group`` for ``mine`` (registered in ``_decoding``), keep it and resolve it."""
        try:
            decoded = self._decode_new(group)
        except BaseException as exc:
            with self._lock:
                del self._decoding[group]
                self._lock.notify_all()
            mine.set_exception(exc)
            raise
        with self._lock:
            self.counts["parquet_row_group_decodes"] += 1
            self._bytes_ratio = max(self._bytes_ratio, decoded.nbytes / max(1, self._footer_bytes(group)))
            self._decoded[group] = decoded
            self._decoded_bytes += decoded.nbytes
            self._evict_locked(group, keep_new=not mine.ahead)
            del self._decoding[group]
            self._lock.notify_all()
            self._since_release += decoded.nbytes
            release = self._release_due_locked()
        mine.set_result(decoded)
        if release:
            # The decodes' own buffers are freed by now (what is kept was copied out).
            _pa().default_memory_pool().release_unused()
        return decoded

    def _release_due_locked(self) -> bool:
        """Whether arrow's free pages are to be given back now (the count starts again). Not
        while row groups are decoded beside a read (``ParquetStorage._decode_beside``): given back between
        two decodes on several threads, they were faulted in again by the next, three times the
        page faults of one thread; the read gives them back once its decodes are done."""
        due = self._kind == "text" or self._since_release >= RELEASE_EVERY_BYTES
        if not due or not self._since_release or self._beside_reads:
            return False
        self._since_release = 0
        return True

    def _evict_locked(self, new: int, *, keep_new: bool) -> None:
        """Drop decoded row groups until the kept bytes fit ``max_decoded_bytes``: first those no
        upcoming read of the hint uses (least recently used first), then the one whose next use
        is farthest (Belady's rule). A read's own row group is kept (``keep_new``): it is in use."""
        while self._decoded_bytes > self.max_decoded_bytes and len(self._decoded) > 1:
            victim, farthest = None, -1
            for g in self._decoded:
                if g == new and keep_new:
                    continue
                uses = self._uses.get(g)
                if not uses:
                    victim = g
                    break
                if uses[0] > farthest:
                    victim, farthest = g, uses[0]
            if victim is None:
                return
            gone = self._decoded.pop(victim)
            self._decoded_bytes -= gone.nbytes
            self._evicted_locked(victim, gone)

    def _evicted_locked(self, group: int, decoded: _Decoded) -> None:
        """``group`` was dropped to fit ``max_decoded_bytes`` (under the lock)."""

    # -- fetching ahead (object stores) ---------------------------------------------------------
    def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        """The loader's upcoming reads, in order (a lazy iterable): over an object store,
        ``fetch_ahead`` threads fetch and decode the row groups they need, in order of first
        need, several ranged GETs at once, while the row groups not yet read fit
        ``max_decoded_bytes``. Replaces the previous hint. Local files: nothing (a read decodes
        its row groups as fast as it would wait for another thread's), but where a text column
        is tokenized as it is read (see :meth:`_ahead_threads`)."""
        threads = self._ahead_threads()
        if threads < 1:
            return
        with self._lock:
            self._forget_plan_locked()
            self._plan = iter(windows)
            self._stopping = False
            start = threads - len(self._fetchers)
            for _ in range(max(0, start)):
                t = threading.Thread(
                    target=self._fetch_ahead,
                    name=f"guideloom-parquet-ahead-{len(self._fetchers)}",
                    daemon=True,
                )
                self._fetchers.append(t)
                t.start()
            self._lock.notify_all()
        _LIVE.add(self)

    def _ahead_threads(self) -> int:
        """Threads that work on the loader's hint ahead of its reads: ``fetch_ahead`` over an
        object store, none over local files."""
        return self.fetch_ahead if self._files.remote else 0

    def _after_ahead(self, group: int, decoded: _Decoded) -> None:
        """What a thread working ahead does with a row group it decoded (nothing more here)."""

    def _forget_plan_locked(self) -> None:
        self._plan, self._plan_seq = None, 0
        self._uses.clear()
        self._use_count = 0
        self._horizon.clear()
        self._horizon_bytes = 0
        self._queue.clear()
        self._queued.clear()
        self._ahead_failed.clear()

    def _forget_uses_locked(self, group: int) -> None:
        """The hint's uses of ``group`` left: none is read (its reads are done)."""
        uses = self._uses.pop(group, None)
        if uses is not None:
            self._use_count -= len(uses)
            self._horizon_bytes -= self._horizon.pop(group)

    def _spent_locked(self, group: int) -> bool:
        """Whether the hint's reads of ``group`` are done though it lists more (see the text
        storage's ``let_go``): it is not fetched ahead for them."""
        return False

    def _use_locked(self, group: int) -> None:
        """A read of ``group``: its nearest use by the hint is done."""
        uses = self._uses.get(group)
        if uses is None:
            return
        uses.popleft()
        self._use_count -= 1
        if not uses:
            del self._uses[group]
            self._horizon_bytes -= self._horizon.pop(group)
        self._lock.notify_all()

    def _held_locked(self, before: int) -> int:
        """Bytes of the row groups fetched ahead now, and of those decoded that a read of the
        hint uses next at window ``before`` or earlier."""
        held = sum(self._ahead.values())
        uses = self._uses
        return held + sum(d.nbytes for g, d in self._decoded.items() if g in uses and uses[g][0] <= before)

    def _footer_bytes(self, group: int) -> int:
        """The bytes a decoded ``group`` holds by its footer: its column's uncompressed size
        (which an encoding may make smaller: a dictionary's) and its rows' offsets."""
        e = self._entries[int(self._file_of[group])]
        return int(e.nbytes[int(self._group_in_file[group])]) + 8 * (int(self._sizes[group]) + 1)

    def _estimate(self, group: int) -> int:
        """The bytes ``group`` will hold decoded: its footer's figure times the largest ratio
        of a decoded row group's bytes to its footer's figure seen so far."""
        return int(self._footer_bytes(group) * self._bytes_ratio)

    def _walk_locked(self, windows: int) -> bool:
        """Walk up to ``windows`` more windows of the hint, recording which row groups they use
        and queueing those to fetch, while the row groups with uses stay under twice
        ``max_decoded_bytes`` (by estimate): how far the fetches and the eviction see ahead.
        Whether it may walk further now."""
        for _ in range(windows):
            if (
                self._plan is None
                or self._horizon_bytes >= 2 * self.max_decoded_bytes
                or self._use_count >= _AHEAD_MAX_USES
            ):
                return False
            try:
                indices = next(self._plan, None)
            except Exception:  # a hint that cannot be computed: no fetching ahead on it
                indices = None
            if indices is None:
                self._plan = None
                return False
            indices = np.asarray(indices, dtype=np.int64)
            if not len(indices) or indices.min() < 0 or indices.max() >= len(self):
                continue  # not a read of this storage's rows: its read will say so
            seq, self._plan_seq = self._plan_seq, self._plan_seq + 1
            groups = distinct(np.searchsorted(self._gstarts, indices, side="right") - 1).tolist()
            for g in groups:
                if self._spent_locked(g):
                    continue
                uses = self._uses.get(g)
                if uses is None:
                    uses = self._uses[g] = deque()
                    self._horizon[g] = self._estimate(g)
                    self._horizon_bytes += self._horizon[g]
                uses.append(seq)
                self._use_count += 1
                if g not in self._decoded and g not in self._decoding and g not in self._queued:
                    self._queue.append(g)
                    self._queued.add(g)
        return True

    def _next_ahead_locked(self) -> int | None:
        """The next row group to fetch ahead, claimed: the one first needed soonest, once the
        row groups fetched ahead and those decoded whose next use is no later than its first fit
        ``max_decoded_bytes`` with it (the others would be dropped for it); ``None`` once the
        hint is done or the storage closes."""
        while not self._stopping:
            more = self._walk_locked(64)
            while self._queue:
                g = self._queue[0]
                done = g in self._decoded or g in self._decoding or g in self._ahead_failed
                if not done and g in self._uses:
                    break
                self._queue.popleft()  # decoded meanwhile, or its reads are done
                self._queued.discard(g)
            if self._queue:
                g = self._queue[0]
                size = self._estimate(g)
                if self._held_locked(self._uses[g][0]) + size <= self.max_decoded_bytes:
                    self._queue.popleft()
                    self._queued.discard(g)
                    self._ahead[g] = size
                    return g
            elif self._plan is None:
                return None
            self._lock.wait(0 if more else 1.0)  # the lock is let go between steps of the walk
        return None

    def _fetch_ahead(self) -> None:
        """A fetching thread: row groups of the hint, one after another, through ``_decode``'s
        path (a read that needs one waits for it), until the hint is done or the storage closes."""
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    g = self._next_ahead_locked()
                    if g is None:
                        return
                    mine = self._decoding[g] = _Decoding(ahead=True)
                decoded = None
                try:
                    decoded = self._decode_as(g, mine)
                except BaseException:
                    with self._lock:
                        self._ahead_failed.add(g)  # left to its read, which raises its own error
                finally:
                    with self._lock:
                        self._ahead.pop(g, None)
                        self._lock.notify_all()
                if decoded is not None:
                    self._after_ahead(g, decoded)
        finally:
            with self._lock:
                if me in self._fetchers:
                    self._fetchers.remove(me)
                self._lock.notify_all()  # threads waiting for what a fetcher would bring

    def _stop_ahead(self, *, join: bool = True) -> None:
        """Stop fetching ahead (a fetch in progress completes) and, with ``join``, wait for it."""
        with self._lock:
            self._stopping = True
            self._forget_plan_locked()
            self._lock.notify_all()
            threads = list(self._fetchers)
        if join:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()

    async def close(self) -> None:
        """Stop fetching ahead (the loader closes its storage after its last read)."""
        if self._fetchers:
            await self._blocking(self._stop_ahead)

    def _decode_new(self, group: int) -> _Decoded:
        """Row group ``group``'s column read and decoded (nothing of arrow's kept)."""
        f = int(self._file_of[group])
        e = self._entries[f]
        md, reader, leaves = self._reader(f)
        g = int(self._group_in_file[group])
        self._files.check_unchanged(e.path, _Stat(e.size, e.version))
        try:
            where = (e.path, reader, g, [self.column], _chunk_range(md, g, leaves))
            if e.kind == "text":  # a slice at a time (TEXT_BATCH_ROWS), each copied out of arrow
                decoded = _Decoded.joined(
                    [_Decoded(b.column(0), "text") for b in self._files.read_batches(*where)]
                )
            else:
                column = self._files.read_group(*where).column(self.column)
                # one chunk (a row group's column): taken as it is, combine_chunks() would copy it
                decoded = _Decoded(
                    column.chunk(0) if column.num_chunks == 1 else column.combine_chunks(), e.kind
                )
            if len(decoded.offsets) - 1 != e.rows[g]:
                raise DatasetFormatError(
                    f"decoded {plural(len(decoded.offsets) - 1, 'row')}, the footer says {e.rows[g]}"
                )
        except (DatasetIntegrityError, FileNotFoundError, PermissionError, StorageError):
            raise
        except DatasetFormatError as exc:
            raise DatasetFormatError(f"{self._where(group)}: {exc}") from None
        except (OSError, ValueError, IndexError) as exc:
            raise DatasetFormatError(f"{self._where(group)}: cannot be decoded ({exc})") from None
        # a file written over while it was read: not delivered
        self._files.check_unchanged(e.path, _Stat(e.size, e.version))
        check_values(decoded, md.row_group(g), leaves, int(self._sizes[group]), self._where(group))
        return decoded

    def _nulls(self, group: int, decoded: _Decoded, local: I64) -> None:
        if decoded.nulls is None:
            return
        hit = local[decoded.nulls[local]]
        if not len(hit):
            return
        if self.on_null == "error":
            row = int(hit[0])
            raise DatasetFormatError(
                f"{self._where(group)}: row {row} (document {int(self._gstarts[group]) + row}) is null; "
                "pass on_null='empty' to read null rows as empty documents (they are counted in "
                "stats()), or filter them out of the files"
            )
        with self._lock:
            self.counts["parquet_null_rows"] += len(hit)

    def _decode_text_again(self, group: int, decoded: _Decoded) -> None:
        """Give ``decoded`` its text again (decoded anew, checked as the first decode was)."""
        fresh = self._decode_new(group)
        with self._lock:
            self.counts["parquet_row_group_decodes"] += 1
            if decoded.values is None:
                decoded.values = fresh.values
                added = 0 if fresh.values is None else int(fresh.values.nbytes)
                decoded.nbytes += added
                if self._decoded.get(group) is decoded:
                    self._decoded_bytes += added

    def _cut(self, group: int, decoded: _Decoded, local: I64) -> list[Any]:
        """Rows ``local`` of row group ``group``; a text that is not UTF-8 (a damaged page that
        decoded) is refused by its place. A text row group whose text was let go (every row
        tokenized, some tokens let go since) is decoded again for it."""
        if decoded.text and decoded.values is None:
            self._decode_text_again(group, decoded)
        try:
            return decoded.rows(local)
        except UnicodeDecodeError as exc:
            raise DatasetFormatError(
                f"{self._where(group)}: a row is not valid UTF-8 text ({exc.reason}): the file is "
                "damaged, or the column holds bytes that are not text"
            ) from None
