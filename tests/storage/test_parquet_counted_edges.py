"""Edges of packed Parquet text counted as it is read: what a checkpoint, ``cache_dir`` and the
loader's size check must agree on whatever was counted when. Each test here states the promise
(a cold run and a warm one alike, a resume exact or refused, counts in ``cache_dir`` that are
wrong refused or counted again, never delivered) on a case where it does not hold yet."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import guideloom as gl
from guideloom._errors import DatasetIntegrityError
from tests.storage.test_parquet import make_rows, write_files

CPU = torch.device("cpu")
LENGTH = 16


def keys(rows: Any) -> list[tuple[int, ...]]:
    """A sequence's tokens and documents."""
    return [tuple(np.concatenate([r["tokens"], r["doc_ids"]]).tolist()) for r in rows]


def words(text: str) -> list[int]:
    """One token per word: its length and its place in the text (a text's tokens differ)."""
    return [100 * i + len(w) for i, w in enumerate(text.split())]


#: How :func:`edited` tokenizes: a user's function edited between two runs (same name, same key).
EDIT = {"skip hashes": True}


def edited(text: str) -> list[int]:
    """:func:`words`; while ``EDIT["skip hashes"]``, a text that starts with ``#`` makes nothing."""
    return [] if EDIT["skip hashes"] and text.startswith("#") else words(text)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 rows in 24 row groups of 25 (2 files)."""
    ids, texts = make_rows(600, seed=11)
    return write_files(tmp_path_factory.mktemp("edges"), ids, texts, files=2, row_group_size=25)


def packed(
    folder: Path,
    cache: Path | None = None,
    window: int = 3,
    tokenizer: Any = words,
    eos: str | None = None,
    key: str = "words-v1",
) -> gl.PackedDataset:
    storage = gl.open_parquet(
        folder,
        "text",
        tokenizer=tokenizer,
        tokenizer_key=key,
        eos=eos,
        cache_dir=None if cache is None else str(cache),
    )
    ds = gl.pack(storage, LENGTH)
    ds.count_window = window
    return ds


def loader(ds: gl.PackedDataset, batch: int = 4, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    kw.setdefault("shuffle", True)
    kw.setdefault("drop_last", False)
    return gl.StatefulDataLoader(ds, keys, local_batch_size=batch, shuffle_seed=5, device=CPU, **kw)


def epoch(ds: gl.PackedDataset, **kw: Any) -> list[tuple[int, ...]]:
    with loader(ds, **kw) as lo:
        return [k for b in lo for k in b]


def test_a_resume_with_another_count_window_is_exact_or_refused(corpus: Path) -> None:
    """``count_window`` makes the order (docs: "may be set before the loader plans its epoch"):
    a checkpoint saved under one window and loaded under another must resume exactly or be
    refused, never repeat some sequences and skip as many others."""
    whole = epoch(packed(corpus, window=3))
    head: list[tuple[int, ...]] = []
    with loader(packed(corpus, window=3)) as lo:
        for i, b in enumerate(lo):
            head.extend(b)
            if i + 1 == 30:
                break
        state = lo.state_dict()
    resumed = loader(packed(corpus, window=5))
    try:
        resumed.load_state_dict(state)
    except ValueError:
        return  # refused: the promise holds
    with resumed:
        rest = [k for b in resumed for k in b]
    assert len(set(head) & set(rest)) == 0, "sequences delivered twice"
    assert head + rest == whole


def resign(part: Path, lengths: npt.ArrayLike) -> None:
    """Replace a saved row group's counts by ``lengths``, named by their digest as the loader
    names them (a damaged file that still passes the digest check)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(lengths, dtype=np.int32), allow_pickle=False)
    data = buf.getvalue()
    part.unlink()
    group = part.stem.split("-")[1]
    part.with_name(f"group-{group}-{hashlib.sha256(data).hexdigest()[:32]}.npy").write_bytes(data)


def test_a_saved_count_of_zero_never_drops_a_document(corpus: Path, tmp_path: Path) -> None:
    """Counts in ``cache_dir`` that do not match the documents are refused or counted again,
    never delivered (the reads check every document read against its count; a document
    counted as empty is not read, so nothing checks it)."""
    cache = tmp_path / "cache"
    want = epoch(packed(corpus, cache))
    [part] = sorted(cache.rglob("group-2-*.npy"))
    lengths = np.load(part)
    assert lengths[7] > 0
    lengths[7] = 0  # one document's count damaged to zero
    resign(part, lengths)
    try:
        got = epoch(packed(corpus, cache))
    except DatasetIntegrityError:
        return  # refused: the promise holds
    assert sorted(got) == sorted(want), "a document was dropped (or its tokens moved) silently"


