"""The loader's read hint (``will_read``): the storage is told exactly the reads that follow."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from guideloom import MemoryDocumentStorage, MemoryStreamStorage, StatefulDataLoader


class Recording(MemoryStreamStorage):
    """Memory storage that records the hint (consumed on another thread, as a cache would)
    and every read."""

    def __init__(self, tokens: Any) -> None:
        super().__init__(tokens)
        self.hints: list[list[list[int]]] = []
        self.reads: list[list[int]] = []
        self.lengths: set[int] = set()
        self._threads: list[threading.Thread] = []

    def will_read(self, windows: Iterable[npt.NDArray[np.int64]], length: int) -> None:
        self.lengths.add(length)
        hint: list[list[int]] = []
        self.hints.append(hint)
        t = threading.Thread(target=lambda: hint.extend(w.tolist() for w in windows))
        t.start()
        self._threads.append(t)

    async def read_many(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        self.reads.append(np.asarray(starts).tolist())
        return await super().read_many(starts, length)

    def join(self) -> None:
        for t in self._threads:
            t.join(10)


def stack(samples: Sequence[Any]) -> torch.Tensor:
    return torch.from_numpy(np.stack(samples).astype(np.int64))


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_hint_is_every_read_of_the_epoch_in_order_also_after_resume(shuffle: bool) -> None:
    storage = Recording(np.arange(10_000, dtype=np.int32))
    storage.read_window_bytes = 3000  # windows of a few batches: many reads
    kw: dict[str, Any] = dict(
        sequence_length=10, local_batch_size=7, shuffle=shuffle, shuffle_seed=2, prefetch=3
    )
    loader = StatefulDataLoader.from_storage(storage, stack, device=torch.device("cpu"), **kw)
    with loader:
        it = iter(loader)
        for _ in range(40):
            next(it)
        state = loader.state_dict()
        it.close()
        storage.join()
        assert storage.lengths == {10}
        assert storage.hints[0][: len(storage.reads)] == storage.reads
        storage.hints.clear()
        storage.reads.clear()
        loader.load_state_dict(state)
        list(loader)  # the rest of the epoch, from the checkpoint
    storage.join()
    assert len(storage.hints) == 1 and storage.hints[0] == storage.reads and len(storage.reads) > 10


def test_document_storage_gets_the_hint_as_indexes() -> None:
    seen: list[list[int]] = []
    reads: list[list[int]] = []

    class Docs(MemoryDocumentStorage):
        def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
            seen.extend(w.tolist() for w in windows)

        async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[Any]:
            reads.append(np.asarray(indices).tolist())
            return await super().read_many(indices)

    docs = [np.arange(n, dtype=np.int32) for n in range(1, 50)]
    loader = StatefulDataLoader.from_storage(
        Docs(docs), len, device=torch.device("cpu"), local_batch_size=5, shuffle=True, shuffle_seed=1
    )
    with loader:
        assert sum(loader) == 45  # drop_last: 9 batches of 5
    assert seen == reads and len({i for w in seen for i in w}) == 45
