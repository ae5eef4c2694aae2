"""A text row group's rows tokenized once each: by the read that needs them, or ahead of it.

A read of a text column's rows as tokens (packing, a mixture) tokenizes the rows it needs that
are not tokenized yet, and the row group keeps their tokens. Ahead of the reads, row groups are
queued to be tokenized: by the thread that decodes those of the loader's upcoming reads, and by
a read that touched one. :data:`TOKENIZING_THREADS` threads of the storage's own take the queued
rows a chunk at a time while the reads go on: the tokenizer's calls are large (the ``tokenizers``
library spreads a batch over every core), two of them keep the cores busy where one leaves them
idle, and they overlap the reads' own Python work instead of waiting for it. Each row is claimed
by whichever thread gets to it first, and a read that needs a row another thread is tokenizing
waits for it, so no row is tokenized twice; a chunk that fails is left to the read that needs it,
which raises its own error. Only row groups that are kept are tokenized ahead, and a read's only
while the kept row groups fill less than half of ``max_decoded_bytes`` (beyond, what it made
might be dropped before a read used it).
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._process import release_malloc
from guideloom.storage._parquet._decode import _ROW_OVERHEAD, I64, _Decoded
from guideloom.storage._parquet._rowgroups import _LIVE, RELEASE_EVERY_BYTES, _RowGroups
from guideloom.storage._text import kept_array

__all__ = ["AHEAD_CHUNK", "TOKENIZE_BYTES", "TOKENIZING_FETCHERS", "TOKENIZING_THREADS"]

#: Rows a thread tokenizing ahead claims and tokenizes at a time: large enough for the tokenizer
#: to spread over the cores and for one long document not to leave them idle at the end of a
#: call (calls of 64 rows of prose tokenized about a tenth slower), small enough that a read
#: needing one of them waits briefly.
AHEAD_CHUNK = 256
#: Threads fetching ahead over an object store where a text column is tokenized as it is read
#: (``fetch_ahead`` caps it): a row group's fetch takes a fraction of its tokenizing, and 8 of
#: them (the default elsewhere) held 30-50 MiB more at the peak for the same rate.
TOKENIZING_FETCHERS = 2
#: Threads that tokenize the queued rows, two calls in flight: the cores one call leaves idle (on
#: its longest text at its end, in its own Python work before and after) the other's fill. With
#: one call at a time, from the thread that also decoded, row groups of 100 rows of prose kept
#: the tokenizer's threads busy 1.58 of 2 cores.
TOKENIZING_THREADS = 2
#: Bytes of text tokenized in one call at most: a ``tokenizers`` batch holds several times its
#: text's bytes while it runs (an encoding per text, with its tokens' strings and offsets), and a
#: whole row group's rows in one call (a read of all of them: the length index's) would hold
#: hundreds of MiB at once. Calls of 1 MiB of prose raised a process's peak by 54 MiB, of 512 KiB
#: by 40, of 256 KiB by 35 (for a tenth more CPU); the loader's reads and the thread tokenizing
#: ahead make two such calls at once.
TOKENIZE_BYTES = 2**19
#: Tokens made again for rows whose tokens a row group let go to fit ``max_decoded_bytes`` while
#: they were still kept for the epoch's reads: past this share of the tokens made (and
#: :data:`AGAIN_LEAST` of them), the bound is too small for the reads and a warning says so.
AGAIN_SHARE = 0.05
AGAIN_LEAST = 4096


#: Rows of one row group claimed by a thread, to be tokenized: (group, decoded, rows).
_Claim = tuple[int, _Decoded, list[int]]


def _calls(chunk: list[_Claim]) -> Iterator[list[_Claim]]:
    """``chunk``'s rows in calls of at most :data:`TOKENIZE_BYTES` of text (one row at least a
    call), each row group's rows of a call together."""
    call: list[_Claim] = []
    held = 0
    for group, decoded, rows in chunk:
        part: list[int] = []
        for i in rows:
            size = int(decoded.offsets[i + 1] - decoded.offsets[i])
            if (call or part) and held + size > TOKENIZE_BYTES:
                if part:
                    call.append((group, decoded, part))
                    part = []
                yield call
                call, held = [], 0
            part.append(i)
            held += size
        if part:
            call.append((group, decoded, part))
    if call:
        yield call


