"""Checked by mypy in CI (tox -e types), never run: the overloads of StatefulDataLoader.from_storage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, assert_type

import numpy as np
import numpy.typing as npt
import torch

import guideloom as gl

Array = npt.NDArray[Any]


def collate(samples: Sequence[Array]) -> torch.Tensor:
    return torch.from_numpy(np.stack(samples))


stream = gl.MemoryStreamStorage(np.arange(10))
docs = gl.MemoryDocumentStorage([np.arange(3)])

loader = gl.StatefulDataLoader.from_storage(stream, collate, sequence_length=4)
assert_type(loader, gl.StatefulDataLoader[Any, torch.Tensor])
assert_type(len(loader), int)
assert_type(loader.global_batch_size, int)
assert_type(loader.state_dict(), gl.StatefulDataLoaderStateDict)

doc_loader = gl.StatefulDataLoader.from_storage(docs, collate)
assert_type(doc_loader, gl.StatefulDataLoader[Array, torch.Tensor])

with loader:
    for batch in loader:
        assert_type(batch, torch.Tensor)


async def consume() -> None:
    async with doc_loader:
        async for batch in doc_loader:
            assert_type(batch, torch.Tensor)


def wrong_pairings() -> None:
    # A stream without sequence_length, or documents with one, are typed NoReturn.
    if bool(0):
        gl.StatefulDataLoader.from_storage(stream, collate)
        print("unreachable")  # type: ignore[unreachable]
    if bool(0):
        gl.StatefulDataLoader.from_storage(docs, collate, sequence_length=4)
        print("unreachable")  # type: ignore[unreachable]


# A mixture (any DatasetAbstract) goes where a storage goes; its samples are typed Any.
mixture = gl.mix({"web": stream, "code": docs}, {"web": 0.7, "code": 0.3})
mix_loader = gl.StatefulDataLoader.from_storage(mixture, collate, sequence_length=4)
assert_type(mix_loader, gl.StatefulDataLoader[Any, torch.Tensor])
assert_type(gl.StatefulDataLoader(mixture, collate), gl.StatefulDataLoader[Any, torch.Tensor])
assert_type(gl.MapDataset(["a", "b"]), gl.MapDataset[str])
assert_type(gl.MapDataset(range(3)), gl.MapDataset[int])
