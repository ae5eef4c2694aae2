"""A text row group's rows tokenized once each, by the read that needs them or by the threads
that tokenize ahead of the reads (``guideloom/storage/_parquet/_tokens.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import guideloom as gl
from guideloom._datasets.packing import PackMode

ROWS = 300


def slow_words(text: str) -> list[int]:
    """A tokenizer callable slow enough (about 0.2 ms a text) for reads to meet the thread
    that tokenizes ahead: one id per word, its length."""
    time.sleep(0.0002)
    return [len(w) for w in text.split()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokens")
    texts = [" ".join(["w" * (1 + (i + k) % 7) for k in range(1 + i % 11)]) for i in range(ROWS)]
    pq.write_table(pa.table({"text": texts}), out / "a.parquet", row_group_size=100)
    return out


def expected(folder: Path, rows: Sequence[int]) -> list[list[int]]:
    texts = pq.read_table(folder / "a.parquet").column("text").to_pylist()
    return [slow_words(texts[i]) for i in rows]


def test_reads_beside_the_thread_tokenizing_ahead_get_each_row_tokenized_once(folder: Path) -> None:
    storage = gl.open_parquet(folder, "text", tokenizer=slow_words)
    rng = np.random.default_rng(0)
    order = rng.permutation(ROWS)
    got: dict[int, list[int]] = {}
    for chunk in np.array_split(order, 60):  # reads of a few rows each, every row group touched
        for i, row in zip(chunk.tolist(), storage.read_many_sync(chunk), strict=True):
            got[i] = row.tolist()
    assert [got[i] for i in range(ROWS)] == expected(folder, range(ROWS))
    storage._stop_ahead()
    total = sum(len(t) for t in expected(folder, range(ROWS)))
    assert storage.counts["parquet_tokens_tokenized"] == total  # none twice, none left out


def test_a_read_waits_for_rows_the_thread_is_tokenizing_and_does_not_tokenize_them_again(
    folder: Path,
) -> None:
    calls: list[str] = []
    lock = threading.Lock()

    def counted(text: str) -> list[int]:
        with lock:
            calls.append(text)
        return slow_words(text)

    storage = gl.open_parquet(folder, "text", tokenizer=counted)
    storage.read_many_sync(np.asarray([0]))  # touches row group 0: the rest goes to the thread
    rows = np.arange(100)
    assert [r.tolist() for r in storage.read_many_sync(rows)] == expected(folder, rows.tolist())
    storage._stop_ahead()
    assert len(calls) == 100  # each of the row group's rows once, whoever tokenized it


def test_a_row_that_fails_to_tokenize_ahead_fails_the_read_that_needs_it(folder: Path) -> None:
    texts = pq.read_table(folder / "a.parquet").column("text").to_pylist()
    bad = texts[57]

    def fails_on_one(text: str) -> list[int]:
        if text == bad:
            raise RuntimeError("this tokenizer cannot encode that text")
        return slow_words(text)

    storage = gl.open_parquet(folder, "text", tokenizer=fails_on_one)
    good = [i for i in range(100) if texts[i] != bad]
    assert [r.tolist() for r in storage.read_many_sync(np.asarray(good))] == expected(folder, good)
    with pytest.raises(RuntimeError, match="cannot encode that text") as raised:
        storage.read_many_sync(np.asarray([57]))
    # the tokenizer's own error, with a note naming where its text comes from
    assert raised.value.__notes__ == [
        f"raised tokenizing {folder / 'a.parquet'}: row group 0, column 'text', row 57 of the row group"
    ]
    storage._stop_ahead()


def test_closing_the_storage_stops_the_thread_tokenizing_ahead(folder: Path) -> None:
    storage = gl.open_parquet(folder, "text", tokenizer=slow_words)
    storage.read_many_sync(np.asarray([0, 100, 200]))
    storage._stop_ahead()
    assert not any(t.is_alive() for t in storage._tokenizers)


def test_the_loaders_hint_decodes_and_tokenizes_local_row_groups_ahead_of_the_reads(folder: Path) -> None:
    storage = gl.open_parquet(folder, "text", tokenizer=slow_words)
    storage.will_read(iter([np.arange(100, 110), np.arange(250, 260)]))  # row groups 1 and 2
    for thread in list(storage._fetchers):
        thread.join(timeout=60)
    texts = expected(folder, range(100, 300))
    assert storage.counts["parquet_tokens_tokenized"] == sum(len(t) for t in texts)
    rows = np.arange(100, 300)
    assert [r.tolist() for r in storage.read_many_sync(rows)] == texts
    assert storage.counts["parquet_tokens_tokenized"] == sum(len(t) for t in texts)  # none again
    storage._stop_ahead()


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_a_packed_hint_names_every_document_its_sequences_hold(folder: Path, mode: PackMode) -> None:
    packed = gl.pack(gl.open_parquet(folder, "text", tokenizer=slow_words), 8, mode)
    len(packed)  # the layout
    seqs = np.asarray([0, 3, 7, len(packed) - 1])
    named = set(packed._documents_of(seqs).tolist())
    for s in seqs.tolist():
        held = {doc for doc, _, size in packed.describe(s)["documents"] if size > 0}
        assert held <= named


def test_a_read_of_a_whole_row_group_tokenizes_it_in_calls_of_bounded_text(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The length index reads every row of a row group at once: its text goes to the tokenizer
    in calls of at most ``TOKENIZE_BYTES`` (a batch holds several times its text while it runs),
    and the lengths are those of one call per row."""
    from guideloom.storage._parquet import _tokens
    from guideloom.storage._text import TextEncoder

    monkeypatch.setattr(_tokens, "TOKENIZE_BYTES", 300)
    calls: list[int] = []
    encode = TextEncoder.encode_kept

    def spy(self: TextEncoder, groups: Sequence[Sequence[str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        calls.append(sum(len(t.encode()) for texts in groups for t in texts))
        return encode(self, groups)

    monkeypatch.setattr(TextEncoder, "encode_kept", spy)
    storage = gl.open_parquet(folder, "text", tokenizer=slow_words)
    storage.tokenize_ahead = False
    offsets = storage.build_length_index()
    assert np.diff(offsets).tolist() == [len(t) for t in expected(folder, range(ROWS))]
    assert len(calls) > 3 and max(calls) <= 300  # no text here is longer than the bound
    assert sum(calls) == sum(len(t.encode()) for t in pq.read_table(folder / "a.parquet")["text"].to_pylist())


def test_the_thread_tokenizing_ahead_puts_small_row_groups_into_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row groups smaller than ``AHEAD_CHUNK`` rows share the thread's tokenizer calls (a call
    of a few rows leaves the tokenizer's threads waiting on its longest text), each row still
    tokenized once, into its own row group's tokens."""
    from guideloom.storage._parquet import _tokens
    from guideloom.storage._text import TextEncoder

    texts = [" ".join(["w" * (1 + (i + k) % 7) for k in range(1 + i % 11)]) for i in range(ROWS)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet", row_group_size=10)
    sizes: list[int] = []
    encode = TextEncoder.encode_kept

    def spy(self: TextEncoder, groups: Sequence[Sequence[str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        if threading.current_thread().name.startswith("guideloom-parquet-tokens"):
            sizes.append(sum(map(len, groups)))
        return encode(self, groups)

    monkeypatch.setattr(TextEncoder, "encode_kept", spy)
    storage = gl.open_parquet(tmp_path, "text", tokenizer=slow_words)
    firsts = np.arange(0, ROWS, 10)  # a row of each row group: the rest is tokenized ahead
    assert [r.tolist() for r in storage.read_many_sync(firsts)] == [slow_words(texts[i]) for i in firsts]
    for thread in list(storage._tokenizers):
        thread.join(timeout=60)
    rows = np.arange(ROWS)
    assert [r.tolist() for r in storage.read_many_sync(rows)] == [slow_words(t) for t in texts]
    total = sum(len(slow_words(t)) for t in texts)
    assert storage.counts["parquet_tokens_tokenized"] == total  # none twice, none left out
    assert sizes and max(sizes) > 10 and max(sizes) <= _tokens.AHEAD_CHUNK  # calls span row groups
    storage._stop_ahead()


def test_the_loaders_hint_keeps_two_tokenizer_calls_in_flight_and_the_text_decoded_ahead_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetcher decodes and queues row groups; the threads tokenizing ahead make
    ``TOKENIZING_THREADS`` calls at once (one call's idle cores are the other's), and the
    fetcher waits while the queue holds a chunk's rows for each of them."""
    from guideloom.storage._parquet import _tokens
    from guideloom.storage._text import TextEncoder

    monkeypatch.setattr(_tokens, "AHEAD_CHUNK", 30)
    texts = [" ".join(["w" * (1 + (i + k) % 7) for k in range(1 + i % 11)]) for i in range(1000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet", row_group_size=20)
    storage = gl.open_parquet(tmp_path, "text", tokenizer=slow_words)
    encode = TextEncoder.encode_kept
    lock = threading.Lock()
    now, most, waiting = [0], [0], [0]

    def spy(self: TextEncoder, groups: Sequence[Sequence[str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        with storage._lock:  # rows decoded and not yet tokenized or being tokenized
            undone = sum(
                sum(t is None for t in d.tokens or ()) - len(d.claimed) for d in storage._decoded.values()
            )
        with lock:
            now[0] += 1
            most[0], waiting[0] = max(most[0], now[0]), max(waiting[0], undone)
        try:
            time.sleep(0.002)  # a call long enough for the other thread's to meet it
            return encode(self, groups)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(TextEncoder, "encode_kept", spy)
    storage.will_read(iter([np.arange(1000)]))
    for thread in list(storage._fetchers):
        thread.join(timeout=60)
    for thread in list(storage._tokenizers):
        thread.join(timeout=60)
    assert storage.counts["parquet_tokens_tokenized"] == sum(len(slow_words(t)) for t in texts)
    assert most[0] == _tokens.TOKENIZING_THREADS
    assert waiting[0] <= _tokens.TOKENIZING_THREADS * 30 + 20  # one row group over the bound
    rows = np.arange(1000)
    assert [r.tolist() for r in storage.read_many_sync(rows)] == [slow_words(t) for t in texts]
    assert storage.counts["parquet_tokens_tokenized"] == sum(len(slow_words(t)) for t in texts)
    storage._stop_ahead()


def kept_rows(storage: gl.ParquetStorage) -> dict[int, int]:
    """Rows whose tokens the storage keeps now, per row group."""
    return {g: sum(t is not None for t in d.tokens or []) for g, d in storage._decoded.items()}


def test_tokens_let_go_are_dropped_and_made_again_for_a_later_read(folder: Path) -> None:
    """``let_go`` drops the rows' tokens (the row group's other tokens stay, copied together) and
    counts them out of the kept bytes; the thread tokenizing ahead leaves them; a later read gets
    the same tokens again, its row group's text decoded again where it was let go."""
    storage = gl.open_parquet(folder, "text", tokenizer=slow_words)
    storage.tokenize_ahead = False
    rows = np.arange(ROWS)
    want = expected(folder, rows.tolist())
    assert [r.tolist() for r in storage.read_many_sync(rows)] == want
    assert all(d.values is None for d in storage._decoded.values())  # every row tokenized: text gone
    held, decodes = storage._decoded_bytes, storage.counts["parquet_row_group_decodes"]
    storage.let_go(np.arange(100, 150))  # half of row group 1
    storage.let_go(np.arange(200, 300))  # all of row group 2: dropped whole
    assert kept_rows(storage) == {0: 100, 1: 50}
    assert storage._decoded_bytes < held
    assert storage._decoded_bytes == sum(d.nbytes for d in storage._decoded.values())
    assert [r.tolist() for r in storage.read_many_sync(np.arange(150, 200))] == want[150:200]
    assert storage.counts["parquet_row_group_decodes"] == decodes  # kept rows: nothing made again
    tokenized = storage.counts["parquet_tokens_tokenized"]
    assert [r.tolist() for r in storage.read_many_sync(rows)] == want
    assert storage.counts["parquet_row_group_decodes"] == decodes + 2  # text of groups 1 and 2 again
    again = sum(len(t) for t in want[100:150] + want[200:300])
    assert storage.counts["parquet_tokens_tokenized"] == tokenized + again


def test_the_thread_tokenizing_ahead_leaves_rows_let_go_until_a_new_hint(folder: Path) -> None:
    """Rows let go before the thread tokenizing ahead reached them are not tokenized by it (no
    read of the epoch needs them); the next hint (an epoch's) makes them worth tokenizing."""
    storage = gl.open_parquet(folder, "text", tokenizer=slow_words)
    storage.tokenize_ahead = False
    storage.read_many_sync(np.arange(0, 10))  # row group 0 decoded, 10 rows tokenized
    storage.let_go(np.arange(0, 60))
    storage.tokenize_ahead = True
    decoded = storage._decoded[0]
    tokenize_ahead(storage, 0)
    assert decoded.tokens is not None
    assert [t is None for t in decoded.tokens] == [True] * 60 + [False] * 40
    storage.will_read(iter([]))  # a new hint (of no read)
    for thread in list(storage._fetchers):
        thread.join(timeout=60)
    tokenize_ahead(storage, 0)
    assert all(t is not None for t in decoded.tokens)


def tokenize_ahead(storage: gl.ParquetStorage, group: int) -> None:
    """What a fetcher does with a row group it decoded: queue it for the threads that tokenize
    ahead; here they are waited for (with no fetcher left, they end once the queue is empty)."""
    with storage._lock:
        threads = storage._queue_tokens_locked(group, storage._decoded[group])
    storage._start_tokenizers(threads)
    for thread in threads:
        thread.join(timeout=60)


def words(text: str) -> list[int]:
    return [len(w) for w in text.split()]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 texts of 40 words in 8 row groups of 50 (some 10 KB of text each)."""
    out = tmp_path_factory.mktemp("wide")
    texts = [" ".join(["w" * (1 + (i + k) % 7) for k in range(40)]) for i in range(400)]
    pq.write_table(pa.table({"text": texts}), out / "a.parquet", row_group_size=50)
    return out


def packed_epoch(folder: Path, **options: int) -> dict[str, float]:
    storage = gl.open_parquet(folder, "text", tokenizer=words, **options)
    loader = gl.StatefulDataLoader(
        gl.pack(storage, 64), len, local_batch_size=4, shuffle=True, shuffle_seed=1, drop_last=False
    )
    with loader:
        assert sum(loader) == len(loader.dataset)
        return loader.stats()


def test_a_bound_below_a_window_s_row_groups_warns_that_tokens_are_made_again(wide: Path) -> None:
    """A ``max_decoded_bytes`` below one row group's text drops row groups whose tokens reads
    still need, which are then decoded and tokenized again: the epoch is right, many times
    slower, and a warning says which option to raise (once)."""
    with pytest.warns(RuntimeWarning, match=r"made again.*max_decoded_bytes=4096") as caught:
        stats = packed_epoch(wide, max_decoded_bytes=4096)
    assert len([w for w in caught if "made again" in str(w.message)]) == 1
    assert stats["parquet_tokens_tokenized_again"] > 0.05 * stats["parquet_tokens_tokenized"]


def test_a_bound_that_holds_a_window_makes_no_token_again(wide: Path) -> None:
    stats = packed_epoch(wide)  # a warning would fail the test (warnings are errors)
    assert stats["parquet_tokens_tokenized_again"] == 0
    assert stats["parquet_tokens_tokenized"] == 400 * 40
