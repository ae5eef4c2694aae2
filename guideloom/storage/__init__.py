"""Storage: where samples come from and how datasets are written.

The public face is small: the functions that open, write and verify a dataset, the two abstract
interfaces every backend implements, and the in-memory storages. Backends (local files, object
stores), the manifest, range planning, retries, the whole copy and the chunk cache are private
modules of this package.
"""

from __future__ import annotations

from guideloom.storage._api import open_documents, open_stream, verify_dataset, write_documents, write_stream
from guideloom.storage._memory import MemoryDocumentStorage, MemoryStreamStorage
from guideloom.storage._parquet import ParquetOptions, ParquetStorage, open_parquet
from guideloom.storage.base import (
    DocumentStorageAbstract,
    Rows,
    Spans,
    StorageAbstract,
    StreamStorageAbstract,
)

__all__ = [
    "DocumentStorageAbstract",
    "MemoryDocumentStorage",
    "MemoryStreamStorage",
    "ParquetOptions",
    "ParquetStorage",
    "Rows",
    "Spans",
    "StorageAbstract",
    "StreamStorageAbstract",
    "open_documents",
    "open_parquet",
    "open_stream",
    "verify_dataset",
    "write_documents",
    "write_stream",
]
