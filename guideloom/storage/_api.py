"""The public entry points for writing and opening datasets, dispatched on the location."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Unpack
from urllib.parse import unquote, urlparse

import numpy.typing as npt

from guideloom.storage._format._manifest import Manifest
from guideloom.storage._local._check import read_local_manifest
from guideloom.storage._local._storage import LocalDocumentStorage, LocalStreamStorage
from guideloom.storage._write._sinks import LocalSink, Sink
from guideloom.storage._write._writer import DEFAULT_SHARD_BYTES, write_documents_to, write_stream_to
from guideloom.storage.base import DocumentStorageAbstract, StreamStorageAbstract
from guideloom.types import OpenOptions, WriteOptions

__all__ = ["open_documents", "open_stream", "verify_dataset", "write_documents", "write_stream"]

Location = str | os.PathLike[str]
_REMOTE_SCHEMES = ("s3", "gs", "gcs", "az", "azure", "abfs", "abfss", "http", "https")


def local_folder(location: Location) -> Path | None:
    """The local folder a location names, or None for an object-store URL."""
    if not isinstance(location, str):
        return Path(os.fspath(location)).expanduser()
    parsed = urlparse(location)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL {location!r} names a remote host; use file:///path")
        return Path(unquote(parsed.path))
    if parsed.scheme.lower() in _REMOTE_SCHEMES:
        return None
    if parsed.scheme and len(parsed.scheme) > 1:
        raise ValueError(
            f"unsupported location {location!r}: use a local path, file://, s3://, gs://, az:// or http(s)://"
        )
    return Path(location).expanduser()


def _remote() -> Any:
    from guideloom.storage._remote import (
        _storage as remote,  # imported lazily: object-store support is optional
    )

    return remote


def _sink(destination: Location, options: Mapping[str, Any]) -> Sink:
    """Where a writer writes: a local folder, or an object-store prefix configured by ``options``."""
    folder = local_folder(destination)
    if folder is None:
        remote_sink: Sink = _remote().sink_for(str(destination), **options)
        return remote_sink
    if options:
        raise TypeError(f"unexpected options for a local destination: {sorted(options)}")
    return LocalSink(folder)


def write_stream(
    destination: Location,
    chunks: npt.ArrayLike | Iterable[npt.ArrayLike],
    *,
    dtype: Any = None,
    metadata: Mapping[str, npt.ArrayLike | Iterable[npt.ArrayLike]] | None = None,
    metadata_dtypes: Mapping[str, Any] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    info: Mapping[str, Any] | None = None,
    progress: Callable[[int], object] | None = None,
    **options: Unpack[WriteOptions],
) -> Manifest:
    """Write a stream dataset: the concatenation of ``chunks`` (an array or an iterable of 1-D arrays).

    ``dtype`` defaults to the first chunk's; every value must fit it exactly (floats for an
    integer dtype: whole numbers below ``2**53`` in magnitude, or pass integers). ``metadata`` maps
    field names to arrays (or iterables of chunks) as long as the stream; samples of such a
    stream are dicts. Data files are at most ``shard_bytes`` each; the manifest is written last
    and atomically. An existing dataset is replaced only with ``overwrite=True``. ``info`` is a
    JSON-serialisable dict stored in the manifest; it is copied when the manifest is built, after
    the last chunk, so a caller may fill in counts while the chunks are produced. ``progress`` is
    called with the number of elements of each token chunk written. ``options`` configure an
    object-store destination (credentials, endpoint). Returns the manifest.
    """
    sink = _sink(destination, options)
    return write_stream_to(
        sink,
        chunks,
        dtype=dtype,
        metadata=metadata,
        metadata_dtypes=metadata_dtypes,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        info=info,
        progress=progress,
    )


def write_documents(
    destination: Location,
    documents: Iterable[npt.ArrayLike],
    *,
    dtype: Any = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    info: Mapping[str, Any] | None = None,
    progress: Callable[[int], object] | None = None,
    **options: Unpack[WriteOptions],
) -> Manifest:
    """Write a document dataset, one document per 1-D array, in order. See :func:`write_stream`."""
    sink = _sink(destination, options)
    return write_documents_to(
        sink,
        documents,
        dtype=dtype,
        shard_bytes=shard_bytes,
        overwrite=overwrite,
        info=info,
        progress=progress,
    )


def _folder_or_remote(source: Location, options: Mapping[str, Any]) -> Path | None:
    """The local folder of ``source``, or None for an object store (which ``options`` configure:
    a local dataset takes none)."""
    folder = local_folder(source)
    if folder is not None and options:
        raise TypeError(f"unexpected options for a local dataset: {sorted(options)}")
    return folder


def open_stream(source: Location, **options: Unpack[OpenOptions]) -> StreamStorageAbstract[Any, Any]:
    """Open a written stream dataset; its manifest is read and checked against the files now.

    ``options`` configure an object store (:class:`~guideloom.types.OpenOptions`). Raises
    ``FileNotFoundError`` when there is no dataset, and :class:`DatasetFormatError` /
    :class:`DatasetIntegrityError` when the manifest or files are not a valid dataset.
    """
    folder = _folder_or_remote(source, options)
    if folder is None:
        storage: StreamStorageAbstract[Any, Any] = _remote().open_stream(str(source), **options)
        return storage
    return LocalStreamStorage(folder, read_local_manifest(folder))


def open_documents(source: Location, **options: Unpack[OpenOptions]) -> DocumentStorageAbstract[Any, Any]:
    """Open a written document dataset. See :func:`open_stream`."""
    folder = _folder_or_remote(source, options)
    if folder is None:
        storage: DocumentStorageAbstract[Any, Any] = _remote().open_documents(str(source), **options)
        return storage
    return LocalDocumentStorage(folder, read_local_manifest(folder))


def verify_dataset(
    source: Location,
    *,
    progress: Callable[[int], object] | None = None,
    add_block_digests: bool = False,
    **options: Unpack[OpenOptions],
) -> Manifest:
    """Re-read every data file of a dataset and check its checksum (and block digests) against
    the manifest.

    ``progress`` is called with the bytes of each block read; ``add_block_digests``: a dataset
    written without block digests gets them once every file matched its checksum (their files,
    then the manifest, replaced atomically); the manifest returned is the one on disk after.
    ``options`` configure an object store as for :func:`open_stream`.
    """
    folder = _folder_or_remote(source, options)
    if folder is None:
        verified: Manifest = _remote().verify_dataset(
            str(source), progress=progress, add_block_digests=add_block_digests, **options
        )
        return verified
    from guideloom.storage._format._verify import verify_local

    return verify_local(
        folder, read_local_manifest(folder), progress=progress, add_block_digests=add_block_digests
    )


def check_dataset_blocks(source: str | os.PathLike[str], **options: Any) -> int:
    """Check every block of every data file of a dataset (a folder or URL) against its digest,
    sidecars included; returns the number of blocks checked. :class:`DatasetIntegrityError`
    names the first file and block that does not match; a file without block digests is
    checked by its sha256 instead. The internal API a corruption fuzzer relies on."""
    from guideloom.storage._format._verify import verify_local

    folder = _folder_or_remote(source, options)
    if folder is None:
        manifest = _remote().verify_dataset(str(source), sha256=False, **options)
    else:
        from guideloom.storage._local._check import read_local_manifest

        manifest = verify_local(folder, read_local_manifest(folder), sha256=False)
    return sum(
        -(-f.nbytes // f.blocks.size) if f.blocks is not None else 0 for _, _, f in manifest.all_files()
    )
