"""Stream samples: ``sequence_length`` consecutive elements of one long stream."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_int
from guideloom._datasets.base import BuiltinDataset, ReadHints, SourceT
from guideloom.storage.base import StreamStorageAbstract

__all__ = ["StreamDataset"]


class StreamDataset(BuiltinDataset[SourceT]):
    """Samples of ``sequence_length`` consecutive stream elements; sample ``i`` starts at ``i * L``.

    Trailing elements that do not fill a whole sample are not a sample.
    """

    _plain_reads: ClassVar[bool] = True

    def __init__(self, storage: StreamStorageAbstract[Any, SourceT], sequence_length: int) -> None:
        if not isinstance(storage, StreamStorageAbstract):
            raise TypeError(f"StreamDataset needs a StreamStorageAbstract, got {type(storage).__name__}")
        self._storage = storage
        self.sequence_length = check_int("sequence_length", sequence_length, 1)

    def __repr__(self) -> str:
        return f"StreamDataset({self._storage!r}, sequence_length={self.sequence_length})"

    @property
    def storage(self) -> StreamStorageAbstract[Any, SourceT]:
        return self._storage

    def __len__(self) -> int:
        return len(self._storage) // self.sequence_length

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return await self._storage.read_many(indices * self.sequence_length, self.sequence_length)

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return self._storage.read_many_sync(indices * self.sequence_length, self.sequence_length)

    @property
    def _reads_inline(self) -> bool:
        return self._plain_reads and self._storage.reads_inline()

    def _will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        if self._plain_reads:  # reads map to the storage's 1:1
            length = self.sequence_length
            self._storage.will_read((np.asarray(w, dtype=np.int64) * length for w in windows), length)

    def describe(self, index: int) -> dict[str, Any]:
        """The stream elements of sample ``index`` and the files holding them."""
        start = index * self.sequence_length
        stop = start + self.sequence_length
        return {"elements": [[start, stop]], "files": [self._storage.locate(start, stop)]}

    def _fingerprint_kind(self) -> str:
        return "stream"

    def _hints(self) -> ReadHints:
        """The storage's figures; a sample's bytes are its ``sequence_length`` elements'."""
        element = max(1, self._storage.sample_nbytes_hint() or self._storage.dtype.itemsize)
        return ReadHints.of_storage(self._storage, sample_nbytes=self.sequence_length * element)
