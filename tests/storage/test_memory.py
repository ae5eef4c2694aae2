"""Memory storages."""

from __future__ import annotations

import numpy as np
import pytest

from guideloom import MemoryDocumentStorage, MemoryStreamStorage
from guideloom._storage.memory import gather_windows


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


def test_sample_list_is_a_list_whose_array_is_the_block() -> None:
    from guideloom._storage.base import SampleList

    block = np.arange(12, dtype=np.uint16).reshape(3, 4)
    samples = SampleList(block)
    assert isinstance(samples, list) and len(samples) == 3 and samples[1].tolist() == [4, 5, 6, 7]
    arr = np.asarray(samples)
    assert arr is block  # no copy
    assert np.array_equal(np.asarray(samples, dtype=np.int64), np.stack(samples))
    part = samples.slice(1, 3)
    assert np.asarray(part).base is block or np.shares_memory(np.asarray(part), block)
    assert np.array_equal(np.asarray(part), block[1:])
    samples[0] = np.full(4, 9, dtype=np.uint16)  # changed contents: the shortcut is dropped
    assert np.asarray(samples)[0].tolist() == [9, 9, 9, 9]
    samples.append(np.zeros(4, dtype=np.uint16))
    assert np.asarray(samples).shape == (4, 4)
    assert SampleList(np.empty((0, 4))) == []


@pytest.mark.asyncio
async def test_stream_batches_reach_collate_as_one_block() -> None:
    import torch

    import guideloom as gl

    seen = []

    def collate(samples: list[np.ndarray]) -> torch.Tensor:
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
