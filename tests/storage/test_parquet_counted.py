"""Packed Parquet text counted block by block as it is read: each row group cut on its own and
the tails cut together last (lossless), the first batch after one window's count (no
whole-corpus pass), each document tokenized once an epoch, a cold run and a warm one alike, the
counts kept in ``cache_dir``, and exact resume with another batch size and world size."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from guideloom._datasets import packed_blocks, packing
from guideloom._errors import DatasetIntegrityError
from guideloom.storage._parquet._tokens import _TokenRows
from tests.storage.test_parquet import make_rows, write_files
from tests.support.loader import loop_gaps

CPU = torch.device("cpu")
LENGTH = 16


def keys(rows: Any) -> list[tuple[int, ...]]:
    """A sequence's documents and tokens: unique per sequence."""
    return [tuple(np.concatenate([r["doc_ids"], r["tokens"]]).tolist()) for r in rows]


@pytest.fixture(params=["row groups", "parts of row groups"])
def parts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Blocks of whole row groups (about 1 KB of text each here), or of runs of rows of each (at
    most 256 bytes of text: 4 or 5 to a row group)."""
    if request.param == "parts of row groups":
        monkeypatch.setattr(packing, "PART_BYTES", 256)
    return str(request.param)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """900 rows in 36 row groups of 25 (3 files)."""
    ids, texts = make_rows(900, seed=7)
    return write_files(tmp_path_factory.mktemp("counted"), ids, texts, files=3, row_group_size=25)


def packed(corpus: Path, tokenizer: str, cache: Path | None, window: int = 4) -> gl.PackedDataset:
    storage = gl.open_parquet(
        corpus, "text", tokenizer=tokenizer, eos="</s>", cache_dir=None if cache is None else str(cache)
    )
    ds = gl.pack(storage, LENGTH)
    ds.count_window = window  # row groups a window of the order holds (the corpus is small)
    return ds


def loader(ds: gl.PackedDataset, batch: int = 4, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    kw.setdefault("shuffle", True)
    return gl.StatefulDataLoader(
        ds, keys, local_batch_size=batch, shuffle_seed=3, device=CPU, drop_last=False, **kw
    )


def epoch(ds: gl.PackedDataset, **kw: Any) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    with loader(ds, **kw) as lo:
        for b in lo:
            out.extend(b)
    return out


def tokenized(ds: gl.PackedDataset) -> int:
    return int(ds.storage.figures()["parquet_tokens_tokenized"])


def test_the_first_batch_waits_for_one_window_and_each_document_is_tokenized_once(
    corpus: Path, tokenizer_json: str, tmp_path: Path, parts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The threads that tokenize ahead of the reads are held until the first batch is in hand:
    # what is tokenized by then is what the first batch waited for, however fast they would be.
    held = threading.Event()
    for name in ("_after_ahead", "_tokenize_ahead"):
        work = getattr(_TokenRows, name)

        def after_first_batch(self: Any, *args: Any, _work: Any = work) -> None:
            assert held.wait(60), "the first batch did not come"
            _work(self, *args)

        monkeypatch.setattr(_TokenRows, name, after_first_batch)
    ds = packed(corpus, tokenizer_json, tmp_path / "cache")
    blocks = len(ds.block_totals())
    assert blocks == 36 if parts == "row groups" else blocks > 3 * 36
    docs = list(
        gl.open_parquet(corpus, "text", tokenizer=tokenizer_json, eos="</s>").read_many_sync(np.arange(900))
    )
    total = sum(len(d) for d in docs)
    with loader(ds) as lo:
        it = iter(lo)
        first = next(it)
        assert not ds._is_counted() and 0 < tokenized(ds) < total / 4  # 4 of 36 row groups, about
        held.set()
        rest = [k for b in it for k in b]
    got = list(first) + rest
    assert ds._is_counted() and len(got) == len(set(got)) == total // LENGTH == len(ds)
    assert tokenized(ds) == total  # each document once over the epoch
    # lossless: every token of the corpus but the tails run's last total % LENGTH, once
    delivered = sorted((d, t) for seq in got for d, t in zip(seq[:LENGTH], seq[LENGTH:], strict=True))
    flat = sorted((i, int(t)) for i, d in enumerate(docs) for t in d)
    assert len(delivered) == total - total % LENGTH
    assert set(delivered) <= set(flat)


def test_blocks_counted_on_threads_at_once_are_each_tokenized_once_and_saved_whole(
    corpus: Path, tokenizer_json: str, tmp_path: Path, parts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window's blocks are counted side by side (parts of one row group among them): the same
    counts as one at a time, each document tokenized once, each row group's lengths saved whole
    in ``cache_dir`` once all its blocks are counted (a warm open then counts nothing)."""
    one_by_one = packed(corpus, tokenizer_json, None)
    want = []
    for b in range(len(one_by_one.block_totals())):
        one_by_one.count_blocks_sync(np.asarray([b]))
        want.append(int(one_by_one.block_totals()[b]))
    monkeypatch.setattr(packed_blocks, "COUNT_THREADS", 8)
    for round_ in range(3):
        cache = tmp_path / f"cache-{round_}"
        ds = packed(corpus, tokenizer_json, cache)
        ds.count_blocks_sync(np.arange(len(ds.block_totals())))
        assert ds.block_totals().tolist() == want
        assert tokenized(ds) == sum(want)  # no row tokenized twice by threads side by side
        saved = sorted(cache.glob("lengths-*/group-*.npy"))
        assert len(saved) == 36
        warm = packed(corpus, tokenizer_json, cache)
        asyncio.run(warm.open())
        assert warm._is_counted() and warm.block_totals().tolist() == want and tokenized(warm) == 0