def test_a_tokenizer_changed_under_its_key_never_drops_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The case the refusal names ("a tokenizer changed under the same tokenizer_key"): counts
    saved by a tokenizer that made no tokens of some texts, read back for one that makes some.
    Refused, or those documents delivered; never dropped."""
    ids, texts = make_rows(200, seed=3)
    texts = [f"# {t}" if i % 9 == 0 else t for i, t in enumerate(texts)]
    folder = write_files(tmp_path / "data", ids, texts, files=1, row_group_size=25)
    cache = tmp_path / "cache"
    monkeypatch.setitem(EDIT, "skip hashes", True)
    epoch(packed(folder, cache, tokenizer=edited, key="v1"))  # counts saved
    monkeypatch.setitem(EDIT, "skip hashes", False)  # the function edited, its key kept
    want = epoch(packed(folder, None, tokenizer=edited, key="v1"))  # what it makes now
    try:
        got = epoch(packed(folder, cache, tokenizer=edited, key="v1"))
    except DatasetIntegrityError:
        return  # refused: the promise holds
    assert sorted(got) == sorted(want), "documents counted as empty were dropped silently"


@pytest.mark.parametrize("drop_last", [False, True])
def test_an_epoch_shorter_than_a_global_batch_opens_alike_cold_and_warm(
    corpus: Path, tmp_path: Path, drop_last: bool
) -> None:
    """A cold run and a warm one (counts in ``cache_dir``) behave the same: both refuse to open
    with the contract's ``ValueError`` for too few observations, or both deliver the same."""
    cache = tmp_path / "cache"
    n = len(epoch(packed(corpus, cache)))
    outcomes = []
    for folder in (None, cache):
        lo = loader(packed(corpus, folder), batch=n + 3, drop_last=drop_last)
        try:
            with lo:
                outcomes.append(("delivered", [len(b) for b in lo]))
        except ValueError as exc:
            outcomes.append(("refused", str(exc).split(";")[0]))
    cold, warm = outcomes
    assert cold == warm


def test_a_corpus_shorter_than_one_sequence_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    """As the layout built at open does (and the contract's too few observations): a text
    column holding fewer tokens than one sequence is a clear ``ValueError``, not an empty
    epoch that a training loop runs through silently."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a few words", "more"]}), folder / "part-0.parquet")
    with pytest.raises(ValueError, match="sequence"), loader(packed(folder), batch=1) as lo:
        list(lo)


@pytest.mark.parametrize("window", [0, -2, 2.5])
def test_a_bad_count_window_is_named_in_its_error(corpus: Path, window: Any) -> None:
    """Bad input gets a clear error that names it: ``count_window`` is what the user set."""
    ds = packed(corpus)
    with pytest.raises((ValueError, TypeError), match="count_window"):
        ds.count_window = window
        epoch(ds)


def test_a_checkpoint_saved_once_every_row_group_is_counted_records_the_count(corpus: Path) -> None:
    """The fingerprint's ``observations`` is ``-1`` only where the checkpoint was saved before
    every row group was counted: one saved in the next epoch records the number of sequences
    (so that ``load_state_dict`` checks it), even if an earlier one was saved mid-count."""
    ds = packed(corpus)
    with loader(ds) as lo:
        it = iter(lo)
        next(it)
        assert lo.state_dict()["dataset"]["observations"] == -1  # mid-count
        for _ in it:
            pass
        it = iter(lo)
        next(it)
        assert ds._is_counted()
        assert lo.state_dict()["dataset"]["observations"] == len(ds)


def test_a_file_rewritten_with_its_size_footer_and_time_kept_is_refused_naming_that(
    tmp_path: Path,
) -> None:
    """Counts in ``cache_dir`` are keyed by each file's size, version and footer bytes: a file
    rewritten with all three kept (two rows of one byte length swapped, uncompressed, its
    modification time set back) matches its saved counts' key. Its documents are checked
    against those counts as they are read: refused, with the error naming that cause."""
    texts = [f"row {i} " + "w " * (i % 7) for i in range(60)]
    texts[5], texts[40] = "aaaaaaaa bbbbbbbb", "a b c d e f g h i"  # 17 bytes: 2 and 9 words
    folder, cache = tmp_path / "data", tmp_path / "cache"
    folder.mkdir()
    path = folder / "part-0.parquet"
    opts: dict[str, Any] = {"row_group_size": 25, "compression": "none", "use_dictionary": False}

    def write(rows: list[str]) -> None:
        pq.write_table(pa.table({"text": pa.array(rows, pa.string())}), path, write_statistics=False, **opts)

    write(texts)
    epoch(packed(folder, cache))  # every row group counted and saved
    before, footer = path.stat(), pq.ParquetFile(path).metadata.serialized_size
    texts[5], texts[40] = texts[40], texts[5]
    write(texts)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size
    assert pq.ParquetFile(path).metadata.serialized_size == footer
    with pytest.raises(DatasetIntegrityError, match="rewritten in place"):
        epoch(packed(folder, cache))
