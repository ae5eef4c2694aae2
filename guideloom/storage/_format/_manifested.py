"""What the storages of a *written* dataset share, whatever the backend: a manifest."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._errors import DatasetFormatError
from guideloom.storage._format._manifest import Kind, Manifest
from guideloom.storage.base import DocumentStorageAbstract, StreamStorageAbstract

__all__ = ["ManifestDocumentStorage", "ManifestStreamStorage", "check_kind"]

Array = npt.NDArray[Any]


def check_kind(manifest: Manifest, kind: Kind, location: str) -> None:
    """Refuse a dataset of the other kind, naming the function that opens it."""
    if manifest.kind != kind:
        opener = "open_documents()" if manifest.kind == "documents" else "open_stream()"
        raise DatasetFormatError(f"{location} holds a {manifest.kind} dataset; open it with {opener}")


class _Written:
    """What both kinds take from the manifest: the dtype, the location, the repr."""

    manifest: Manifest

    @property
    def location(self) -> str:
        """Where the dataset lives (a path, or a URL without credentials)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r}, len={len(self)}, dtype={self.dtype})"  # type: ignore[arg-type]

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.manifest.dtype

    def content_digest(self) -> str:
        return self.manifest.digest()

    def _written_manifest(self) -> Manifest:
        return self.manifest

    def locate(self, start: int, stop: int) -> list[list[Any]]:
        """The shard files of ``tokens`` holding elements ``[start, stop)``, with byte ranges
        (a shard is its elements back to back)."""
        out: list[list[Any]] = []
        itemsize = self.dtype.itemsize
        first = 0
        for f in self.manifest.tokens.files:
            end = first + f.elements
            lo, hi = max(start, first), min(stop, end)
            if hi > lo:
                out.append(
                    [
                        f"{self.location.rstrip('/')}/{f.path}",
                        (lo - first) * itemsize,
                        (hi - first) * itemsize,
                    ]
                )
            if end >= stop:
                break
            first = end
        return out


class ManifestStreamStorage(_Written, StreamStorageAbstract[Array, Any]):
    """A written stream dataset: sizes and fields come from its manifest."""

    def __len__(self) -> int:
        return self.manifest.num_elements

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(n for n in self.manifest.fields if n != "tokens")

    def sample_nbytes_hint(self) -> int:
        return sum(s.dtype.itemsize for s in self.manifest.fields.values())


class ManifestDocumentStorage(_Written, DocumentStorageAbstract[Array, Array]):
    """A written document dataset: sizes come from its manifest."""

    def __len__(self) -> int:
        return self.manifest.num_documents

    def sample_nbytes_hint(self) -> int:
        """The average document's size, which sizes the loader's read-ahead windows."""
        n = max(1, self.manifest.num_documents)
        return max(1, self.manifest.num_elements * self.dtype.itemsize // n)
