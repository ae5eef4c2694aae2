"""Local datasets: the stream and document storages over a written dataset's folder.

Reading maps each shard file read-only (``mmap``), so opening a dataset costs no reads and its
size does not matter: a 1 TiB stream opens in milliseconds. A batched read gathers a whole
read-ahead window with one numpy fancy-indexing operation per shard when the dataset fits
``MAPPED_BUDGET`` (256 MiB), and with one ``preadv`` per sample straight into the batch when it
does not (see :class:`~guideloom.storage._local._sharded.ShardedArray`). Opening and reading are
blocking calls (``open_sync``, ``read_many_sync``), which the storage base classes run on a worker
thread from a coroutine, so page faults on cold data never block an event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._format._manifest import Manifest
from guideloom.storage._format._manifested import ManifestDocumentStorage, ManifestStreamStorage, check_kind
from guideloom.storage._local._check import read_local_manifest
from guideloom.storage._local._sharded import ShardedArray
from guideloom.storage.base import Rows, Spans

__all__ = ["LocalDocumentStorage", "LocalStreamStorage", "read_local_manifest"]

Array = npt.NDArray[Any]


class LocalStreamStorage(ManifestStreamStorage):
    """A stream dataset in a local folder, memory-mapped while open."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        check_kind(manifest, "stream", str(folder))
        self.folder = folder
        self.manifest = manifest
        self._arrays: dict[str, ShardedArray] | None = None

    @property
    def location(self) -> str:
        return str(self.folder)

    def open_sync(self) -> None:
        if self._arrays is None:
            self._map(read_local_manifest(self.folder))

    def _map(self, manifest: Manifest) -> None:
        if manifest != self.manifest:
            raise DatasetIntegrityError(f"{self.folder}: the manifest changed since open_stream()")
        self._arrays = {n: ShardedArray(self.folder, s) for n, s in manifest.fields.items()}

    async def close(self) -> None:
        # Views handed out keep their maps alive; the maps close when the last view is freed.
        self._arrays = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled closed (a process worker opens its own maps)."""
        return {**self.__dict__, "_arrays": None}

    def _require_open(self) -> dict[str, ShardedArray]:
        if self._arrays is None:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        return self._arrays

    def read_many_sync(self, starts: npt.NDArray[np.int64], length: int) -> Sequence[Any]:
        arrays = self._require_open()
        tokens = arrays["tokens"].gather(starts, length)
        if len(arrays) == 1:
            return Rows(tokens)
        fields = {n: a.gather(starts, length) for n, a in arrays.items() if n != "tokens"}
        return [{"tokens": tokens[i], **{n: f[i] for n, f in fields.items()}} for i in range(len(starts))]


class LocalDocumentStorage(ManifestDocumentStorage):
    """A document dataset in a local folder, memory-mapped while open."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        check_kind(manifest, "documents", str(folder))
        self.folder = folder
        self.manifest = manifest
        self._tokens: ShardedArray | None = None
        self._offsets: ShardedArray | None = None

    @property
    def location(self) -> str:
        return str(self.folder)

    def open_sync(self) -> None:
        if self._tokens is None:
            self._map(read_local_manifest(self.folder))

    def _map(self, manifest: Manifest) -> None:
        if manifest != self.manifest:
            raise DatasetIntegrityError(f"{self.folder}: the manifest changed since open_documents()")
        assert manifest.offsets is not None
        self._offsets = ShardedArray(self.folder, manifest.offsets, preads=False)
        self._tokens = ShardedArray(self.folder, manifest.tokens)

    async def close(self) -> None:
        self._tokens = self._offsets = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled closed (a process worker opens its own maps)."""
        return {**self.__dict__, "_tokens": None, "_offsets": None}

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[Array]:
        if self._tokens is None or self._offsets is None:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        starts = self._offsets.take(indices)
        stops = self._offsets.take(indices + 1)
        if np.any(stops < starts) or (len(stops) and int(stops.max()) > self._tokens.length):
            raise DatasetIntegrityError(f"{self.folder}: document offsets are out of order or out of range")
        if not len(indices):
            return []
        # One copy into one buffer for the window: samples are writable (torch.from_numpy warns
        # on read-only memory maps) and never alias the file.
        buffer, bounds = self._tokens.spans(starts, stops)
        return [buffer[a:b] for a, b in itertools.pairwise(bounds)]

    def document_offsets_sync(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        if self._offsets is None:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        return self._offsets.take(np.asarray(positions, dtype=np.int64)).astype(np.int64, copy=False)

    def read_spans_sync(self, starts: npt.NDArray[np.int64], stops: npt.NDArray[np.int64]) -> Sequence[Any]:
        if self._tokens is None:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        lengths = stops - starts
        if len(starts) and int(lengths.min()) == int(lengths.max()):  # a packed concat window
            return Rows(self._tokens.gather(starts, int(lengths[0])))
        buffer, bounds = self._tokens.spans(starts, stops)
        return Spans(buffer, np.asarray(bounds, dtype=np.int64))

    def read_spans_into_sync(
        self,
        starts: npt.NDArray[np.int64],
        stops: npt.NDArray[np.int64],
        out: Array,
        at: npt.NDArray[np.int64],
    ) -> None:
        if self._tokens is None:
            raise RuntimeError(f"{self!r} is not open; call `await storage.open()` first")
        self._tokens.spans_into(starts, stops, out.reshape(-1), at.tolist())
