"""Storages over data held in memory: for tests, small corpora and data built on the fly."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._core.text import plural
from guideloom.storage.base import DocumentStorageAbstract, Rows, StreamStorageAbstract

__all__ = ["MemoryDocumentStorage", "MemoryStreamStorage", "gather_windows"]

Array = npt.NDArray[Any]


def gather_windows(data: Array, starts: npt.NDArray[np.int64], length: int) -> Array:
    """Copy the windows ``data[s:s+length]`` for each ``s`` into one ``(len(starts), length)`` array.

    Windows that all start on multiples of ``length`` (every stream sample does) are gathered
    with a single fancy-indexing operation over a 2-D view; others fall back to a row loop.
    """
    n = len(starts)
    if n == 0:
        return np.empty((0, length), dtype=data.dtype)
    if length > 0 and not np.any(starts % length):
        rows = len(data) // length
        view = data[: rows * length].reshape(rows, length)
        return view[starts // length]
    out = np.empty((n, length), dtype=data.dtype)
    for i, s in enumerate(starts.tolist()):
        out[i] = data[s : s + length]
    return out


def _as_1d(name: str, array: npt.ArrayLike) -> Array:
    arr = np.asarray(array)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold numbers or booleans, got dtype {arr.dtype}")
    return arr


class MemoryStreamStorage(StreamStorageAbstract[Array, Any]):
    """Stream storage over a 1-D numpy array held in memory.

    ``metadata`` maps field names to arrays as long as ``tokens``; with it, samples are dicts
    ``{"tokens": ..., name: ...}``.
    """

    blocking_calls_are_cheap = True  # reads copy from memory: no thread hop on an event loop

    def __init__(self, tokens: npt.ArrayLike, metadata: Mapping[str, npt.ArrayLike] | None = None) -> None:
        self._tokens = _as_1d("tokens", tokens)
        self._metadata: dict[str, Array] = {}
        for name, values in (metadata or {}).items():
            if name == "tokens":
                raise ValueError('metadata cannot use the field name "tokens"')
            arr = _as_1d(f"metadata[{name!r}]", values)
            if len(arr) != len(self._tokens):
                raise ValueError(
                    f"metadata[{name!r}] has {plural(len(arr), 'element')} but the stream has "
                    f"{len(self._tokens)}; every metadata array must be as long as the stream"
                )
            self._metadata[name] = arr

    def __len__(self) -> int:
        return len(self._tokens)

    def __repr__(self) -> str:
        return f"MemoryStreamStorage(len={len(self)}, dtype={self.dtype}, fields={list(self.fields)})"

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._tokens.dtype

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self._metadata)

    def sample_nbytes_hint(self) -> int:
        return self._tokens.dtype.itemsize + sum(a.dtype.itemsize for a in self._metadata.values())

    def read_many_sync(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        tokens = gather_windows(self._tokens, starts, length)
        if not self._metadata:
            return Rows(tokens)
        fields = {name: gather_windows(a, starts, length) for name, a in self._metadata.items()}
        return [
            {"tokens": tokens[i], **{name: f[i] for name, f in fields.items()}} for i in range(len(starts))
        ]


class MemoryDocumentStorage(DocumentStorageAbstract[Array, Array]):
    """Document storage over a sequence of 1-D numpy arrays held in memory."""

    blocking_calls_are_cheap = True

    def __init__(self, documents: Sequence[npt.ArrayLike]) -> None:
        docs = [_as_1d(f"documents[{i}]", d) for i, d in enumerate(documents)]
        dtypes = {d.dtype for d in docs}
        if len(dtypes) > 1:
            raise TypeError(
                f"documents must share one dtype, got {sorted(str(d) for d in dtypes)}; "
                "convert them with .astype(...) first"
            )
        self._docs = docs
        self._dtype: np.dtype[Any] = docs[0].dtype if docs else np.dtype(np.int64)

    def __len__(self) -> int:
        return len(self._docs)

    def __repr__(self) -> str:
        return f"MemoryDocumentStorage(len={len(self)}, dtype={self.dtype})"

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[Array]:
        docs = self._docs
        return [docs[i] for i in indices.tolist()]
