"""A text row group's rows tokenized once each: by the read that needs them, or ahead of it.

A read of a text column's rows as tokens (packing, a mixture) tokenizes the rows it needs that
are not tokenized yet, and the row group keeps their tokens. Once a read has touched a row
group, a thread of the storage's own tokenizes the group's other rows, a chunk at a time, while
the reads go on: the tokenizer's calls are larger (the ``tokenizers`` library spreads a batch over
every core) and overlap the reads' own Python work instead of waiting for it. Each row is claimed
by whichever thread gets to it first, and a read that needs a row another thread is tokenizing
waits for it, so no row is tokenized twice; a chunk that fails is left to the read that needs it,
which raises its own error. Only row groups that are kept are tokenized ahead, and only while
the kept row groups fill less than half of ``max_decoded_bytes`` (beyond, what it made might be
dropped before a read used it).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from guideloom._process import release_malloc
from guideloom.storage._parquet._decode import _ROW_OVERHEAD, I64, _Decoded
from guideloom.storage._parquet._rowgroups import _LIVE, RELEASE_EVERY_BYTES, _RowGroups

__all__ = ["AHEAD_CHUNK", "TOKENIZE_BYTES", "TOKENIZING_FETCHERS"]

#: Rows a thread tokenizing ahead claims and tokenizes at a time: large enough for the tokenizer
#: to spread over the cores and for one long document not to leave them idle at the end of a
#: call (calls of 64 rows of prose tokenized about a tenth slower), small enough that a read
#: needing one of them waits briefly.
AHEAD_CHUNK = 256
#: Threads fetching ahead over an object store where a text column is tokenized as it is read
#: (``fetch_ahead`` caps it): a row group's fetch takes a fraction of its tokenizing, and 8 of
#: them (the default elsewhere) held 30-50 MiB more at the peak for the same rate.
TOKENIZING_FETCHERS = 2
#: Bytes of text tokenized in one call at most: a ``tokenizers`` batch holds several times its
#: text's bytes while it runs (an encoding per text, with its tokens' strings and offsets), and a
#: whole row group's rows in one call (a read of all of them: the length index's) would hold
#: hundreds of MiB at once.
TOKENIZE_BYTES = 2**20


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


def _let_text_go(decoded: _Decoded) -> int:
    """Once every row of a row group is tokenized, its text is read no more (a storage that
    tokenizes reads tokens; a read of its texts is another storage's, with its own row groups):
    let it go. The bytes freed (under the storage's lock)."""
    tokens = decoded.tokens
    if decoded.values is None or tokens is None or any(t is None for t in tokens):
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
        if tokens[at] is None and at not in decoded.claimed:
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
        self._tokenizer_thread: threading.Thread | None = None
        self._tokens_stop = False
        #: Held by the thread working ahead that tokenizes (over an object store several fetch).
        self._one_tokenizing = threading.Lock()
        self._since_trim = 0  # text bytes tokenized since the C heap last gave back its free pages

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        keys = ("_to_tokenize", "_tokenizing", "_tokenizer_thread", "_tokens_stop", "_one_tokenizing")
        for key in (*keys, "_since_trim"):
            state.pop(key, None)
        return state

    def _tokenizes_ahead(self) -> bool:
        return self.tokenize_ahead and self._kind == "text" and self._encoder is not None and self._tokenize

    def _ahead_threads(self) -> int:
        """Where a text column is tokenized as it is read, local files too: threads that decode
        the row groups of the loader's upcoming reads and tokenize them, in order of first need.
        One over local files, at most :data:`TOKENIZING_FETCHERS` over an object store: the
        tokenizer (which spreads each call over the cores) is the bound, and more fetchers
        only hold more fetched and decoded row groups waiting for it."""
        if not self._tokenizes_ahead():
            return super()._ahead_threads()
        return max(1, min(super()._ahead_threads(), TOKENIZING_FETCHERS))

    def _after_ahead(self, group: int, decoded: _Decoded) -> None:
        """A row group decoded ahead of its reads: its rows tokenized too, a chunk at a time
        (a read that needs rows of it meanwhile claims those itself)."""
        if not self._tokenizes_ahead() or decoded.tokens is None:
            return
        with self._one_tokenizing:  # the others go on fetching: the tokenizer has the cores
            self._tokenize_group(group, decoded)

    def _tokenize_group(self, group: int, decoded: _Decoded) -> None:
        assert decoded.tokens is not None
        at = 0
        while not self._stopping:
            with self._lock:
                if self._decoded.get(group) is not decoded:
                    return  # dropped before it was read: what it would make would go with it
                rows, at = _claim_locked(decoded, at)
                if not rows:
                    return
            try:
                self._tokenize_claimed(group, decoded, rows)
            except Exception:  # left to the read that needs these rows: it raises its own error
                return

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
                if not missing:
                    break
                mine = [i for i in missing if i not in decoded.claimed]
                if not mine:  # all being tokenized by another thread: wait for it
                    self._lock.wait()
                    continue
                decoded.claimed.update(mine)
            self._tokenize_claimed(group, decoded, mine)
        if self.tokenize_ahead and ahead:
            self._tokenize_rest(group, decoded)
        return [tokens[i] for i in wanted]

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
        kept = self._encoder.encode_kept(texts)
        with self._lock:
            for (group, decoded, rows), (flat, offsets) in zip(call, kept, strict=True):
                tokens = decoded.tokens
                assert tokens is not None
                bounds = offsets.tolist()
                for k, i in enumerate(rows):  # each row a view of its row group's part of the call
                    tokens[i] = flat[bounds[k] : bounds[k + 1]]
                made = len(flat)
                added = int(flat.nbytes) + _ROW_OVERHEAD * len(rows)
                self.counts["parquet_tokens_tokenized"] += made
                freed = _let_text_go(decoded)
                self._since_trim += freed  # given back to the system at the next trim
                added -= freed
                decoded.nbytes += added
                if self._decoded.get(group) is decoded:
                    self._decoded_bytes += added
                    self._evict_locked(group, keep_new=True)
            self._lock.notify_all()
        return sum(len(t) for part in texts for t in part)

    def _tokenize_rest(self, group: int, decoded: _Decoded) -> None:
        """Queue the rest of ``group``'s rows to be tokenized ahead (once), starting the thread
        that does it if none runs."""
        with self._lock:
            if group in self._tokenizing or decoded.ahead_done:
                return
            if 2 * self._decoded_bytes > self.max_decoded_bytes:
                return  # what it made might be dropped before a read used it
            self._tokenizing.add(group)
            self._to_tokenize.append((group, decoded))
            thread = self._tokenizer_thread
            if thread is not None and thread.is_alive():
                return
            self._tokens_stop = False
            thread = self._tokenizer_thread = threading.Thread(
                target=self._tokenize_ahead, name="guideloom-parquet-tokens", daemon=True
            )
        _LIVE.add(self)
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
        """The thread tokenizing ahead: chunks of queued row groups until none is left."""
        while True:
            with self._lock:
                chunk = self._next_chunk_locked()
                if not chunk:
                    self._to_tokenize.clear()
                    self._tokenizing.clear()
                    if self._tokenizer_thread is threading.current_thread():
                        self._tokenizer_thread = None
                    return
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
            thread = self._tokenizer_thread
            self._lock.notify_all()
        if join and thread is not None and thread is not threading.current_thread():
            thread.join()

    async def close(self) -> None:
        """Stop fetching and tokenizing ahead (the loader closes its storage after its last read)."""
        if self._fetchers or self._tokenizer_thread is not None:
            await self._blocking(self._stop_ahead)
