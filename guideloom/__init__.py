"""guideloom: an asyncio-native, stateful, rank-aware data loader for PyTorch training jobs."""

from __future__ import annotations

from guideloom._core.audit import AuditReport
from guideloom._datasets import (
    DatasetAbstract,
    DocumentDataset,
    MapDataset,
    Mixture,
    PackedDataset,
    PackedRows,
    ReadHints,
    StreamDataset,
    WeightSchedule,
    mix,
    pack,
)
from guideloom._errors import (
    DatasetFormatError,
    DatasetIntegrityError,
    GuideloomError,
    RemoteReadError,
    StorageError,
    WorkerError,
)
from guideloom.pytorch import StatefulDataLoader
from guideloom.storage import (
    DocumentStorageAbstract,
    MemoryDocumentStorage,
    MemoryStreamStorage,
    ParquetStorage,
    StreamStorageAbstract,
    open_documents,
    open_parquet,
    open_stream,
    verify_dataset,
    write_documents,
    write_stream,
)
from guideloom.storage._write._ray_write import ray_datasink, write_ray_dataset
from guideloom.types import StatefulDataLoaderStateDict

__version__ = "0.1.0"

__all__ = [
    "AuditReport",
    "DatasetAbstract",
    "DatasetFormatError",
    "DatasetIntegrityError",
    "DocumentDataset",
    "DocumentStorageAbstract",
    "GuideloomError",
    "MapDataset",
    "MemoryDocumentStorage",
    "MemoryStreamStorage",
    "Mixture",
    "PackedDataset",
    "PackedRows",
    "ParquetStorage",
    "ReadHints",
    "RemoteReadError",
    "StatefulDataLoader",
    "StatefulDataLoaderStateDict",
    "StorageError",
    "StreamDataset",
    "StreamStorageAbstract",
    "WeightSchedule",
    "WorkerError",
    "__version__",
    "mix",
    "open_documents",
    "open_parquet",
    "open_stream",
    "pack",
    "ray_datasink",
    "verify_dataset",
    "write_documents",
    "write_ray_dataset",
    "write_stream",
]
