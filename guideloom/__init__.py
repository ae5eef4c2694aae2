"""guideloom: an asyncio-native, stateful, rank-aware data loader for PyTorch training jobs."""

from __future__ import annotations

from ._datasets import DatasetAbstract, DocumentDataset, MapDataset, StreamDataset
from ._errors import (
    DatasetFormatError,
    DatasetIntegrityError,
    GuideloomError,
    RemoteReadError,
    StorageError,
    WorkerError,
)
from ._mixture import Mixture, mix
from ._packing import PackedDataset, PackedRows, pack
from ._storage.api import open_documents, open_stream, verify_dataset, write_documents, write_stream
from ._storage.base import DocumentStorageAbstract, StreamStorageAbstract
from ._storage.memory import MemoryDocumentStorage, MemoryStreamStorage
from .pytorch import StatefulDataLoader
from .types import StatefulDataLoaderStateDict

__version__ = "0.1.0"

__all__ = [
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
    "RemoteReadError",
    "StatefulDataLoader",
    "StatefulDataLoaderStateDict",
    "StorageError",
    "StreamDataset",
    "StreamStorageAbstract",
    "WorkerError",
    "__version__",
    "mix",
    "open_documents",
    "open_stream",
    "pack",
    "verify_dataset",
    "write_documents",
    "write_stream",
]
