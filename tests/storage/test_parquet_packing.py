"""Packed Parquet under the row-group-aware order (``shuffle_block_size="auto"``): a packed
sequence's row groups are decoded about once per visit, where a plain shuffle decodes them over
and over; every sequence once an epoch; a resume at any offset with another batch and world
size equals the uninterrupted run."""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._datasets.packing import PackMode
from tests.storage.test_parquet import WORDS, make_rows, write_files
from tests.support.loader import roundtrip, take

CPU = torch.device("cpu")
#: Bytes of decoded row groups kept: about 8 of the row groups below (int32 tokens).
BUDGET = 8 * 1_600


def keys(rows: Any) -> list[tuple[int, ...]]:
    """A sequence's documents and tokens: unique per sequence (positions restart in each)."""
    return [tuple(np.concatenate([r["doc_ids"], r["tokens"]]).tolist()) for r in rows]


@pytest.fixture(scope="module")
def many_groups(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,200 rows in 48 row groups of 25 (4 files)."""
    ids, texts = make_rows(1200, seed=5)
    return write_files(tmp_path_factory.mktemp("groups"), ids, texts, files=4, row_group_size=25)


def decodes_per_epoch(folder: Path, mode: PackMode, shuffle_block_size: Any) -> tuple[float, int, int]:
    """Row groups decoded in one shuffled epoch of ``pack(open_parquet(folder), 16, mode)``
    (the length index's pass left out), with room for about 8 decoded row groups (best fit: ranges of
    about two); the
    sequences delivered, and how many there are."""
    storage = gl.open_parquet(folder, "input_ids", max_decoded_bytes=BUDGET)
    packed = gl.pack(storage, 16, mode, fit_group=32)
    loader = gl.StatefulDataLoader(
        packed,
        keys,
        local_batch_size=8,
        shuffle=True,
        shuffle_seed=2,
        shuffle_block_size=shuffle_block_size,
        shuffle_window=2,
        device=CPU,
        drop_last=False,
    )
    with loader:
        built = loader.stats()["parquet_row_group_decodes"]  # the length index: one pass
        got = [k for batch in take(loader) for k in batch]
        epoch = loader.stats()["parquet_row_group_decodes"] - built
    assert len(got) == len(set(got)) == len(packed), "every sequence once"
    return epoch, len(got), storage.num_row_groups


def test_a_row_group_is_about_one_decode_per_visit_under_the_auto_order(many_groups: Path) -> None:
    storage = gl.open_parquet(many_groups, "input_ids")
    elements = np.diff(storage.build_length_index()[np.cumsum([0, *storage.row_group_sizes()])])
    assert 6 * elements.max() * 4 < BUDGET < 12 * elements.min() * 4, "6 to 12 row groups fit"
    for mode in ("concat", "best_fit"):
        auto, n, groups = decodes_per_epoch(many_groups, mode, "auto")
        plain, _, _ = decodes_per_epoch(many_groups, mode, None)
        assert groups == 48 and n > 10 * groups
        # about once per visit: a read window may reach into the next order window, whose row
        # groups then push out some of this one's; concat: a sequence that runs into the next
        # row group decodes that one too, unless it is at hand
        assert groups <= auto <= (1.5 if mode == "best_fit" else 2) * groups, (mode, auto)
        assert plain > 2.5 * auto, (mode, plain, auto)  # reads of whole windows keep this low here


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> gl.ParquetStorage:
    """Files of uneven row groups (a short last one in each)."""
    ids, texts = make_rows(130, seed=3)
    folder = write_files(tmp_path_factory.mktemp("uneven"), ids, texts, files=3, row_group_size=9)
    return gl.open_parquet(folder, "input_ids")


def run_ranks(
    dataset: gl.PackedDataset, world: int, state: Any = None, steps: int | None = None, **kw: Any
) -> tuple[list[tuple[int, ...]], Any]:
    per_rank, saved = [], None
    for rank in range(world):
        loader = gl.StatefulDataLoader(dataset, keys, rank=rank, world_size=world, device=CPU, **kw)
        with loader:
            if state is not None:
                loader.load_state_dict(state)
            per_rank.append(take(loader, steps))
            saved = roundtrip(loader.state_dict())
    return [k for step in zip(*per_rank, strict=True) for batch in step for k in batch], saved


@settings(max_examples=20, deadline=None)
@given(
    mode=st.sampled_from(["concat", "best_fit"]),
    first=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    second=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    stop=st.integers(0, 12),
    window=st.integers(1, 4),
)
def test_packed_parquet_resumes_exactly_at_any_offset_on_another_world_and_batch_size(
    uneven: gl.ParquetStorage,
    mode: PackMode,
    first: tuple[int, int],
    second: tuple[int, int],
    stop: int,
    window: int,
) -> None:
    packed = gl.pack(uneven, 8, mode, fit_group=2)
    kw = {
        "shuffle": True,
        "shuffle_seed": 7,
        "drop_last": False,
        "shuffle_block_size": "auto",
        "shuffle_window": window,
    }
    (b1, w1), (b2, w2) = first, second
    expected, _ = run_ranks(packed, 1, local_batch_size=1, **kw)
    assert len(expected) == len(set(expected)) == len(packed)
    natural = packed.natural_blocks()
    assert natural is not None and int(natural.sum()) == len(packed)
    stop = min(stop, (len(packed) - 1) // (b1 * w1))
    before, state = run_ranks(packed, w1, steps=stop, local_batch_size=b1, **kw)
    assert state["shuffle_block_size"] == max(2, round(len(packed) / len(natural)))
    after, _ = run_ranks(packed, w2, state=state, local_batch_size=b2, **kw)
    assert before + after == expected


def named_keys(pairs: Any) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, keys([row])[0]) for name, row in pairs]


def test_a_mixture_of_packed_parquet_sources_repeats_no_sequence(uneven: gl.ParquetStorage) -> None:
    """A mixture makes its own order (its sources' own permutations): the packed sources' blocks
    are not used there (no block size recorded), and within a source epoch no sequence repeats."""
    a, b = gl.pack(uneven, 8, "concat"), gl.pack(uneven, 8, "best_fit")
    mixture = gl.mix({"a": a, "b": b}, num_samples=len(a), with_source=True)
    loader = gl.StatefulDataLoader(
        mixture,
        named_keys,
        local_batch_size=4,
        shuffle=True,
        shuffle_block_size="auto",
        device=CPU,
        drop_last=False,
    )
    with loader:
        got = [k for batch in take(loader) for k in batch]
        assert "shuffle_block_size" not in loader.state_dict()
    assert len(got) == len(set(got)) == len(a) and {name for name, _ in got} == {"a", "b"}


# -- the length index saved in cache_dir: keyed by what it derives from, checked when read ------------
def sequences(storage: gl.ParquetStorage, length: int = 16) -> list[tuple[int, ...]]:
    """Every packed sequence's tokens, in order."""
    packed = gl.pack(storage, length, "concat")
    with gl.StatefulDataLoader(
        packed, lambda rows: rows.block("tokens").tolist(), local_batch_size=8, device=CPU, drop_last=False
    ) as loader:
        return [tuple(r) for batch in take(loader) for r in batch]


def test_an_edited_or_damaged_length_index_is_named_and_built_again(
    many_groups: Path, tmp_path: Path
) -> None:
    """The whole index and a row group's saved lengths are checked against the digests of their
    bytes: an edit (one length changed) or damage is named in a warning and built again, and the
    packed sequences are those of the files."""
    expected = sequences(gl.open_parquet(many_groups, "input_ids"))
    cache = tmp_path / "cache"
    storage = gl.open_parquet(many_groups, "input_ids", cache_dir=cache)
    assert sequences(storage) == expected
    whole = storage._length_folder() / "lengths.npy"
    lengths = np.load(whole)
    lengths[3] += 1  # an edit numpy reads without complaint
    np.save(whole, lengths)
    again = gl.open_parquet(many_groups, "input_ids", cache_dir=cache)
    with pytest.warns(RuntimeWarning, match=re.escape(f"{whole}: its bytes do not match the digest")):
        assert sequences(again) == expected
    assert again.figures()["parquet_row_group_decodes"] >= again.num_row_groups  # built again
    whole.write_bytes(b"\x93NUMPY garbage")  # damaged: no numpy error, the file is named
    with pytest.warns(RuntimeWarning, match=re.escape(str(whole))):
        assert sequences(gl.open_parquet(many_groups, "input_ids", cache_dir=cache)) == expected
    reread = gl.open_parquet(many_groups, "input_ids", cache_dir=cache)  # whole again: read back
    assert np.array_equal(reread.build_length_index(), storage.build_length_index())
    assert reread.figures()["parquet_row_group_decodes"] == 0
    # a row group's lengths left by an interrupted build, edited after it was saved
    folder = reread._length_folder()
    for name in ("lengths.npy", "lengths.json"):
        (folder / name).unlink()
    true = np.diff(reread.build_length_index())[:25].astype(np.int32)
    buf = io.BytesIO()
    np.save(buf, true)
    part = folder / f"group-0-{hashlib.sha256(buf.getvalue()).hexdigest()[:32]}.npy"
    np.save(part, true + 1)  # the bytes no longer have the digest in its name
    with pytest.warns(RuntimeWarning, match=re.escape(f"{part}: its bytes do not match")):
        assert sequences(gl.open_parquet(many_groups, "input_ids", cache_dir=cache)) == expected


def test_the_length_index_follows_the_tokenizers_contents_not_its_name(tmp_path: Path) -> None:
    """A tokenizer.json edited under the same path is another index; a callable, whose contents
    cannot be read, is not cached without tokenizer_key, and documents that do not tokenize as
    the index says (a callable changed under the same key) are refused by file, row group and row."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    ids, texts = make_rows(200, seed=4)
    folder = write_files(tmp_path / "data", ids, texts, files=2, row_group_size=20)
    cache = tmp_path / "cache"

    def save(digits: bool) -> str:
        """A word-level tokenizer.json; with ``digits``, each digit a token of its own."""
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, "[UNK]"))
        split = [pre_tokenizers.Whitespace()] + ([pre_tokenizers.Digits(True)] if digits else [])
        tok.pre_tokenizer = pre_tokenizers.Sequence(split)
        tok.save(str(tmp_path / "tokenizer.json"))
        return str(tmp_path / "tokenizer.json")

    for digits in (False, True):  # the same path, other contents: other lengths
        path = save(digits)
        fresh = sequences(gl.open_parquet(folder, "text", tokenizer=path))
        assert sequences(gl.open_parquet(folder, "text", tokenizer=path, cache_dir=cache)) == fresh
    assert len(list(cache.glob("lengths-*"))) == 2

    def encoder(per_word: int) -> Any:
        def encode(text: str) -> list[int]:
            return [len(w) for w in text.split() for _ in range(per_word)]

        return encode

    one, two = encoder(1), encoder(2)  # the same name, other tokens
    assert one.__qualname__ == two.__qualname__
    for tok in (one, two):
        fresh = sequences(gl.open_parquet(folder, "text", tokenizer=tok))
        with pytest.warns(RuntimeWarning, match="not cached in cache_dir: a tokenizer callable"):
            assert sequences(gl.open_parquet(folder, "text", tokenizer=tok, cache_dir=cache)) == fresh
    keyed = gl.open_parquet(folder, "text", tokenizer=one, tokenizer_key="words-v1", cache_dir=cache)
    assert sequences(keyed) == sequences(gl.open_parquet(folder, "text", tokenizer=one))
    changed = gl.open_parquet(folder, "text", tokenizer=two, tokenizer_key="words-v1", cache_dir=cache)
    with pytest.raises(
        gl.DatasetIntegrityError,
        match=r"00000-of-00002\.parquet: row group 0, row \d+ \(document \d+\) has \d+ tokens, the length",
    ):
        sequences(changed)
    renamed = gl.open_parquet(folder, "text", tokenizer=two, tokenizer_key="words-v2", cache_dir=cache)
    assert sequences(renamed) == sequences(gl.open_parquet(folder, "text", tokenizer=two))


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_packed_text_tokenizes_each_document_once_an_epoch(
    many_groups: Path, tmp_path: Path, mode: PackMode
) -> None:
    """Over a text column, a shuffled epoch of packed sequences tokenizes about one token per
    token delivered: each row is tokenized once while its row group is kept, however many
    sequences (and reads) hold it. The length index is built (and cached) by a first open."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)] * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"])
    )
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)

    def storage() -> gl.ParquetStorage:
        return gl.open_parquet(many_groups, "text", tokenizer=path, cache_dir=tmp_path / "cache")

    storage().build_length_index()
    packed = gl.pack(storage(), 16, mode, fit_group=4)
    loader = gl.StatefulDataLoader(
        packed,
        lambda rows: torch.from_numpy(rows.block("segment_ids") != 0),  # the real tokens
        local_batch_size=4,
        shuffle=True,
        shuffle_block_size="auto",
        shuffle_window=2,
        device=CPU,
        drop_last=False,
    )
    with loader:
        delivered = sum(int(batch.sum()) for batch in loader)
        made = loader.stats()["parquet_tokens_tokenized"]
    assert delivered > 0
    assert made <= 1.05 * delivered, (made, delivered)


def test_packed_text_is_read_by_the_main_process_and_tokens_by_the_workers(
    many_groups: Path, tmp_path: Path
) -> None:
    """Packed texts are tokenized where they are read, and each row's tokens are kept with its
    row group in that process: the main process reads them (once), not each worker again; a
    token-id column is read by the workers."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *WORDS])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = gl.pack(gl.open_parquet(many_groups, "text", tokenizer=tok), 16)
    assert not texts._read_by_workers
    assert gl.pack(gl.open_parquet(many_groups, "input_ids"), 16)._read_by_workers
