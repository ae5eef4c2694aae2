"""The Parquet files themselves: what ``source`` names (a folder, a glob, a file or a list,
local or on one store prefix, resolved to files in sorted path order, hidden names skipped as
pyarrow, Spark and Hugging Face skip them); local files, or objects of a store read by ranges;
their footers, checked and digested; pyarrow imported lazily (without jemalloc's background
thread)."""

from __future__ import annotations

import fnmatch
import glob as globlib
import hashlib
import importlib
import io
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError, DatasetIntegrityError, RemoteReadError

_REMOTE_SCHEMES = ("s3", "gs", "gcs", "az", "azure", "abfs", "abfss", "http", "https")
_FOOTER_GUESS = 64 * 1024  # bytes read from an object's end first: most footers fit


_JEMALLOC_CONF = "JE_ARROW_MALLOC_CONF"

#: Rows of a text row group decoded at a time: arrow's working memory is then a slice's, not
#: the whole row group's (decoding a 6 MB row group of prose at once raised the process's peak
#: by 30-50 MiB in arrow's allocator, its pages given back only after the decode).
TEXT_BATCH_ROWS = 256


def _import(name: str) -> Any:
    """``name`` imported; pyarrow's first import without its bundled jemalloc's background
    thread: pyarrow's default pool is another allocator here, and that named thread would keep
    process workers from being forked from the main process (sharing its pages) for as long as
    the process lives. ``JE_ARROW_MALLOC_CONF`` says so for the import only (jemalloc reads it
    then), unless the user set it: the process's environment is left as it was."""
    if "pyarrow" in sys.modules or _JEMALLOC_CONF in os.environ:
        return importlib.import_module(name)
    os.environ[_JEMALLOC_CONF] = "background_thread:false"
    try:
        return importlib.import_module(name)
    finally:
        os.environ.pop(_JEMALLOC_CONF, None)


def _pq() -> Any:
    try:
        return _import("pyarrow.parquet")
    except ImportError as exc:  # the extra is missing
        raise ImportError("open_parquet needs pyarrow: pip install 'guideloom[parquet]'") from exc


def _pa() -> Any:
    return _import("pyarrow")


def _is_remote(location: str) -> bool:
    scheme = location.split("://", 1)[0].lower() if "://" in location else ""
    return scheme in _REMOTE_SCHEMES


def _has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


# -- the files: local, or objects of a store --------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Stat:
    size: int
    version: str  # local: modification time in ns; an object: its ETag (or modification time)


class _LocalFiles:
    """Local files: ``os.stat`` for versions, ``pyarrow.parquet`` reading by path."""

    remote = False

    def __init__(self) -> None:
        self._ctimes: dict[str, int] = {}  # each file's status change time when first seen

    def stat(self, path: str) -> _Stat:
        """A write since the file was first seen is another version, its modification time kept or not."""
        st = os.stat(path)
        first = self._ctimes.setdefault(path, st.st_ctime_ns)
        return _Stat(
            st.st_size, str(st.st_mtime_ns) + ("" if st.st_ctime_ns == first else f"+{st.st_ctime_ns}")
        )

    def stats(self, paths: Sequence[str]) -> dict[str, _Stat]:
        return {p: self.stat(p) for p in paths}

    def check_unchanged(self, path: str, opened: _Stat) -> None:
        """Refuse file ``path`` where it is gone or another version than ``opened``."""
        try:
            now = self.stat(path)
        except FileNotFoundError:
            raise DatasetIntegrityError(f"{path}: the file is gone since the dataset was opened") from None
        if now != opened:
            raise DatasetIntegrityError(
                f"{path}: the file changed since the dataset was opened (size {opened.size} -> "
                f"{now.size} bytes, or its modification time); open it again (a checkpoint made "
                "over the old files is refused)"
            )

    def footer(self, path: str, size: int) -> tuple[Any, str]:
        """The file's footer, parsed, and the digest of its bytes (what identifies the file
        beside its size and modification time)."""
        with open(path, "rb") as f:
            f.seek(max(0, size - 8))
            end = f.read(8)
            length = _footer_length(path, size, end)
            start = max(0, size - max(length + 8, _FOOTER_GUESS))  # what pyarrow reads first
            f.seek(start)
            tail = f.read(size - start)
        return _parsed_footer(size, start, tail)

    def reader(self, path: str, metadata: Any) -> Any:
        # pages written with a checksum are checked against it: a damaged page is refused
        return _pq().ParquetFile(path, metadata=metadata, pre_buffer=False, page_checksum_verification=True)

    def read_group(self, path: str, reader: Any, group: int, columns: list[str], chunks: Any) -> Any:
        return reader.read_row_group(group, columns=columns, use_threads=False)

    def read_batches(
        self, path: str, reader: Any, group: int, columns: list[str], chunks: Any
    ) -> Iterator[Any]:
        """The row group's columns as record batches of :data:`TEXT_BATCH_ROWS` rows, each
        decoded as it is taken."""
        batches: Iterator[Any] = reader.iter_batches(
            TEXT_BATCH_ROWS, row_groups=[group], columns=columns, use_threads=False
        )
        return batches

    def name(self, path: str) -> str:
        return path