def test_a_cold_run_and_a_warm_one_deliver_the_same_sequences_in_the_same_order(
    corpus: Path, tokenizer_json: str, tmp_path: Path, parts: str
) -> None:
    cold = packed(corpus, tokenizer_json, tmp_path / "cache")
    a = epoch(cold)
    files = sorted(p.name for p in (tmp_path / "cache").rglob("group-*.npy"))
    assert len(files) == 36  # every row group's counts kept as they were learned
    warm = packed(corpus, tokenizer_json, tmp_path / "cache")
    with loader(warm):
        assert warm._is_counted()  # read back at open, nothing tokenized for them
        assert tokenized(warm) == 0
    assert epoch(warm) == a
    assert epoch(packed(corpus, tokenizer_json, None, window=4)) == a  # no cache: counted again
    assert epoch(packed(corpus, tokenizer_json, None), num_workers=2, parallel_method="thread") == a
    unshuffled = epoch(packed(corpus, tokenizer_json, None), shuffle=False)
    assert sorted(unshuffled) == sorted(a) and unshuffled != a


@pytest.mark.parametrize(("stop", "batch", "world"), [(7, 3, 2), (40, 5, 1), (1, 2, 3)])
def test_a_cold_resume_with_another_geometry_delivers_the_rest_exactly(
    corpus: Path, tokenizer_json: str, tmp_path: Path, stop: int, batch: int, world: int, parts: str
) -> None:
    whole = epoch(packed(corpus, tokenizer_json, None))
    first = packed(corpus, tokenizer_json, tmp_path / "one")
    head: list[tuple[int, ...]] = []
    with loader(first) as lo:
        for i, b in enumerate(lo):
            head.extend(b)
            if i + 1 == stop:
                break
        state = lo.state_dict()
    assert state["dataset"]["kind"].startswith("packed-concat-blocks")
    assert state["dataset"]["observations"] == -1  # not counted yet when saved
    rest: list[list[tuple[int, ...]]] = []
    for rank in range(world):
        ds = packed(corpus, tokenizer_json, tmp_path / f"two-{rank}")  # a fresh process's cold cache
        lo = loader(ds, batch=batch, rank=rank, world_size=world)
        lo.load_state_dict(state)
        with lo:
            rest.append([k for b in lo for k in b])
    # the ranks' batches interleave by global batch: merged, the epoch's order goes on
    merged: list[tuple[int, ...]] = []
    steps = max(len(r) for r in rest)
    for s in range(0, steps, batch):
        for r in rest:
            merged.extend(r[s : s + batch])
    assert head + merged == whole


