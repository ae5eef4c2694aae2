"""Where the writers put a dataset: the :class:`Sink` protocol, a local folder, an object store.

Both sinks follow the same order: data files first (fresh names, so a failed overwrite leaves the
previous dataset readable), the manifest last and atomically, then the replaced dataset's files
are deleted. The object sink imports obstore only when it is used; its errors carry scrubbed
messages and are raised outside the handler that caught obstore's, so no credential is chained.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import IO, Any, Protocol, cast

from guideloom._errors import DatasetFormatError
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest, read_manifest_file
from guideloom.storage._remote._locations import parse_location
from guideloom.storage._remote._objstore import make_store
from guideloom.storage._remote._options import map_error, secret_values, split_options

__all__ = ["LocalSink", "ObjectSink", "Sink", "fsync_dir", "write_synced"]


def write_synced(path: Path, data: bytes) -> None:
    """Write ``path`` whole and fsync it: on disk before whatever rename publishes it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a folder: the names created or renamed in it are on disk too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Sink(Protocol):
    """A place a dataset is written to (a local folder, an object-store prefix)."""

    write_id: str

    def describe(self) -> str: ...
    def prepare(self, *, overwrite: bool) -> Manifest | None: ...
    def open_file(self, relpath: str) -> IO[bytes]: ...
    def discard_file(self, fh: IO[bytes]) -> None:
        """Give up a file :meth:`open_file` opened, unfinished (a local file is closed and later
        removed by :meth:`abort`; an upload is dropped, so the object never appears)."""

    def commit(self, manifest: Manifest, replaced: Manifest | None) -> None: ...
    def abort(self, written: list[str]) -> None: ...


class LocalSink:
    """Where the writers put a local dataset: data files first, the manifest last and atomically."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.write_id = secrets.token_hex(4)

    def describe(self) -> str:
        return str(self.folder)

    def prepare(self, *, overwrite: bool) -> Manifest | None:
        """Create the folder; return the manifest being replaced (None if there is none)."""
        if self.folder.exists() and not self.folder.is_dir():
            raise FileExistsError(f"{self.folder} exists and is not a folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / MANIFEST_NAME
        if not path.exists():
            return None
        if not overwrite:
            raise FileExistsError(
                f"a dataset already exists at {self.folder}; pass overwrite=True to replace it"
            )
        try:
            return Manifest.from_json_bytes(read_manifest_file(path), source=str(self.folder))
        except DatasetFormatError:
            return None

    def open_file(self, relpath: str) -> IO[bytes]:
        return open(self.folder / relpath, "wb")

    def discard_file(self, fh: IO[bytes]) -> None:
        fh.close()  # abort() removes it

    def commit(self, manifest: Manifest, replaced: Manifest | None) -> None:
        """Write the manifest atomically, then remove the files of the dataset it replaced."""
        tmp = self.folder / f".{MANIFEST_NAME}.{self.write_id}.tmp"
        write_synced(tmp, manifest.to_json_bytes())
        os.replace(tmp, self.folder / MANIFEST_NAME)
        fsync_dir(self.folder)
        if replaced is not None:
            keep = manifest.stored_paths()
            for old in replaced.stored_paths() - keep:
                (self.folder / old).unlink(missing_ok=True)

    def abort(self, written: list[str]) -> None:
        """Remove the data files of a write that failed (the previous dataset stays intact)."""
        for relpath in written:
            (self.folder / relpath).unlink(missing_ok=True)


class _UploadFile:
    """A write-only file that uploads one object (multipart once it outgrows one part)."""

    def __init__(self, sink: ObjectSink, relpath: str) -> None:
        import obstore

        self._sink, self.name = sink, relpath
        self._writer: Any = obstore.open_writer(
            sink.store,
            relpath,
            buffer_size=sink.wopts.part_size,
            max_concurrency=sink.wopts.max_upload_concurrency,
        )
        self.closed = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.closed or self._writer is None:
            raise ValueError("write to a closed upload")
        try:
            return int(self._writer.write(data))
        except Exception as exc:
            error = self._sink.error(exc, f"uploading {self._sink.loc.object_url(self.name)}")
        raise error

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        writer, self._writer = self._writer, None
        try:
            writer.close()
        except Exception as exc:
            error = self._sink.error(exc, f"uploading {self._sink.loc.object_url(self.name)}")
        else:
            return
        finally:
            self._sink.uploads.pop(self.name, None)
        raise error

    def discard(self) -> None:
        """Drop the upload unfinished: the object never appears."""
        self.closed = True
        self._writer = None

    def __enter__(self) -> _UploadFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ObjectSink:
    """Where the writers put an object-store dataset: data objects first, ``manifest.json`` last."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.loc = parse_location(url)
        if self.loc.kind == "http":
            raise ValueError(
                f"{self.loc.display}: http(s) locations are read-only; write the dataset to a local "
                "folder, s3://, gs:// or az:// and serve that"
            )
        _r, self.wopts, config, client = split_options(options, write=True)
        self.secrets = secret_values(config, url)
        self.store: Any = make_store(self.loc, config, client, self.wopts.policy, obstore_retries=True)
        self.write_id = secrets.token_hex(4)
        self.uploads: dict[str, _UploadFile] = {}

    def __repr__(self) -> str:
        return f"ObjectSink({self.loc.display!r})"

    def describe(self) -> str:
        return self.loc.display

    def error(self, exc: Exception, what: str) -> Exception:
        """``exc`` as a scrubbed error; the caller raises it outside its ``except`` block."""
        return map_error(exc, what, self.secrets)

    def prepare(self, *, overwrite: bool) -> Manifest | None:
        """Refuse an existing dataset unless ``overwrite``; return the manifest being replaced."""
        import obstore

        try:
            data = bytes(obstore.get(self.store, MANIFEST_NAME).bytes())
        except FileNotFoundError:
            return None
        except Exception as exc:
            error = self.error(exc, f"cannot read {self.loc.object_url(MANIFEST_NAME)}")
        else:
            if not overwrite:
                raise FileExistsError(
                    f"a dataset already exists at {self.loc.display}; pass overwrite=True to replace it"
                )
            try:
                return Manifest.from_json_bytes(data, source=self.loc.display)
            except DatasetFormatError:
                return None
        raise error

    def open_file(self, relpath: str) -> IO[bytes]:
        f = _UploadFile(self, relpath)
        self.uploads[relpath] = f
        return cast(IO[bytes], f)

    def discard_file(self, fh: IO[bytes]) -> None:
        cast(_UploadFile, fh).discard()

    def commit(self, manifest: Manifest, replaced: Manifest | None) -> None:
        """Put the manifest (one atomic PUT), then delete the objects of the dataset it replaced."""
        import obstore

        try:
            obstore.put(self.store, MANIFEST_NAME, manifest.to_json_bytes(), use_multipart=False)
        except Exception as exc:
            error = self.error(exc, f"writing {self.loc.object_url(MANIFEST_NAME)}")
        else:
            if replaced is not None:
                self._delete(sorted(replaced.stored_paths() - manifest.stored_paths()))
            return
        raise error

    def _delete(self, paths: list[str]) -> None:
        import obstore

        for path in paths:
            try:
                obstore.delete(self.store, path)
            except Exception:
                pass  # best effort (or already gone): an unreferenced object is harmless

    def abort(self, written: list[str]) -> None:
        """Discard unfinished uploads and delete the objects of a failed write."""
        for f in list(self.uploads.values()):
            f.discard()
        self.uploads.clear()
        self._delete(list(written))