def _footer_length(shown: str, size: int, end: bytes) -> int:
    """The footer's length from a file's last 8 bytes; a file too short, without Parquet's magic
    bytes at its end or with a footer longer than itself is refused, named."""
    if size < 12 or len(end) < 8:
        raise DatasetFormatError(
            f"{shown}: damaged or not a Parquet file: {plural(size, 'byte')} is too short to be one"
        )
    if end[-4:] != b"PAR1":
        raise DatasetFormatError(
            f"{shown}: damaged or not a Parquet file: the file does not end with Parquet's magic bytes "
            "(truncated, or not a Parquet file)"
        )
    length = int.from_bytes(end[-8:-4], "little")
    if length + 12 > size:
        raise DatasetFormatError(
            f"{shown}: damaged or not a Parquet file: its footer length {length} exceeds the file's size"
        )
    return length


def _parsed_footer(size: int, start: int, tail: bytes) -> tuple[Any, str]:
    """A footer's metadata, parsed from ``tail`` (the file's bytes from ``start`` to its end),
    and the digest of its bytes (the footer and its length: what identifies the file's layout
    and its row groups' places)."""
    length = int.from_bytes(tail[-8:-4], "little")
    digest = hashlib.sha256(memoryview(tail)[len(tail) - length - 8 :]).hexdigest()[:32]
    return _pq().read_metadata(_SparseFile(size, {start: tail})), digest


