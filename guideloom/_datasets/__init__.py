"""Datasets: observation ``i`` to sample, over a storage or any random-access source.

Each dataset answers for itself: its length, its batched reads and how the loader reads them
(``read_hints``), and, for a mixture, its own epoch order; guideloom's own datasets also answer
internal hooks (whether reads can run in the caller's thread, the checkpoint fingerprint).
"""

from __future__ import annotations

from typing import Any

from guideloom._datasets.base import DatasetAbstract, ReadHints, SourceT
from guideloom._datasets.documents import DocumentDataset
from guideloom._datasets.map import MapDataset
from guideloom._datasets.mixture import Mixture, WeightSchedule, mix
from guideloom._datasets.packing import PackedDataset, PackedRows, pack
from guideloom._datasets.stream import StreamDataset
from guideloom.storage.base import DocumentStorageAbstract, StreamStorageAbstract

__all__ = [
    "DatasetAbstract",
    "DocumentDataset",
    "MapDataset",
    "Mixture",
    "PackedDataset",
    "PackedRows",
    "ReadHints",
    "SourceT",
    "StreamDataset",
    "WeightSchedule",
    "dataset_for",
    "mix",
    "pack",
]


def dataset_for(storage: Any, sequence_length: int | None) -> DatasetAbstract[Any]:
    """The dataset that wraps ``storage``: a :class:`StreamDataset` of ``sequence_length``
    samples for stream storage (which needs one), a :class:`DocumentDataset` for document
    storage (which takes none). A dataset (a mixture) is taken as it is; a mixture's stream
    sources without a sequence length of their own take ``sequence_length``."""
    if isinstance(storage, DatasetAbstract):
        if isinstance(storage, Mixture):
            return storage.with_sequence_length(sequence_length)
        if sequence_length is not None:
            raise ValueError(
                f"{type(storage).__name__} is a dataset, which has its own sample rule and takes "
                f"no sequence_length (got {sequence_length}); drop the argument"
            )
        return storage
    if isinstance(storage, StreamStorageAbstract):
        if sequence_length is None:
            raise ValueError(
                "stream storage needs sequence_length: pass sequence_length=<elements per sample>"
            )
        return StreamDataset(storage, sequence_length)
    if isinstance(storage, DocumentStorageAbstract):
        if sequence_length is not None:
            raise ValueError(
                "document storage yields one whole document per sample and takes no "
                f"sequence_length (got {sequence_length}); drop the argument"
            )
        return DocumentDataset(storage)
    raise TypeError(
        "storage must be a StreamStorageAbstract or DocumentStorageAbstract (for example "
        f"MemoryStreamStorage, or what open_stream() returns) or a mixture from mix(), got "
        f"{type(storage).__name__}"
    )
