"""guideloom's exceptions, in one place.

Errors about the caller's arguments are the built-in ``ValueError`` / ``TypeError``, and a missing
dataset is ``FileNotFoundError``, as Python users expect. What is specific to guideloom derives
from :class:`GuideloomError`::

    GuideloomError
     ├── DatasetFormatError (also ValueError)   a manifest or data file that is not a valid dataset
     │    └── DatasetIntegrityError             files that do not match their manifest
     ├── StorageError (also OSError)            a storage backend failed to read or write
     │    └── RemoteReadError                   an object-store range read failed after retries
     └── WorkerError (also RuntimeError)        a worker process died without an exception

Exceptions raised by ``collate_fn`` or by a storage are re-raised unchanged (their own type) at
the consumer; the classes here are for failures guideloom itself detects.
"""

from __future__ import annotations

__all__ = [
    "DatasetFormatError",
    "DatasetIntegrityError",
    "GuideloomError",
    "RemoteReadError",
    "StorageError",
    "WorkerError",
]


class GuideloomError(Exception):
    """Base class of the errors guideloom raises itself."""


class DatasetFormatError(GuideloomError, ValueError):
    """A dataset's manifest or layout is not one guideloom can read."""


class DatasetIntegrityError(DatasetFormatError):
    """A dataset's files do not match its manifest (size, checksum or name)."""


class StorageError(GuideloomError, OSError):
    """A storage backend could not read or write."""


class RemoteReadError(StorageError):
    """An object-store read failed after its retries were exhausted."""


class WorkerError(GuideloomError, RuntimeError):
    """A worker died without reporting an exception (killed, out of memory, ...)."""
