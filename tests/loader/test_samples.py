"""Samples, collate and device: what collate_fn receives and where batches land."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from tests.support.data import identity_stream, stack_collate
from tests.support.loader import take

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def test_stream_with_metadata_gives_dict_samples() -> None:
    tokens = np.arange(40, dtype=np.uint16)
    storage = gl.MemoryStreamStorage(tokens, metadata={"loss_mask": tokens % 2 == 0})

    def collate(samples: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64)),
            "loss_mask": torch.from_numpy(np.stack([s["loss_mask"] for s in samples])),
        }

    loader = gl.StatefulDataLoader.from_storage(storage, collate, sequence_length=5, local_batch_size=2)
    with loader:
        first = take(loader, 1)[0]
    assert first["input_ids"].tolist() == [list(range(5)), list(range(5, 10))]
    assert first["loss_mask"][0].tolist() == [True, False, True, False, True]


def test_document_storage_samples_are_whole_documents() -> None:
    docs = [np.arange(n, dtype=np.int32) for n in (3, 1, 4, 2)]

    def pad(samples: Sequence[np.ndarray]) -> torch.Tensor:
        width = max(len(s) for s in samples)
        out = torch.full((len(samples), width), -1, dtype=torch.int64)
        for i, s in enumerate(samples):
            out[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
        return out

    loader = gl.StatefulDataLoader.from_storage(gl.MemoryDocumentStorage(docs), pad, local_batch_size=2)
    with loader:
        a, b = take(loader)
    assert a.tolist() == [[0, 1, 2], [0, -1, -1]]
    assert b.tolist() == [[0, 1, 2, 3], [0, 1, -1, -1]]


def test_nested_batches_move_to_the_device_whole() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    def collate(samples: Sequence[np.ndarray]) -> dict[str, Any]:
        t = torch.from_numpy(np.stack(samples))
        return {"x": t, "nested": [t, (t, Pair(t, 3))], "n": len(samples)}

    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(8),
        collate,
        sequence_length=4,
        local_batch_size=2,
        device=torch.device("meta"),
        pin_memory=True,
    )
    with loader:
        batch = take(loader, 1)[0]
    assert batch["x"].device.type == "meta"
    assert batch["nested"][0].device.type == "meta"
    assert batch["nested"][1][0].device.type == "meta"
    assert isinstance(batch["nested"][1][1], Pair) and batch["nested"][1][1].a.device.type == "meta"
    assert batch["n"] == 2


def test_pin_memory_is_harmless_on_cpu() -> None:
    loader = gl.StatefulDataLoader.from_storage(
        identity_stream(8), stack_collate, sequence_length=4, local_batch_size=2, pin_memory=True
    )
    with loader:
        assert take(loader, 1)[0].shape == (2, 4)