def test_a_resume_elsewhere_counts_only_what_it_reads_from_the_checkpoints_counts(
    corpus: Path, tokenizer_json: str, parts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint carries the blocks' totals: a fresh process without ``cache_dir`` resumes
    past most of the epoch tokenizing about a window for its first batch, not every window
    before its offset, and delivers the rest exactly. (Tokenizing ahead, on its own thread,
    is left out: what is counted is what the first batch needs.)"""
    monkeypatch.setattr(gl.ParquetStorage, "_ahead_threads", lambda self: 0)
    whole = epoch(packed(corpus, tokenizer_json, None))
    head: list[tuple[int, ...]] = []
    with loader(packed(corpus, tokenizer_json, None)) as lo:
        for i, b in enumerate(lo):
            head.extend(b)
            if i + 1 == 150:  # of some 250
                break
        state = lo.state_dict()
    assert isinstance(state["counts"], str)
    fresh = packed(corpus, tokenizer_json, None)
    with loader(fresh, batch=5) as lo:
        lo.load_state_dict(state)
        it = iter(lo)
        first = next(it)
        assert tokenized(fresh) < len(whole) * LENGTH / 3  # a window or two; without counts 2/3
        rest = list(first) + [k for b in it for k in b]
    assert head + rest == whole


def test_a_checkpoints_counts_that_are_damaged_or_disagree_are_refused(
    corpus: Path, tokenizer_json: str
) -> None:
    with loader(packed(corpus, tokenizer_json, None)) as lo:
        for i, _ in enumerate(lo):
            if i == 20:
                break
        state = lo.state_dict()
    version, digest, body = state["counts"].split(":")
    for bad in (f"{version}:{digest}:{body[:-8]}AAAAAAAA", "garbage", f"{version}:{'0' * 16}:{body}"):
        with pytest.raises(ValueError, match="counts are"):
            loader(packed(corpus, tokenizer_json, None)).load_state_dict({**state, "counts": bad})
    # counts that pass the digest but not the documents: refused when the block is counted
    totals = np.frombuffer(zlib.decompress(base64.b64decode(body)), "<i8").copy()
    b = int(np.flatnonzero(totals >= 0)[0])
    totals[b] += 1
    raw = totals.tobytes()
    forged = ":".join(
        ["1", hashlib.sha256(raw).hexdigest()[:16], base64.b64encode(zlib.compress(raw)).decode()]
    )
    ds = packed(corpus, tokenizer_json, None)
    lo = loader(ds)
    lo.load_state_dict({**state, "counts": forged, "observation_offset": 0})
    with pytest.raises(DatasetIntegrityError, match="the checkpoint's counts say"):
        ds.count_blocks_sync(np.asarray([b]))


def test_len_explain_and_a_mixture(corpus: Path, tokenizer_json: str, tmp_path: Path) -> None:
    ds = packed(corpus, tokenizer_json, tmp_path / "cache")
    with loader(ds) as lo:
        it = iter(lo)
        batches = [next(it), next(it)]
        [record] = [r for r in lo.explain(step=1) if r["position"] == 5]
        assert not ds._is_counted()  # explaining a counted step counts nothing more
        pieces = [tuple(p) for p in record["documents"]]
        row = batches[1][1]
        docs = row[:LENGTH]
        assert sorted({d for d, _, _ in pieces}) == sorted(set(docs))
        assert sum(b - a for _, a, b in pieces) == LENGTH
        assert all(f[0][1].startswith("row group") for f in record["files"])
        assert len(lo) == -(-len(ds) // 4)  # counts the rest (blocking)
        assert ds._is_counted()
        rest = [k for b in it for k in b]
    assert len(batches[0]) + len(batches[1]) + len(rest) == len(ds)
    audited = packed(corpus, tokenizer_json, None)
    with loader(audited, track_deliveries=True) as lo:
        it = iter(lo)
        for _ in range(7):
            next(it)
        report = lo.audit()  # mid-epoch: counts the rest, then checks the positions handed out
        assert report.ok and report.delivered == report.expected == 28, report
    mixture = gl.mix(
        {"a": packed(corpus, tokenizer_json, None), "b": packed(corpus, tokenizer_json, None)}, num_samples=50
    )
    with gl.StatefulDataLoader(mixture, keys, local_batch_size=5, shuffle=True, device=CPU) as lo:
        seqs = [k for b in lo for k in b]
    assert len(seqs) == 50 and all(len(s) == 2 * LENGTH for s in seqs)


def test_a_document_that_does_not_tokenize_as_counted_is_refused(
    corpus: Path, tokenizer_json: str, tmp_path: Path
) -> None:
    ds = packed(corpus, tokenizer_json, tmp_path / "cache")
    epoch(ds)  # counted and kept in cache_dir
    storage = ds.storage
    for part in (tmp_path / "cache").rglob("group-*.npy"):  # every count one token short, re-signed
        lengths = np.load(part) - 1
        buf = io.BytesIO()
        np.save(buf, np.maximum(lengths, 0).astype(np.int32), allow_pickle=False)
        data = buf.getvalue()
        part.unlink()
        part.with_name(
            f"group-{part.stem.split('-')[1]}-{hashlib.sha256(data).hexdigest()[:32]}.npy"
        ).write_bytes(data)
    assert storage is not None
    with pytest.raises(DatasetIntegrityError, match="do not tokenize as when"):
        epoch(packed(corpus, tokenizer_json, tmp_path / "cache"))


def words(text: str) -> list[int]:
    return [len(w) for w in text.split()]


def slow_words(text: str) -> list[int]:
    """:func:`words`, taking its time (4 ms a text): a count of a window lasts 0.4 s."""
    time.sleep(0.004)
    return words(text)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_async_iteration_counts_off_the_event_loop(corpus: Path) -> None:
    """``async for`` delivers what ``for`` does, and the counts (tokenizing a window of row
    groups) run off the loop: its ticks go on while a window is counted."""
    want = epoch(packed_with(corpus, words))
    ds = packed_with(corpus, slow_words)
    got: list[tuple[int, ...]] = []
    async with loop_gaps() as gaps, loader(ds) as lo:
        async for batch in lo:
            got.extend(batch)
    assert got == want
    assert len(gaps) >= 20, f"only {len(gaps)} ticks: the load was too short to tell"
    assert max(gaps) < 0.25, f"the loop stalled for {max(gaps):.3f}s (a window's count takes ~0.4 s)"


@pytest.mark.slow
def test_process_workers_make_the_batches_read_where_they_are_counted(
    corpus: Path, tokenizer_json: str
) -> None:
    want = epoch(packed(corpus, tokenizer_json, None))
    got = epoch(packed(corpus, tokenizer_json, None), num_workers=2, parallel_method="process")
    assert got == want


def packed_with(corpus: Path, tokenizer: Any) -> gl.PackedDataset:
    ds = gl.pack(gl.open_parquet(corpus, "text", tokenizer=tokenizer), LENGTH)
    ds.count_window = 4
    return ds


def test_an_epoch_shorter_than_a_batch_is_refused_at_open_as_when_counted(
    corpus: Path, tokenizer_json: str
) -> None:
    """The size check at open counts the epoch's first windows until they hold a global batch
    (what the first batch reads anyway): an epoch with fewer sequences than a global batch is
    refused at open, cold as warm, with or without ``drop_last``."""
    n = len(gl.pack(gl.open_parquet(corpus, "text", tokenizer=tokenizer_json, eos="</s>"), LENGTH))
    for drop_last in (True, False):
        lo = gl.StatefulDataLoader(
            packed(corpus, tokenizer_json, None),
            keys,
            local_batch_size=n + 5,
            device=CPU,
            drop_last=drop_last,
        )
        with pytest.raises(
            ValueError, match=f"the dataset has {n} observations, fewer than one global batch"
        ):
            lo.open()


def test_tokens_kept_narrow_are_delivered_as_kept_at_the_storages_dtype(
    corpus: Path, tokenizer_json: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The storage keeps a 300-id vocabulary's tokens as uint16 and delivers the documented
    uint32: the same sequences, and the same batches after a resume, as tokens kept at uint32."""
    from guideloom.storage._text import TextEncoder

    narrow = packed(corpus, tokenizer_json, None)
    with gl.StatefulDataLoader(narrow, list, local_batch_size=4, device=CPU) as lo:
        first = next(iter(lo))
        assert narrow.storage.dtype == np.uint32 and first[0]["tokens"].dtype == np.uint32
        kept = [t for d in narrow.storage._decoded.values() for t in (d.tokens or []) if t is not None]
        assert kept and {t.dtype for t in kept} == {np.dtype(np.uint16)}
    got = epoch(packed(corpus, tokenizer_json, None))
    with loader(packed(corpus, tokenizer_json, None)) as lo:
        it = iter(lo)
        for _ in range(5):
            next(it)
        state = lo.state_dict()
    with loader(packed(corpus, tokenizer_json, None)) as lo:
        lo.load_state_dict(state)
        rest = [s for b in lo for s in b]
    monkeypatch.setattr(TextEncoder, "_narrowest", lambda self, vocab, *ids: self.dtype)
    wide = packed(corpus, tokenizer_json, None)
    assert wide.storage._encoder.kept_dtype == np.uint32  # type: ignore[attr-defined]
    assert epoch(wide) == got and got[-len(rest) :] == rest


def held_tokens(ds: gl.PackedDataset) -> list[int]:
    """The lengths of the token arrays the packing's storage keeps now."""
    storage = ds.storage
    assert isinstance(storage, gl.ParquetStorage)
    return [len(t) for d in storage._decoded.values() for t in (d.tokens or []) if t is not None]


def test_an_epoch_lets_go_of_each_documents_tokens_once_its_sequences_are_read(
    corpus: Path, tokenizer_json: str, parts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block read whole has its documents' tokens let go, but those of its tail, which go
    after the tails run: an epoch ends holding no more than the documents of the tails run's
    last, partial sequence (never read), each document tokenized once, and the next epoch makes
    them again and delivers what an epoch that kept them delivers."""
    ds = packed(corpus, tokenizer_json, None)
    with loader(ds) as lo:
        first = [s for b in lo for s in b]
        made, held = tokenized(ds), held_tokens(ds)
        delivered = sum(len(k) // 2 for k in first)
        assert made <= 1.05 * delivered
        assert sum(held) < LENGTH + max(held, default=0)  # the last partial sequence's documents
        second = [s for b in lo for s in b]
        assert tokenized(ds) >= made + 0.95 * delivered  # made again
    monkeypatch.setattr(gl.ParquetStorage, "let_go", lambda self, indices: None)
    kept = packed(corpus, tokenizer_json, None)
    with loader(kept) as lo:
        assert [s for b in lo for s in b] == first
        assert sum(held_tokens(kept)) >= delivered  # every document's tokens, kept
        assert [s for b in lo for s in b] == second
        assert tokenized(kept) == made  # the second epoch tokenizes nothing
