"""Memory storages."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from guideloom import MemoryDocumentStorage, MemoryStreamStorage
from guideloom.storage._memory import gather_windows


@pytest.mark.asyncio
async def test_stream_windows() -> None:
    s = MemoryStreamStorage(np.arange(100, dtype=np.uint16))
    assert len(s) == 100 and s.dtype == np.uint16 and s.fields == ()
    out = await s.read_many(np.array([20, 0, 90], dtype=np.int64), 10)
    assert [o.tolist() for o in out] == [list(range(20, 30)), list(range(10)), list(range(90, 100))]


@pytest.mark.asyncio
async def test_stream_with_metadata_yields_dicts() -> None:
    tokens = np.arange(50, dtype=np.int32)
    s = MemoryStreamStorage(tokens, metadata={"loss_mask": tokens % 2 == 0, "doc_id": tokens // 7})
    assert s.fields == ("loss_mask", "doc_id")
    (sample,) = await s.read_many(np.array([10], dtype=np.int64), 5)
    assert set(sample) == {"tokens", "loss_mask", "doc_id"}
    assert sample["tokens"].tolist() == [10, 11, 12, 13, 14]
    assert sample["loss_mask"].tolist() == [True, False, True, False, True]
    assert sample["doc_id"].tolist() == [1, 1, 1, 1, 2]


def test_metadata_must_match_length_and_not_shadow_tokens() -> None:
    with pytest.raises(ValueError, match="as long as the stream"):
        MemoryStreamStorage(np.arange(10), metadata={"m": np.arange(9)})
    with pytest.raises(ValueError, match="tokens"):
        MemoryStreamStorage(np.arange(10), metadata={"tokens": np.arange(10)})
    with pytest.raises(ValueError, match="1-D"):
        MemoryStreamStorage(np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"metadata\['m'\] has 1 element but the stream has 2;"):
        MemoryStreamStorage(np.arange(2), metadata={"m": np.arange(1)})


def test_gather_windows_unaligned_and_aligned() -> None:
    data = np.arange(40)
    assert gather_windows(data, np.array([3, 17], dtype=np.int64), 4).tolist() == [
        [3, 4, 5, 6],
        [17, 18, 19, 20],
    ]
    assert gather_windows(data, np.array([8, 0], dtype=np.int64), 4).tolist() == [
        [8, 9, 10, 11],
        [0, 1, 2, 3],
    ]
    assert gather_windows(data, np.array([], dtype=np.int64), 4).shape == (0, 4)


@pytest.mark.asyncio
async def test_documents() -> None:
    docs = [np.arange(n, dtype=np.uint8) for n in (3, 0, 5)]
    s = MemoryDocumentStorage(docs)
    assert len(s) == 3
    out = await s.read_many(np.array([2, 1, 0], dtype=np.int64))
    assert [o.tolist() for o in out] == [[0, 1, 2, 3, 4], [], [0, 1, 2]]


def test_documents_need_one_dtype() -> None:
    with pytest.raises(TypeError, match="one dtype"):
        MemoryDocumentStorage([np.arange(3, dtype=np.uint8), np.arange(3, dtype=np.int64)])


def test_rows_is_a_sequence_of_row_views_whose_array_is_the_block() -> None:
    from collections.abc import Sequence as Seq

    import torch
    from torch.utils.data import default_collate

    from guideloom.storage.base import Rows

    block = np.arange(12, dtype=np.uint16).reshape(3, 4)
    rows = Rows(block)
    assert isinstance(rows, Seq) and len(rows) == 3
    assert rows[1].tolist() == [4, 5, 6, 7] and np.shares_memory(rows[1], block)
    assert rows[-1].tolist() == [8, 9, 10, 11]
    assert [r.tolist() for r in rows] == block.tolist()
    assert isinstance(rows[1:], Rows) and np.asarray(rows[1:]).tolist() == block[1:].tolist()
    assert np.asarray(rows) is block  # no copy
    assert np.asarray(rows, dtype=np.int64).dtype == np.int64
    assert not np.shares_memory(np.array(rows, copy=True), block)
    # The collates people write for a list of 1-D arrays work on it unchanged.
    assert np.array_equal(np.stack(rows), block)
    assert torch.equal(torch.stack([torch.from_numpy(r) for r in rows]), torch.from_numpy(block))
    assert torch.equal(default_collate(rows), torch.from_numpy(block))
    assert [int(r[0]) for r in rows] == [0, 4, 8]


@pytest.mark.asyncio
async def test_stream_batches_reach_collate_as_one_block() -> None:
    import torch

    import guideloom as gl

    seen = []

    def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
        arr = np.asarray(samples)
        seen.append(np.shares_memory(arr, samples[0]) and arr.shape == (len(samples), 4))
        return torch.from_numpy(arr.astype(np.int64))

    loader = gl.StatefulDataLoader.from_storage(
        MemoryStreamStorage(np.arange(64)),
        collate,
        sequence_length=4,
        local_batch_size=4,
        shuffle=True,
        shuffle_seed=0,
    )
    async with loader:
        batches = [b async for b in loader]
    assert all(seen) and len(seen) == 4
    assert sorted(torch.cat(batches).flatten().tolist()) == list(range(64))
