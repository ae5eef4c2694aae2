"""Parquet files read where they lie: a document storage over the rows of one or many files.

:func:`open_parquet` takes a folder, a glob, one file or a list of them, local or on an object
store, and reads the files' footers only (in parallel): how many rows each row group holds, where
its column chunks lie. Row ``i`` of the files concatenated (in sorted path order) is document
``i``. A read decodes the row groups its rows lie in, each whole and once, and keeps decoded row
groups up to ``max_decoded_bytes`` (those the loader's upcoming reads use first, the others least
recently used first out), so a row-group-aware shuffle (the loader's ``shuffle_block_size="auto"``)
decodes each row group once per visit. Over an object store, the row groups of the loader's
upcoming reads (:meth:`ParquetStorage.will_read`) are fetched and decoded ahead, ``fetch_ahead``
ranged GETs at once, within the same bytes.

A ``list<int>`` column (pre-tokenized) yields a 1-D array per row, a view of the decoded values
(no Python object per element); a string column yields its text, or token arrays with
``tokenizer=``. Under a loader, the texts are tokenized where batches are collated (see
:meth:`ParquetStorage.deferred_step`); under :func:`~guideloom.pack` or a mixture, at read.

What the storage checks: each file's size and version (modification time; an object's ETag)
against what its footer was read with (a changed file is refused at its next read; over an
object store every read is conditional on the version), each footer, the column's presence and
kind in every file, and each decoded row group. A null row is an error by default
(``on_null="error"``, naming the file, row group, column and row); ``on_null="empty"`` reads it
as an empty document and counts it (``stats()``'s ``parquet_null_rows``). An empty text or list
"""

from guideloom.storage._parquet._open import open_parquet, parquet_columns
from guideloom.storage._parquet._options import (
    DEFAULT_DECODED_BYTES,
    DEFAULT_FETCH_AHEAD,
    ParquetOptions,
    ParquetSettings,
)
from guideloom.storage._parquet._rowgroups import RELEASE_EVERY_BYTES
from guideloom.storage._parquet._storage import ParquetStorage

__all__ = [
    "DEFAULT_DECODED_BYTES",
    "DEFAULT_FETCH_AHEAD",
    "RELEASE_EVERY_BYTES",
    "ParquetOptions",
    "ParquetSettings",
    "ParquetStorage",
    "open_parquet",
    "parquet_columns",
]
