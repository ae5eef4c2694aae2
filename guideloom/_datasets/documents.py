"""Document samples: one written document per sample."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from guideloom._datasets.base import BuiltinDataset, FinishThenCollate, SourceT
from guideloom.storage.base import DocumentStorageAbstract

__all__ = ["DocumentDataset"]


class DocumentDataset(BuiltinDataset[SourceT]):
    """One document per sample, as written."""

    _plain_reads: ClassVar[bool] = True

    def __init__(self, storage: DocumentStorageAbstract[Any, SourceT]) -> None:
        if not isinstance(storage, DocumentStorageAbstract):
            raise TypeError(f"DocumentDataset needs a DocumentStorageAbstract, got {type(storage).__name__}")
        self._given = storage
        #: Where the storage's reads end in a step that may run in the workers (tokenizing): it
        #: runs before collate_fn, and the reads here stop before it.
        self._finish: Callable[[Sequence[Any]], Sequence[Any]] | None = None
        deferred = storage.deferred_step()
        if deferred is not None:
            storage, self._finish = deferred
        self._storage = storage
        self._collates: tuple[Any, Any] | None = None

    def __repr__(self) -> str:
        return f"DocumentDataset({self._given!r})"

    @property
    def storage(self) -> DocumentStorageAbstract[Any, SourceT]:
        return self._storage

    def __len__(self) -> int:
        return len(self._storage)

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return await self._storage.read_many(indices)

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[SourceT]:
        return self._storage.read_many_sync(indices)

    @property
    def _reads_inline(self) -> bool:
        return self._plain_reads and self._storage.reads_inline()

    def _will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        if self._plain_reads:  # reads map to the storage's 1:1
            self._storage.will_read(windows)

    def describe(self, index: int) -> dict[str, Any]:
        """Document ``index``: its elements in the storage and the files holding them (as the
        storage describes them)."""
        return self._storage.describe_document(index)

    def _fingerprint_kind(self) -> str:
        return "documents"

    def _natural_blocks(self) -> npt.NDArray[np.int64] | None:
        return self._storage.natural_blocks()

    def _finish_step(self) -> Callable[[Sequence[Any]], Sequence[Any]] | None:
        return self._finish

    def _collate_with(self, collate_fn: Callable[[Sequence[Any]], Any]) -> Callable[[Sequence[Any]], Any]:
        """``collate_fn``, after the storage's deferred step where it has one (see
        :meth:`DocumentStorageAbstract.deferred_step`); the same object for the same
        ``collate_fn`` (persistent workers keep theirs)."""
        if self._finish is None:
            return collate_fn
        if self._collates is None or self._collates[0] is not collate_fn:
            self._collates = (collate_fn, FinishThenCollate(self._finish, collate_fn))
        made: Callable[[Sequence[Any]], Any] = self._collates[1]
        return made

    def _position_stats(self, *, epoch: int, offset: int) -> dict[str, float]:
        return self._storage.figures()