def _rows_named(call: list[_Claim], where: Callable[[int], str]) -> str:
    """The rows of a tokenizer call, for an error's note: each row group's, by their place in it."""
    parts = []
    for group, _, rows in call:
        shown = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
        parts.append(f"{where(group)}, row{'s' if len(rows) > 1 else ''} {shown} of the row group")
    return "; ".join(parts)


def _let_text_go(decoded: _Decoded) -> int:
    """Once every row of a row group is tokenized, its text is read no more (a storage that
    tokenizes reads tokens; a read of its texts is another storage's, with its own row groups):
    let it go. The bytes freed (under the storage's lock)."""
    tokens, dropped = decoded.tokens, decoded.dropped
    if decoded.values is None or tokens is None:
        return 0
    if any(t is None and i not in dropped for i, t in enumerate(tokens)):
        return 0
    freed = int(decoded.values.nbytes)
    decoded.values = None
    return freed


def _claim_locked(decoded: _Decoded, at: int, most: int = AHEAD_CHUNK) -> tuple[list[int], int]:
    """Claim up to ``most`` rows of ``decoded`` neither tokenized nor claimed, looking from row
    ``at`` on (under the storage's lock): the rows, and where the next look starts."""
    tokens = decoded.tokens
    assert tokens is not None
    rows: list[int] = []
    while at < len(tokens) and len(rows) < most:
        if tokens[at] is None and at not in decoded.claimed and at not in decoded.dropped:
            rows.append(at)
        at += 1
    decoded.claimed.update(rows)
    return rows, at