class _SparseFile(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only some ranges were fetched: what pyarrow
    reads a footer and a row group's column chunks from (a read outside them is a bug here)."""

    def __init__(self, size: int, pieces: dict[int, Any]) -> None:
        super().__init__()
        self._size, self._pos = size, 0
        self._pieces = sorted((start, memoryview(data).cast("B")) for start, data in pieces.items())

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        for start, data in self._pieces:
            if start <= self._pos and self._pos + want <= start + len(data):
                at = self._pos - start
                memoryview(buffer).cast("B")[:want] = data[at : at + want]
                self._pos += want
                return want
        raise OSError(f"bytes {self._pos}-{self._pos + want - 1} were not fetched")


class _RemoteFiles:
    """Objects of one store prefix, read by ranges through guideloom's object-store connection
    (retries, scrubbed errors, reads conditional on the version the footer was read from)."""

    remote = True

    def check_unchanged(self, path: str, opened: _Stat) -> None:
        """Nothing to look at: every range read of an object is conditional on its version."""

    def __init__(self, prefix_url: str, options: dict[str, Any]) -> None:
        self.prefix_url, self.options = prefix_url, options
        self._conn: Any = None
        self._tails: dict[str, tuple[int, bytes]] = {}  # each footer's bytes, as fetched
        #: Each object's version as first seen: every read is conditional on it, in a process
        #: worker's copy too.
        self.versions: dict[str, Any] = {}
        #: Objects found changed since they were opened, and what their reads say (every later
        #: read of one is refused).
        self.refused: dict[str, str] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {
            "prefix_url": self.prefix_url,
            "options": self.options,
            "_conn": None,
            "_tails": {},
            "versions": self.versions,
            "refused": self.refused,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def conn(self) -> Any:
        if self._conn is None:
            from guideloom.storage._remote._client import Remote

            self._conn = Remote(self.prefix_url, dict(self.options))
            self._conn.versions.update(self.versions)
        return self._conn

    def fetch(self, path: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of object ``path``, a GET conditional on the version it was
        opened with, with the connection's retries. A read that fails after them (a short answer
        again and again) is a :class:`~guideloom.RemoteReadError` naming the object and the
        range, not a damaged file; an object changed or gone since it was opened is a
        :class:`DatasetIntegrityError` naming it (and every later read of it is refused)."""
        from guideloom.storage._remote._objstore import call_with_retries, get_checked

        known = self.refused.get(path)
        if known is not None:
            raise DatasetIntegrityError(known)
        conn = self.conn
        store, version = conn.store(), self.versions.get(path)

        def get() -> Any:
            conn.counters.requests += 1
            return get_checked(store, path, start, end, version)

        error: Exception
        try:
            data = call_with_retries(get, conn.policy)
        except Exception as exc:
            error = self._failed(path, start, end, exc)
        else:
            conn.counters.bytes_read += end - start
            return data
        raise error  # outside the handler: the store's error (and what its text holds) is not kept

    def _failed(self, path: str, start: int, end: int, exc: Exception) -> Exception:
        """The error a read of ``path`` that failed with ``exc`` (after its retries) ends with."""
        import obstore.exceptions as oe

        from guideloom.storage._remote._objstore import ObjectChangedError
        from guideloom.storage._remote._options import map_error, obstore_message

        if isinstance(exc, ObjectChangedError | oe.PreconditionError | FileNotFoundError | oe.NotFoundError):
            message = self.refused[path] = self._changed(path)
            return DatasetIntegrityError(message)
        what = f"reading {self.name(path)} bytes {start}-{end - 1}"
        mapped = map_error(exc, what, self.conn.secrets)
        if isinstance(mapped, FileNotFoundError | PermissionError):
            return mapped
        why = obstore_message(exc, self.conn.secrets)
        return RemoteReadError(f"{what} failed after its retries: {why}")

    def _changed(self, path: str) -> str:
        """What a refused read of ``path`` says: how the object differs from the one opened."""
        was = self.versions.get(path)
        opened = "" if was is None else f"; {_version_text(int(was.size), was.etag)} when opened"
        try:
            import obstore

            meta = obstore.head(self.conn.store(), path)
            now = f"{_version_text(int(meta['size']), meta.get('e_tag'))} now"
        except FileNotFoundError:
            now = "it is gone"
        except Exception:  # the store cannot say: the refusal stands
            now = "the store refused the read of that version"
        return (
            f"{self.name(path)}: the file changed on the object store since the Parquet files were "
            f"opened ({now}{opened}): none of its bytes are read; open the files again "
            "(a checkpoint made over the old files is refused)"
        )

    def listing(self) -> dict[str, _Stat] | None:
        listed = self.conn.list_sizes()
        if listed is None:
            return None
        self.versions.update(listed)
        self.conn.versions.update(listed)
        return {p: _Stat(v.size, v.etag or str(v.last_modified)) for p, v in listed.items()}

    def stats(self, paths: Sequence[str]) -> dict[str, _Stat]:
        found = self.conn.object_sizes(list(paths))
        self.versions.update(found)
        self.conn.versions.update(found)
        return {p: _Stat(v.size, v.etag or str(v.last_modified)) for p, v in found.items()}

    def footer(self, path: str, size: int) -> tuple[Any, str]:
        """The object's footer, parsed, and the digest of its bytes."""
        known = self._tails.get(path)
        if known is not None:  # fetched when the files were opened: parsed again, not fetched
            return _parsed_footer(size, *known)
        if size < 12:
            _footer_length(self.name(path), size, b"")  # refused: too short to be a Parquet file
        tail_start = max(0, size - _FOOTER_GUESS)
        tail = bytes(self.fetch(path, tail_start, size))
        length = _footer_length(self.name(path), size, tail[-8:])
        if length + 8 > len(tail):
            tail_start = size - length - 8
            tail = bytes(self.fetch(path, tail_start, size))
        self._tails[path] = (tail_start, tail)
        return _parsed_footer(size, tail_start, tail)

    def name(self, path: str) -> str:
        return f"{self.prefix_url.rstrip('/')}/{path}"

    def reader(self, path: str, metadata: Any) -> Any:
        return metadata

    def read_group(self, path: str, metadata: Any, group: int, columns: list[str], chunks: Any) -> Any:
        """One ranged GET of the row group's column chunks (conditional on the object's
        version), decoded beside the footer's bytes."""
        return self._fetched(path, metadata, chunks).read_row_group(group, columns=columns, use_threads=False)

    def read_batches(
        self, path: str, metadata: Any, group: int, columns: list[str], chunks: Any
    ) -> Iterator[Any]:
        """As :meth:`read_group`, decoded as record batches of :data:`TEXT_BATCH_ROWS` rows."""
        batches: Iterator[Any] = self._fetched(path, metadata, chunks).iter_batches(
            TEXT_BATCH_ROWS, row_groups=[group], columns=columns, use_threads=False
        )
        return batches

    def _fetched(self, path: str, metadata: Any, chunks: Any) -> Any:
        """A reader of the row group's column chunks, fetched in one ranged GET, beside the
        footer's bytes as they were when opened."""
        start, end = chunks
        data = self.fetch(path, start, end)
        size = int(self.versions[path].size)
        tail_start, tail = self._tails[path]
        pieces = {start: data, tail_start: tail}
        return _pq().ParquetFile(
            _SparseFile(size, pieces), metadata=metadata, page_checksum_verification=True
        )


def _version_text(size: int, etag: Any) -> str:
    return plural(size, "byte") + ("" if not etag else f", ETag {etag}")


# -- opening ------------------------------------------------------------------------------------------
def _hidden(parts: Sequence[str], patterns: Sequence[str] = ()) -> bool:
    """Whether a file whose path under the folder (or glob) it was found in has ``parts`` is
    skipped as pyarrow datasets, Spark and Hugging Face skip it: a file or folder whose name
    starts with ``_`` or ``.`` (Spark's ``_temporary/`` attempts, ``_SUCCESS``, ``.hidden``
    files). A name a pattern's own part asks for (``_*``, ``.cache``) is kept."""
    for part in parts:
        if part[:1] in ("_", ".") and not any(
            p[:1] == part[:1] and fnmatch.fnmatchcase(part, p) for p in patterns
        ):
            return True
    return False


def _glob_root(pattern: str) -> str:
    """The folder part of ``pattern`` before its first wildcard."""
    cut = min(pattern.index(c) for c in "*?[" if c in pattern)
    root = pattern[:cut].rpartition("/")[0]
    return "/" if not root and pattern.startswith("/") else root


def _local_paths(source: Any) -> list[str]:
    path = os.path.expanduser(os.fspath(source))
    if os.path.isfile(path):  # a file is that file, whatever its name holds ([x], *, ?)
        return [path]
    p = Path(path)
    if p.is_dir():
        found = sorted(
            str(f) for f in p.rglob("*.parquet") if f.is_file() and not _hidden(f.relative_to(p).parts)
        )
        if not found:
            raise FileNotFoundError(
                f"{path!r} holds no *.parquet file (in it or its subfolders; names starting with "
                "'_' or '.' are skipped)"
            )
        return found
    if _has_glob(path):
        root = _glob_root(path)
        patterns = path[len(root) :].lstrip("/").split("/")
        matched = [f for f in globlib.glob(path, recursive=True) if os.path.isfile(f)]
        found = sorted(
            f for f in matched if not _hidden(os.path.relpath(f, root or ".").split(os.sep), patterns)
        )
        if not found:
            raise FileNotFoundError(
                f"no file matches {path!r}, and no file or folder has that name: *, ? and [ are "
                "wildcards there (names starting with '_' or '.' are skipped unless the pattern "
                "names them); check the path"
            )
        return found
    raise FileNotFoundError(f"no such file or folder: {path!r}")


def _split_url(url: str) -> tuple[str, str]:
    """An object URL as its parent prefix and its name."""
    head, _, name = url.rstrip("/").rpartition("/")
    return head, name


def _remote_sources(source: str, options: dict[str, Any]) -> tuple[_RemoteFiles, list[str], dict[str, _Stat]]:
    """One store prefix and the objects under it that ``source`` names, with their sizes."""
    if _has_glob(source):
        prefix = _glob_root(source)
        pattern = source[len(prefix) + 1 :]
        files = _RemoteFiles(prefix, options)
        listed = files.listing()
        if listed is None:
            if source.rstrip("/").endswith(".parquet"):  # a URL whose name holds [x] or *
                return files, [pattern], {}
            raise ValueError(f"{source!r}: this store cannot be listed; pass the files' URLs as a list")
        if pattern in listed:  # an object of that very name is that object
            return files, [pattern], {pattern: listed[pattern]}
        parts = pattern.split("/")
        names = sorted(
            p for p in listed if fnmatch.fnmatchcase(p, pattern) and not _hidden(p.split("/"), parts)
        )
        if not names:
            raise FileNotFoundError(
                f"no object matches {source!r}, and no object has that name: *, ? and [ are "
                "wildcards there (names starting with '_' or '.' are skipped unless the pattern "
                "names them)"
            )
        return files, names, {p: listed[p] for p in names}
    if source.rstrip("/").endswith(".parquet"):
        prefix, name = _split_url(source)
        files = _RemoteFiles(prefix, options)
        return files, [name], {}
    files = _RemoteFiles(source.rstrip("/"), options)
    listed = files.listing()
    if listed is None:
        raise ValueError(
            f"{source!r}: this store cannot be listed (http(s)://); pass the files' URLs as a list"
        )
    names = sorted(p for p in listed if p.endswith(".parquet") and not _hidden(p.split("/")))
    if not names:
        raise FileNotFoundError(
            f"{source!r} holds no *.parquet object (names starting with '_' or '.' are skipped)"
        )
    return files, names, {p: listed[p] for p in names}


def _resolve(source: Any, options: dict[str, Any]) -> tuple[Any, list[str], dict[str, _Stat]]:
    """The files ``source`` names (local, or objects of one store prefix), in sorted path order,
    and the sizes a listing found for them."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise ValueError("open_parquet needs at least one file")
    texts = [os.fspath(s) for s in items]
    remote = [_is_remote(t) for t in texts]
    if any(remote) and not all(remote):
        raise ValueError("open_parquet reads local files or objects of one store, not both at once")
    if not remote[0]:
        if options:
            raise TypeError(f"unexpected options for local files: {sorted(options)}")
        return _LocalFiles(), [p for t in texts for p in _local_paths(t)], {}
    if len(texts) == 1:
        return _remote_sources(texts[0], dict(options))
    parents = {_split_url(t)[0] for t in texts}
    if len(parents) != 1:
        raise ValueError("a list of object URLs must name objects of one folder (one prefix)")
    return _RemoteFiles(parents.pop(), dict(options)), [_split_url(t)[1] for t in texts], {}
