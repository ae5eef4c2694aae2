"""Packed Parquet under the row-group-aware order (``shuffle_block_size="auto"``): a packed
sequence's row groups are decoded about once per visit, where a plain shuffle decodes them over
and over; every sequence once an epoch; a resume at any offset with another batch and world
size equals the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._datasets.packing import PackMode
from tests.storage.test_parquet import make_rows, write_files
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