class _TokenRows(_RowGroups):
    """Row groups whose text rows are tokenized once, by a read or ahead of it."""

    #: Whether rows of a touched text row group are tokenized ahead on a thread (a class
    #: attribute a subclass or test may turn off).
    tokenize_ahead = True

    def _reset(self) -> None:
        super()._reset()
        self._to_tokenize: deque[tuple[int, _Decoded]] = deque()
        self._tokenizing: set[int] = set()  # row groups queued or being tokenized ahead
        self._tokenizers: list[threading.Thread] = []  # the threads taking queued rows
        self._tokens_stop = False
        self._since_trim = 0  # text bytes tokenized since the C heap last gave back its free pages
        #: Row groups let go whole under the loader's hint (see :meth:`let_go`): not fetched or
        #: tokenized ahead again for it (a read that needs one still decodes it).
        self._spent_groups: set[int] = set()
        #: Row group -> its rows whose tokens went with it when it was dropped to fit
        #: ``max_decoded_bytes`` under this hint: tokenizing them again is work done twice.
        self._lost_rows: dict[int, npt.NDArray[np.bool_]] = {}
        self._again_warning: str | None = None  # to be given by the next read; "" once given

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        keys = ("_to_tokenize", "_tokenizing", "_tokenizers", "_tokens_stop")
        for key in (*keys, "_since_trim", "_spent_groups", "_lost_rows", "_again_warning"):
            state.pop(key, None)
        return state

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        """A new hint (the loader's epoch): rows whose tokens were let go in the last one are
        worth tokenizing ahead again (see :meth:`let_go`)."""
        with self._lock:
            for decoded in self._decoded.values():
                if decoded.dropped:
                    decoded.dropped.clear()
                    decoded.scan, decoded.ahead_done = 0, False
            self._spent_groups.clear()
            self._lost_rows.clear()
        super().will_read(windows)

    def _evicted_locked(self, group: int, decoded: _Decoded) -> None:
        tokens = decoded.tokens
        if tokens is None or self._kind != "text":
            return
        kept = np.fromiter((t is not None for t in tokens), dtype=np.bool_, count=len(tokens))
        if kept.any():
            was = self._lost_rows.get(group)
            self._lost_rows[group] = kept if was is None else kept | was

    def _count_again_locked(self, group: int, rows: list[int], offsets: I64) -> None:
        """Count the tokens just made for ``rows`` of ``group`` that had been made under this
        hint and dropped with their row group; once they pass :data:`AGAIN_SHARE` of the tokens
        made, the next read warns (once): the bound is below what the reads hold at once."""
        lost = self._lost_rows.get(group)
        if lost is None:
            return
        at = np.asarray(rows, dtype=np.int64)
        hit = lost[at]
        if not hit.any():
            return
        lost[at] = False
        self.counts["parquet_tokens_tokenized_again"] += int(np.diff(offsets)[hit].sum())
        again, made = self.counts["parquet_tokens_tokenized_again"], self.counts["parquet_tokens_tokenized"]
        if self._again_warning is None and again >= AGAIN_LEAST and again >= AGAIN_SHARE * made:
            self._again_warning = (
                f"{self!r}: {again} of the {made} tokens made so far were made again: row groups "
                f"were dropped to fit max_decoded_bytes={self.max_decoded_bytes} while their tokens "
                "were still to be read, then decoded and tokenized again. Pass open_parquet("
                "max_decoded_bytes=...) above the decoded text and tokens of the row groups a "
                "window of the loader reads (about three times their text)"
            )

    def _warn_again(self) -> None:
        """Give the warning :meth:`_count_again_locked` prepared, in the read's thread."""
        with self._lock:
            message = self._again_warning
            if message:
                self._again_warning = ""
        if message:
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _spent_locked(self, group: int) -> bool:
        return group in self._spent_groups

    def _tokenizes_ahead(self) -> bool:
        return self.tokenize_ahead and self._kind == "text" and self._encoder is not None and self._tokenize

    def _ahead_threads(self) -> int:
        """Where a text column is tokenized as it is read, local files too: threads that decode
        the row groups of the loader's upcoming reads, in order of first need, and queue them
        for the threads that tokenize. One over local files, at most
        :data:`TOKENIZING_FETCHERS` over an object store: the tokenizer is the bound, and more
        fetchers only hold more fetched and decoded row groups waiting for it."""
        if not self._tokenizes_ahead():
            return super()._ahead_threads()
        return max(1, min(super()._ahead_threads(), TOKENIZING_FETCHERS))

    def _after_ahead(self, group: int, decoded: _Decoded) -> None:
        """A row group decoded ahead of its reads: queued to be tokenized (a read that needs rows
        of it meanwhile claims those itself); the fetcher then waits while the queue holds a
        chunk's rows for each thread that tokenizes, so that the text decoded ahead stays a
        few calls' worth."""
        if not self._tokenizes_ahead() or decoded.tokens is None:
            return
        with self._lock:
            if self._stopping:
                return
            starts = self._queue_tokens_locked(group, decoded)
        self._start_tokenizers(starts)
        with self._lock:
            while not self._stopping and self._rows_queued_locked() >= TOKENIZING_THREADS * AHEAD_CHUNK:
                self._lock.wait()

    def _rows_queued_locked(self) -> int:
        """Rows of the queued row groups that no thread tokenizing ahead has looked at yet (a
        read may have claimed some of them)."""
        return sum(len(d.tokens or ()) - d.scan for _, d in self._to_tokenize)

    def _token_rows(self, group: int, decoded: _Decoded, local: I64, *, ahead: bool = True) -> list[Any]:
        """Rows ``local`` of a text row group as token arrays, each tokenized once while its row
        group is kept (the arrays count in ``max_decoded_bytes``). ``ahead=False``: the group's
        other rows are left to a later read (a count of some rows, which a first batch waits
        for, does not share the cores with them)."""
        tokens = decoded.tokens
        if tokens is None:
            raise TypeError("token_rows reads a text column's rows")
        wanted = local.tolist()
        need = sorted(set(wanted))
        while True:
            with self._lock:
                missing = [i for i in need if tokens[i] is None]
                if not missing:  # taken under the lock: a let_go may drop rows after it
                    got = [tokens[i] for i in wanted]
                    break
                mine = [i for i in missing if i not in decoded.claimed]
                if not mine:  # all being tokenized by another thread: wait for it
                    self._lock.wait()
                    continue
                decoded.claimed.update(mine)
            self._tokenize_claimed(group, decoded, mine)
        if self.tokenize_ahead and ahead:
            self._tokenize_rest(group, decoded)
        if self._again_warning:
            self._warn_again()
        return got

    def _tokenize_claimed(self, group: int, decoded: _Decoded, rows: list[int]) -> None:
        """Tokenize ``rows`` (claimed by this thread) and keep their tokens; see
        :meth:`_tokenize_chunk`."""
        self._tokenize_chunk([(group, decoded, rows)])

    def _tokenize_chunk(self, chunk: list[_Claim]) -> None:
        """Tokenize the claimed rows of one or more row groups and keep their tokens, at most
        :data:`TOKENIZE_BYTES` of text a call (a tokenizer's batch holds several times its
        text's bytes while it runs); the claims are let go however it ends (rows left
        untokenized are then claimed by the next that needs them)."""
        text = 0
        try:
            for call in _calls(chunk):
                text += self._tokenize_call(call)
        finally:
            with self._lock:
                for _, decoded, rows in chunk:
                    decoded.claimed.difference_update(rows)
                self._lock.notify_all()
                self._since_trim += text
                trim = self._since_trim >= RELEASE_EVERY_BYTES
                if trim:
                    self._since_trim = 0
        if trim:
            release_malloc()

    def _tokenize_call(self, call: list[_Claim]) -> int:
        """Tokenize the claimed rows of ``call`` in one tokenizer call and keep each row
        group's tokens; their text's bytes."""
        assert self._encoder is not None
        texts = [self._cut(group, decoded, np.asarray(rows, dtype=np.int64)) for group, decoded, rows in call]
        try:
            kept = self._encoder.encode_kept(texts)
        except Exception as error:  # the tokenizer's own error, told where its texts come from
            error.add_note(f"raised tokenizing {_rows_named(call, self._where)}")
            raise
        with self._lock:
            for (group, decoded, rows), (flat, offsets) in zip(call, kept, strict=True):
                tokens = decoded.tokens
                assert tokens is not None
                bounds = offsets.tolist()
                for k, i in enumerate(rows):  # each row a view of its row group's part of the call
                    tokens[i] = flat[bounds[k] : bounds[k + 1]]
                decoded.dropped.difference_update(rows)
                made = len(flat)
                self.counts["parquet_tokens_tokenized"] += made
                self._count_again_locked(group, rows, offsets)
                added = int(flat.nbytes) + _ROW_OVERHEAD * len(rows)
                decoded.token_bytes += added
                freed = _let_text_go(decoded)
                self._since_trim += freed  # given back to the system at the next trim
                added -= freed
                decoded.nbytes += added
                if self._decoded.get(group) is decoded:
                    self._decoded_bytes += added
                    self._evict_locked(group, keep_new=True)
            self._lock.notify_all()
        return sum(len(t) for part in texts for t in part)

    def let_go(self, indices: I64) -> None:
        """Documents ``indices`` are read no more this epoch (packing has read every sequence
        that holds a part of them): their kept tokens are dropped, and their row group's other
        kept tokens copied together (a call's array holds rows of several documents); a row group
        with no tokens or text left is dropped whole. A later read (the next epoch's) tokenizes
        them again, decoding the row group again where its text was let go."""
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices) or self._kind != "text":
            return
        groups = np.searchsorted(self._gstarts, indices, side="right") - 1
        order = np.argsort(groups, kind="stable")
        groups, indices = groups[order], indices[order]
        cuts = np.flatnonzero(np.diff(groups)) + 1
        with self._lock:
            for part, local in zip(np.split(groups, cuts), np.split(indices, cuts), strict=True):
                g = int(part[0])
                decoded = self._decoded.get(g)
                if decoded is not None and decoded.tokens is not None:
                    self._drop_rows_locked(g, decoded, (local - self._gstarts[g]).tolist())

    def _drop_rows_locked(self, group: int, decoded: _Decoded, rows: list[int]) -> None:
        """Drop ``rows``' tokens (a row being tokenized now is left: it is made) and copy the
        others into one array, so that the arrays the dropped rows shared are freed."""
        tokens = decoded.tokens
        assert tokens is not None
        held = False
        for i in rows:
            if i not in decoded.claimed:
                held = held or tokens[i] is not None
                tokens[i] = None
                decoded.dropped.add(i)
        freed = _let_text_go(decoded)  # its other rows may all be tokenized or let go by now
        decoded.nbytes -= freed
        if self._decoded.get(group) is decoded:
            self._decoded_bytes -= freed
        if not held:
            return
        kept = [i for i, t in enumerate(tokens) if t is not None]
        was = decoded.token_bytes
        if kept:
            assert self._encoder is not None
            arrays = [tokens[i] for i in kept]
            offsets = np.zeros(len(kept) + 1, dtype=np.int64)
            np.cumsum([len(a) for a in arrays if a is not None], out=offsets[1:])
            flat = kept_array(int(offsets[-1]), self._encoder.kept_dtype)
            bounds = offsets.tolist()
            for k, array in enumerate(arrays):
                flat[bounds[k] : bounds[k + 1]] = array
            flat.flags.writeable = False
            for k, i in enumerate(kept):
                tokens[i] = flat[bounds[k] : bounds[k + 1]]
            decoded.token_bytes = int(flat.nbytes) + _ROW_OVERHEAD * len(kept)
        else:
            decoded.token_bytes = 0
        change = decoded.token_bytes - was
        decoded.nbytes += change
        if self._decoded.get(group) is not decoded:
            return
        self._decoded_bytes += change
        if not kept and decoded.values is None and not decoded.claimed:
            self._decoded_bytes -= self._decoded.pop(group).nbytes
            self._spent_groups.add(group)
            self._forget_uses_locked(group)

    def _tokenize_rest(self, group: int, decoded: _Decoded) -> None:
        """Queue the rest of ``group``'s rows to be tokenized ahead (once)."""
        with self._lock:
            if 2 * self._decoded_bytes > self.max_decoded_bytes:
                return  # what it made might be dropped before a read used it
            starts = self._queue_tokens_locked(group, decoded)
        self._start_tokenizers(starts)

    def _queue_tokens_locked(self, group: int, decoded: _Decoded) -> list[threading.Thread]:
        """Queue ``group``'s rows to be tokenized ahead (once): the threads to start, up to
        :data:`TOKENIZING_THREADS` taking queued rows."""
        if group in self._tokenizing or decoded.ahead_done:
            return []
        self._tokenizing.add(group)
        self._to_tokenize.append((group, decoded))
        self._tokens_stop = False
        self._lock.notify_all()
        taken = {thread.name for thread in self._tokenizers}
        names = [f"guideloom-parquet-tokens-{i}" for i in range(TOKENIZING_THREADS)]
        starts = [
            threading.Thread(target=self._tokenize_ahead, name=name, daemon=True)
            for name in names
            if name not in taken
        ]
        self._tokenizers.extend(starts)
        return starts

    def _start_tokenizers(self, threads: list[threading.Thread]) -> None:
        if threads:
            _LIVE.add(self)
        for thread in threads:
            thread.start()

    def _next_chunk_locked(self) -> list[_Claim]:
        """The next rows to tokenize ahead, claimed: up to :data:`AHEAD_CHUNK` of them from the
        oldest queued row groups that are still kept, one after another (small row groups
        share a call); empty once there are none (or the storage stops)."""
        chunk: list[_Claim] = []
        wanted = AHEAD_CHUNK
        while self._to_tokenize and not self._tokens_stop and wanted > 0:
            group, decoded = self._to_tokenize[0]
            tokens = decoded.tokens
            assert tokens is not None
            if self._decoded.get(group) is decoded:
                rows, decoded.scan = _claim_locked(decoded, decoded.scan, wanted)
                if rows:
                    chunk.append((group, decoded, rows))
                    wanted -= len(rows)
                if decoded.scan < len(tokens):
                    break  # rows of it are left for the next chunk
                decoded.ahead_done = True
            self._to_tokenize.popleft()  # done, or dropped from the kept row groups
            self._tokenizing.discard(group)
        return chunk

    def _tokenize_ahead(self) -> None:
        """A thread tokenizing ahead: chunks of queued row groups, until none is left and no
        fetcher may queue more (or the storage stops)."""
        me = threading.current_thread()
        while True:
            with self._lock:
                chunk = self._next_chunk_locked()
                while not chunk and not self._tokens_stop and self._fetchers and not self._stopping:
                    self._lock.wait()  # a fetcher queues its next row group
                    chunk = self._next_chunk_locked()
                if not chunk:
                    self._tokenizers.remove(me)
                    if not self._tokenizers:
                        self._to_tokenize.clear()
                        self._tokenizing.clear()
                    return
                self._lock.notify_all()  # a fetcher waiting for room in the queue
            try:
                self._tokenize_chunk(chunk)
            except Exception:  # left to the reads that need these rows: they raise their own error
                failed = {group for group, _, _ in chunk}
                with self._lock:
                    self._tokenizing.difference_update(failed)
                    while self._to_tokenize and self._to_tokenize[0][0] in failed:
                        self._to_tokenize.popleft()

    def _stop_ahead(self, *, join: bool = True) -> None:
        """Stop fetching and tokenizing ahead (a chunk in progress completes) and, with
        ``join``, wait for both."""
        super()._stop_ahead(join=join)
        with self._lock:
            self._tokens_stop = True
            threads = list(self._tokenizers)
            self._lock.notify_all()
        if join:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    async def close(self) -> None:
        """Stop fetching and tokenizing ahead (the loader closes its storage after its last read)."""
        if self._fetchers or self._tokenizers:
            await self._blocking(self._stop_ahead)
