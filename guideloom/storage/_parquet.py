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
is an empty document.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import glob as globlib
import hashlib
import importlib
import io
import json
import os
import sys
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_int
from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError, DatasetIntegrityError, RemoteReadError, StorageError
from guideloom.storage._text import TextEncoder, TokenizerLike
from guideloom.storage.base import DocumentStorageAbstract

__all__ = ["ParquetStorage", "open_parquet"]

I64 = npt.NDArray[np.int64]
OnNull = Literal["error", "empty"]
_REMOTE_SCHEMES = ("s3", "gs", "gcs", "az", "azure", "abfs", "abfss", "http", "https")
_FOOTER_GUESS = 64 * 1024  # bytes read from an object's end first: most footers fit
_INDEX_VERSION = 2
_LENGTHS_VERSION = 2  # the length index's files and their key
#: Default bytes of decoded row groups kept (what the row-group shuffle's window should fit).
DEFAULT_DECODED_BYTES = 512 * 2**20
#: Bytes of a token column decoded between two calls that give arrow's free pages back to the
#: system (each call costs about as much as a decode: its pages are faulted in again). Arrow's
#: allocator keeps some 20 MiB of a decode's freed pages otherwise. A text column's pages are
#: given back after every decode: its rows are tokenized next, which costs a hundred times more.
RELEASE_EVERY_BYTES = 16 * 2**20
_OPEN_FILES = 64  # local ParquetFile handles kept open per process
#: Row groups fetched ahead at once over an object store (``open_parquet``'s ``fetch_ahead``):
#: each is one ranged GET and a decode, on its own thread.
DEFAULT_FETCH_AHEAD = 8
#: Uses of row groups by the loader's upcoming reads recorded at most (how far the walk of its
#: hint may run ahead of the reads where every row group it meets is decoded already).
_AHEAD_MAX_USES = 1 << 16
_LIVE: weakref.WeakSet[ParquetStorage] = weakref.WeakSet()


def _stop_all() -> None:
    for storage in list(_LIVE):
        storage._stop_ahead(join=False)


# Runs before the interpreter joins its threads: the fetches ahead start no new GET after it.
threading._register_atexit(_stop_all)  # type: ignore[attr-defined]


def _import(name: str) -> Any:
    """``name`` imported; pyarrow's first import without its bundled jemalloc's background
    thread (``JE_ARROW_MALLOC_CONF``, unless set): pyarrow's default pool is another allocator
    here, and that named thread would keep process workers from being forked from the main
    process (sharing its pages) for as long as the process lives."""
    if "pyarrow" not in sys.modules:
        os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    return importlib.import_module(name)


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
            from guideloom.storage._client import Remote

            self._conn = Remote(self.prefix_url, dict(self.options))
            self._conn.versions.update(self.versions)
        return self._conn

    def fetch(self, path: str, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of object ``path``, a GET conditional on the version it was
        opened with, with the connection's retries. A read that fails after them (a short answer
        again and again) is a :class:`~guideloom.RemoteReadError` naming the object and the
        range, not a damaged file; an object changed or gone since it was opened is a
        :class:`DatasetIntegrityError` naming it (and every later read of it is refused)."""
        from guideloom.storage._objstore import call_with_retries, get_checked

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

        from guideloom.storage._objstore import ObjectChangedError, map_error, obstore_message

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
        start, end = chunks
        data = self.fetch(path, start, end)
        size = int(self.versions[path].size)
        tail_start, tail = self._tails[path]
        pieces = {start: data, tail_start: tail}  # the footer's bytes as they were when opened
        return (
            _pq()
            .ParquetFile(_SparseFile(size, pieces), metadata=metadata, page_checksum_verification=True)
            .read_row_group(group, columns=columns, use_threads=False)
        )


def _version_text(size: int, etag: Any) -> str:
    return plural(size, "byte") + ("" if not etag else f", ETag {etag}")


# -- the index: footers only -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _FileEntry:
    path: str  # local path, or an object's path under its prefix
    size: int
    version: str
    rows: tuple[int, ...]  # per row group
    nbytes: tuple[int, ...]  # uncompressed bytes of the column per row group
    kind: str  # "text" or "tokens:<dtype>"
    footer: str  # the digest of the footer's bytes


def _column_kind(arrow_type: Any, where: str, column: str) -> str:
    pa = _pa()
    t = arrow_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
        return f"tokens:{t.value_type.to_pandas_dtype().__name__}"
    raise DatasetFormatError(
        f"{where}: column {column!r} is {arrow_type}; open_parquet reads a string column (text) or a "
        "list of integers (token ids)"
    )


def _entry(files: Any, path: str, stat: _Stat, column: str, shown: str) -> _FileEntry:
    try:
        md, footer = files.footer(path, stat.size)
    except (DatasetFormatError, StorageError, FileNotFoundError, PermissionError):
        raise  # a damaged file says so itself; a failed read of the store is not a damaged file
    except (OSError, ValueError) as exc:
        raise DatasetFormatError(
            f"{shown}: damaged or not a Parquet file: its footer cannot be read ({exc})"
        ) from None
    schema = md.schema.to_arrow_schema()
    if column not in schema.names:
        raise DatasetFormatError(
            f"{shown}: no column {column!r}; its columns are {', '.join(schema.names)} "
            "(name the column to read: open_parquet's column=, or guideloom inspect --column)"
        )
    kind = _column_kind(schema.field(column).type, shown, column)
    leaves = _leaves(md, column)
    rows, nbytes = [], []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        rows.append(int(rg.num_rows))
        if kind == "text" and any(int(rg.column(j).num_values) != rg.num_rows for j in leaves):
            chunk = next(int(rg.column(j).num_values) for j in leaves)
            raise DatasetIntegrityError(
                f"{shown}: row group {g}, column {column!r}: the footer says "
                f"{plural(int(rg.num_rows), 'row')}, the column chunk holds {plural(chunk, 'value')}: "
                "the file's footer does not match its pages (damaged, edited or written by a faulty "
                "writer); write the file again"
            )
        nbytes.append(sum(int(rg.column(j).total_uncompressed_size) for j in leaves))
    return _FileEntry(path, stat.size, stat.version, tuple(rows), tuple(nbytes), kind, footer)


def _leaves(md: Any, column: str) -> list[int]:
    """The leaf columns (column chunks) that make up ``column``."""
    schema = md.schema
    return [j for j in range(len(schema)) if schema.column(j).path.split(".")[0] == column]


def _chunk_range(md: Any, group: int, leaves: list[int]) -> tuple[int, int]:
    """The bytes a row group's column chunks of ``leaves`` lie in."""
    rg = md.row_group(group)
    starts, ends = [], []
    for j in leaves:
        c = rg.column(j)
        start = (
            c.dictionary_page_offset
            if c.has_dictionary_page and c.dictionary_page_offset
            else c.data_page_offset
        )
        start = min(start, c.data_page_offset)
        starts.append(int(start))
        ends.append(int(start) + int(c.total_compressed_size))
    return min(starts), max(ends)


# -- decoded row groups ------------------------------------------------------------------------------
class _Decoded:
    """One row group's column, decoded and copied out of arrow into numpy arrays of its exact
    size: the rows' offsets, and the values (token ids) or the UTF-8 bytes (texts). What is kept
    is then exactly what ``nbytes`` counts (arrow's buffers grow in steps, and its allocator keeps
    freed pages a while), and reading rows needs no arrow kernel."""

    __slots__ = ("nbytes", "nulls", "offsets", "text", "values")

    def __init__(self, array: Any, kind: str) -> None:
        pa = _pa()
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        self.text = kind == "text"
        self.nulls = _null_mask(array)
        # read from the buffers themselves: arrow's to_numpy() would import pandas
        large = pa.types.is_large_string(array.type) or pa.types.is_large_list(array.type)
        offsets = _buffer(array.buffers()[1], np.int64 if large else np.int32)
        offsets = offsets[array.offset : array.offset + len(array) + 1].astype(np.int64)
        if not len(offsets):  # no rows: arrow may leave the offsets buffer out
            offsets = np.zeros(1, np.int64)
        start, stop = int(offsets[0]), int(offsets[-1])
        if self.text:  # buffers: validity, offsets, UTF-8 bytes
            whole = _buffer(array.buffers()[2], np.uint8)
        else:  # the child array's buffers: validity, values
            child = array.values
            _refuse_null_elements(child, offsets)
            whole = _buffer(child.buffers()[1], np.dtype(kind.split(":", 1)[1]))[child.offset :]
        self.values: npt.NDArray[Any] = whole[start:stop].copy()
        self.offsets: I64 = offsets - start
        self.nbytes = int(self.values.nbytes + self.offsets.nbytes) + (
            0 if self.nulls is None else int(self.nulls.nbytes)
        )

    def rows(self, local: I64) -> list[Any]:
        off, values = self.offsets, self.values
        starts, ends = off[local].tolist(), off[local + 1].tolist()
        if self.nulls is not None:  # a null slot's extent is not defined: read as empty
            blank = self.nulls[local]
            starts = np.where(blank, 0, off[local]).tolist()
            ends = np.where(blank, 0, off[local + 1]).tolist()
        if self.text:
            raw = values.data
            return [str(raw[a:b], "utf-8") for a, b in zip(starts, ends, strict=True)]
        return [values[a:b] for a, b in zip(starts, ends, strict=True)]

    def lengths(self) -> I64:
        return np.diff(self.offsets)


def _buffer(buffer: Any, dtype: Any) -> npt.NDArray[Any]:
    """An arrow buffer's bytes as a numpy array of ``dtype`` (no copy; empty for no buffer)."""
    return np.zeros(0, dtype) if buffer is None else np.frombuffer(buffer, dtype=dtype)


def _null_mask(array: Any) -> npt.NDArray[np.bool_] | None:
    """Which of ``array``'s slots are null (from its validity bitmap; ``None`` where none is)."""
    if array.null_count == 0:
        return None
    bitmap = array.buffers()[0]
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    mask: npt.NDArray[np.bool_] = bits[array.offset : array.offset + len(array)] == 0
    return mask


def _refuse_null_elements(values: Any, offsets: I64) -> None:
    """A list row with a null element has no token id there: refused, not read as a float NaN.
    ``values``: the lists' child array; ``offsets``: the rows' offsets into it."""
    nulls = _null_mask(values)
    if nulls is None:
        return
    inside = np.flatnonzero(nulls[int(offsets[0]) : int(offsets[-1])]) + int(offsets[0])
    if not len(inside):
        return  # null slots outside every row (a sliced array's)
    first = int(inside[0])
    row = int(np.searchsorted(offsets, first, side="right")) - 1
    raise DatasetFormatError(
        f"row {row} holds a null element (at {first - int(offsets[row])}): token ids cannot be "
        "null; fill or drop them in the files"
    )


class _Decoding(concurrent.futures.Future[_Decoded]):
    """A row group being decoded; ``ahead``: by a fetch ahead (whose failure is not the reads'
    own: a read that waited for it reads the row group itself)."""

    def __init__(self, ahead: bool) -> None:
        super().__init__()
        self.ahead = ahead


class ParquetStorage(DocumentStorageAbstract[Any, Any]):
    """The rows of Parquet files as documents (see :func:`open_parquet`).

    Over an object store, the loader's hint of its upcoming reads (:meth:`will_read`) is walked
    by ``fetch_ahead`` threads that fetch and decode the row groups those reads need, in order
    of first need, within ``max_decoded_bytes``.
    """

    max_concurrent_reads = 1

    def __init__(
        self,
        files: Any,
        entries: list[_FileEntry],
        column: str,
        *,
        encoder: TextEncoder | None,
        on_null: OnNull,
        max_decoded_bytes: int,
        cache_dir: str | None,
        tokenize: bool = True,
        fetch_ahead: int = DEFAULT_FETCH_AHEAD,
        tokenizer_key: str | None = None,
    ) -> None:
        self.fetch_ahead = fetch_ahead
        self._tokenizer_key = tokenizer_key
        self._files, self._entries, self.column = files, entries, column
        self._encoder, self.on_null, self.max_decoded_bytes = encoder, on_null, max_decoded_bytes
        self._cache_dir, self._tokenize = cache_dir, tokenize
        self._shown: Callable[[str], str] = files.name
        rows = [np.asarray(e.rows, dtype=np.int64) for e in entries]
        self._sizes = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        self._gstarts = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
        self._file_of = np.repeat(np.arange(len(entries)), [len(e.rows) for e in entries]).astype(np.int64)
        firsts = np.concatenate([[0], np.cumsum([len(e.rows) for e in entries])]).astype(np.int64)
        self._group_in_file = np.arange(len(self._sizes), dtype=np.int64) - firsts[self._file_of]
        self._kind = entries[0].kind if entries else "text"
        self._digest = self._make_digest()
        self.max_concurrent_reads = 4 if getattr(files, "remote", False) else 1
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Condition()
        self._decoded: OrderedDict[int, _Decoded] = OrderedDict()
        self._decoded_bytes = 0
        #: Row groups being decoded, each by the first reader (or fetch ahead) that asked for it.
        self._decoding: dict[int, _Decoding] = {}
        # -- the fetches ahead (over an object store), all under _lock ---------------------------
        #: The rest of the loader's hint: the indices of its upcoming reads, in order.
        self._plan: Iterator[Any] | None = None
        self._plan_seq = 0  # the number of the next window of the hint walked
        #: Row group -> the numbers of the walked windows that read it, not yet read: a row group
        #: with uses is kept before one without, and the nearer use before the farther.
        self._uses: dict[int, deque[int]] = {}
        self._use_count = 0
        self._horizon: dict[int, int] = {}  # row group with uses -> its estimated bytes
        self._horizon_bytes = 0
        self._queue: deque[int] = deque()  # row groups to fetch ahead, in order of first need
        self._queued: set[int] = set()
        self._ahead: dict[int, int] = {}  # row group -> its bytes, fetched ahead now
        self._ahead_failed: set[int] = set()  # left to their reads (which raise the error)
        self._fetchers: list[threading.Thread] = []
        self._stopping = False
        self._bytes_ratio = 1.0  # see _estimate
        self._since_release = 0  # bytes decoded since arrow's pool last gave back its free pages
        self._readers: OrderedDict[int, Any] = OrderedDict()
        self._offsets: I64 | None = None
        self.counts = {"parquet_row_group_decodes": 0, "parquet_null_rows": 0}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without what it decoded or opened: a process worker decodes its own."""
        keep = (
            "_lock",
            "_decoded",
            "_decoded_bytes",
            "_decoding",
            "_since_release",
            "_readers",
            "counts",
            "_plan",
            "_plan_seq",
            "_uses",
            "_use_count",
            "_horizon",
            "_horizon_bytes",
            "_queue",
            "_queued",
            "_ahead",
            "_ahead_failed",
            "_fetchers",
            "_stopping",
            "_bytes_ratio",
        )
        return {k: v for k, v in self.__dict__.items() if k not in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        offsets = state.get("_offsets")
        self.__dict__.update(state)
        self._reset()
        self._offsets = offsets

    def __repr__(self) -> str:
        first = self._shown(self._entries[0].path) if self._entries else "-"
        return (
            f"ParquetStorage({plural(len(self._entries), 'file')} from {first!r}, column={self.column!r}, "
            f"rows={len(self)})"
        )

    # -- what it holds ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._gstarts[-1])

    @property
    def tokenized(self) -> bool:
        """Whether samples are token arrays (a list column, or a text column with a tokenizer)."""
        return self._kind != "text" or (self._encoder is not None and self._tokenize)

    @property
    def dtype(self) -> np.dtype[Any]:
        if self._kind != "text":
            return np.dtype(self._kind.split(":", 1)[1])
        if self._encoder is not None and self._tokenize:
            return self._encoder.dtype
        return np.dtype(object)

    @property
    def files(self) -> list[str]:
        """The files, in the order their rows are numbered."""
        return [self._shown(e.path) for e in self._entries]

    def file_summary(self) -> list[tuple[str, int, int, int]]:
        """Each file's name, rows, row groups and size in bytes, in row order."""
        return [(self._shown(e.path), sum(e.rows), len(e.rows), e.size) for e in self._entries]

    @property
    def num_row_groups(self) -> int:
        """Row groups over all files."""
        return len(self._sizes)

    def row_group_sizes(self) -> I64:
        """Rows in each row group, over all files in order."""
        return self._sizes.copy()

    def natural_blocks(self) -> I64:
        """The row groups' sizes: the blocks a row-group-aware shuffle keeps together."""
        return self._sizes

    def sample_nbytes_hint(self) -> int:
        total = sum(sum(e.nbytes) for e in self._entries)
        return max(1, total // max(1, len(self)))

    def content_digest(self) -> str:
        """A digest of every file's path, size, version and row groups, the column and the
        tokenizer: a checkpoint over other files (or the same ones changed) is refused."""
        return self._digest

    def _make_digest(self) -> str:
        h = hashlib.sha256()
        parts: list[Any] = [self.column, self._kind, self.on_null]
        if self._encoder is not None:
            parts.append(self._encoder.describe())
            if self._tokenizer_key is not None:
                parts.append(self._tokenizer_key)
        parts += [[self._shown(e.path), e.size, e.version, e.footer, list(e.rows)] for e in self._entries]
        h.update(json.dumps(parts).encode())
        return "parquet-" + h.hexdigest()[:32]

    def figures(self) -> dict[str, float]:
        """What ``loader.stats()`` reports of this storage (counted in the process that reads)."""
        return {
            "parquet_files": float(len(self._entries)),
            "parquet_row_groups": float(len(self._sizes)),
            **{k: float(v) for k, v in self.counts.items()},
        }

    def reads_inline(self) -> bool:
        return self._plain_reads and not getattr(self._files, "remote", False)

    def read_by_workers(self) -> bool:
        """Texts that are tokenized elsewhere (by the workers, or by ``collate_fn``) are read by
        the main process and sent: the workers' work is the tokenizing, a batch of texts is small
        next to a window of decoded row groups, and one process holds that window instead of
        every worker. Token arrays are read by the workers, which decode in parallel."""
        return not (self._kind == "text" and not self.tokenized)

    def deferred_step(self) -> tuple[ParquetStorage, Callable[[Sequence[Any]], Sequence[Any]]] | None:
        """Where a loader reads this storage document by document: the storage that reads the
        texts untokenized and the step that tokenizes a batch of them, which the loader runs
        where it collates (in thread or process workers, in parallel). ``None`` for a list
        column or a text column without a tokenizer."""
        if self._kind != "text" or self._encoder is None or not self._tokenize:
            return None
        texts = ParquetStorage.__new__(ParquetStorage)
        texts.__setstate__({**self.__getstate__(), "_tokenize": False})
        return texts, self._encoder.encode_many

    # -- decoding --------------------------------------------------------------------------------
    def _where(self, group: int) -> str:
        e = self._entries[int(self._file_of[group])]
        return f"{self._shown(e.path)}: row group {int(self._group_in_file[group])}, column {self.column!r}"

    def _reader(self, f: int) -> Any:
        with self._lock:
            got = self._readers.get(f)
            if got is not None:
                self._readers.move_to_end(f)
                return got
        e = self._entries[f]
        self._check_unchanged(e)
        try:
            md, footer = self._files.footer(e.path, e.size)
            if footer != e.footer:
                raise DatasetIntegrityError(
                    f"{self._shown(e.path)}: the file changed since the dataset was opened (its footer "
                    "differs); open it again (a checkpoint made over the old files is refused)"
                )
            reader = self._files.reader(e.path, md)
        except (DatasetFormatError, StorageError, FileNotFoundError, PermissionError):
            raise
        except (OSError, ValueError) as exc:
            raise DatasetFormatError(f"{self._shown(e.path)}: its footer cannot be read ({exc})") from None
        got = (md, reader, _leaves(md, self.column))
        with self._lock:
            self._readers[f] = got
            while len(self._readers) > _OPEN_FILES:
                self._readers.popitem(last=False)
        return got

    def _check_unchanged(self, e: _FileEntry) -> None:
        if self._files.remote:
            return  # every range read is conditional on the version
        try:
            now = self._files.stat(e.path)
        except FileNotFoundError:
            raise DatasetIntegrityError(f"{e.path}: the file is gone since the dataset was opened") from None
        if now != _Stat(e.size, e.version):
            raise DatasetIntegrityError(
                f"{e.path}: the file changed since the dataset was opened (size {e.size} -> {now.size} "
                "bytes, or its modification time); open it again (a checkpoint made over the old "
                "files is refused)"
            )

    def _decode(self, group: int, *, read: bool = True) -> _Decoded:
        """Row group ``group`` decoded: kept, or read and decoded once (a reader that asks for
        it while another decodes it waits for that one's, as concurrent reads of a window do; a
        fetch ahead that failed leaves the row group to the read, which raises its own error).
        ``read``: a read's use of it (one of the hint's uses is done)."""
        with self._lock:
            if read:
                self._use_locked(group)
        while True:
            with self._lock:
                got = self._decoded.get(group)
                if got is not None:
                    self._decoded.move_to_end(group)
                    return got
                pending = self._decoding.get(group)
                if pending is None:
                    mine = self._decoding[group] = _Decoding(ahead=False)
                    break
            try:
                return pending.result()  # the first reader's, or what it raised
            except BaseException:
                if not pending.ahead:
                    raise
        return self._decode_as(group, mine)

    def _decode_as(self, group: int, mine: _Decoding) -> _Decoded:
        """Decode ``group`` for ``mine`` (registered in ``_decoding``), keep it and resolve it."""
        try:
            decoded = self._decode_new(group)
        except BaseException as exc:
            with self._lock:
                del self._decoding[group]
                self._lock.notify_all()
            mine.set_exception(exc)
            raise
        with self._lock:
            self.counts["parquet_row_group_decodes"] += 1
            self._bytes_ratio = max(self._bytes_ratio, decoded.nbytes / max(1, self._footer_bytes(group)))
            self._decoded[group] = decoded
            self._decoded_bytes += decoded.nbytes
            self._evict_locked(group, keep_new=not mine.ahead)
            del self._decoding[group]
            self._lock.notify_all()
            self._since_release += decoded.nbytes
            release = self._kind == "text" or self._since_release >= RELEASE_EVERY_BYTES
            if release:
                self._since_release = 0
        mine.set_result(decoded)
        if release:
            # The decodes' own buffers are freed by now (what is kept was copied out).
            _pa().default_memory_pool().release_unused()
        return decoded

    def _evict_locked(self, new: int, *, keep_new: bool) -> None:
        """Drop decoded row groups until the kept bytes fit ``max_decoded_bytes``: first those no
        upcoming read of the hint uses (least recently used first), then the one whose next use
        is farthest (Belady's rule). A read's own row group is kept (``keep_new``): it is in use."""
        while self._decoded_bytes > self.max_decoded_bytes and len(self._decoded) > 1:
            victim, farthest = None, -1
            for g in self._decoded:
                if g == new and keep_new:
                    continue
                uses = self._uses.get(g)
                if not uses:
                    victim = g
                    break
                if uses[0] > farthest:
                    victim, farthest = g, uses[0]
            if victim is None:
                return
            self._decoded_bytes -= self._decoded.pop(victim).nbytes

    # -- fetching ahead (object stores) ---------------------------------------------------------
    def will_read(self, windows: Iterable[npt.NDArray[np.int64]]) -> None:
        """The loader's upcoming reads, in order (a lazy iterable): over an object store,
        ``fetch_ahead`` threads fetch and decode the row groups they need, in order of first
        need, several ranged GETs at once, while the row groups not yet read fit
        ``max_decoded_bytes``. Replaces the previous hint. Local files: nothing (a read decodes
        its row groups as fast as it would wait for another thread's)."""
        if not getattr(self._files, "remote", False) or self.fetch_ahead < 1:
            return
        with self._lock:
            self._forget_plan_locked()
            self._plan = iter(windows)
            self._stopping = False
            start = self.fetch_ahead - len(self._fetchers)
            for _ in range(max(0, start)):
                t = threading.Thread(
                    target=self._fetch_ahead,
                    name=f"guideloom-parquet-ahead-{len(self._fetchers)}",
                    daemon=True,
                )
                self._fetchers.append(t)
                t.start()
            self._lock.notify_all()
        _LIVE.add(self)

    def _forget_plan_locked(self) -> None:
        self._plan, self._plan_seq = None, 0
        self._uses.clear()
        self._use_count = 0
        self._horizon.clear()
        self._horizon_bytes = 0
        self._queue.clear()
        self._queued.clear()
        self._ahead_failed.clear()

    def _use_locked(self, group: int) -> None:
        """A read of ``group``: its nearest use by the hint is done."""
        uses = self._uses.get(group)
        if uses is None:
            return
        uses.popleft()
        self._use_count -= 1
        if not uses:
            del self._uses[group]
            self._horizon_bytes -= self._horizon.pop(group)
        self._lock.notify_all()

    def _held_locked(self, before: int) -> int:
        """Bytes of the row groups fetched ahead now, and of those decoded that a read of the
        hint uses next at window ``before`` or earlier."""
        held = sum(self._ahead.values())
        uses = self._uses
        return held + sum(d.nbytes for g, d in self._decoded.items() if g in uses and uses[g][0] <= before)

    def _footer_bytes(self, group: int) -> int:
        """The bytes a decoded ``group`` holds by its footer: its column's uncompressed size
        (which an encoding may make smaller: a dictionary's) and its rows' offsets."""
        e = self._entries[int(self._file_of[group])]
        return int(e.nbytes[int(self._group_in_file[group])]) + 8 * (int(self._sizes[group]) + 1)

    def _estimate(self, group: int) -> int:
        """The bytes ``group`` will hold decoded: its footer's figure times the largest ratio
        of a decoded row group's bytes to its footer's figure seen so far."""
        return int(self._footer_bytes(group) * self._bytes_ratio)

    def _walk_locked(self, windows: int) -> bool:
        """Walk up to ``windows`` more windows of the hint, recording which row groups they use
        and queueing those to fetch, while the row groups with uses stay under twice
        ``max_decoded_bytes`` (by estimate): how far the fetches and the eviction see ahead.
        Whether it may walk further now."""
        for _ in range(windows):
            if (
                self._plan is None
                or self._horizon_bytes >= 2 * self.max_decoded_bytes
                or self._use_count >= _AHEAD_MAX_USES
            ):
                return False
            try:
                indices = next(self._plan, None)
            except Exception:  # a hint that cannot be computed: no fetching ahead on it
                indices = None
            if indices is None:
                self._plan = None
                return False
            indices = np.asarray(indices, dtype=np.int64)
            if not len(indices) or indices.min() < 0 or indices.max() >= len(self):
                continue  # not a read of this storage's rows: its read will say so
            seq, self._plan_seq = self._plan_seq, self._plan_seq + 1
            groups = np.unique(np.searchsorted(self._gstarts, indices, side="right") - 1).tolist()
            for g in groups:
                uses = self._uses.get(g)
                if uses is None:
                    uses = self._uses[g] = deque()
                    self._horizon[g] = self._estimate(g)
                    self._horizon_bytes += self._horizon[g]
                uses.append(seq)
                self._use_count += 1
                if g not in self._decoded and g not in self._decoding and g not in self._queued:
                    self._queue.append(g)
                    self._queued.add(g)
        return True

    def _next_ahead_locked(self) -> int | None:
        """The next row group to fetch ahead, claimed: the one first needed soonest, once the
        row groups fetched ahead and those decoded whose next use is no later than its first fit
        ``max_decoded_bytes`` with it (the others would be dropped for it); ``None`` once the
        hint is done or the storage closes."""
        while not self._stopping:
            more = self._walk_locked(64)
            while self._queue:
                g = self._queue[0]
                done = g in self._decoded or g in self._decoding or g in self._ahead_failed
                if not done and g in self._uses:
                    break
                self._queue.popleft()  # decoded meanwhile, or its reads are done
                self._queued.discard(g)
            if self._queue:
                g = self._queue[0]
                size = self._estimate(g)
                if self._held_locked(self._uses[g][0]) + size <= self.max_decoded_bytes:
                    self._queue.popleft()
                    self._queued.discard(g)
                    self._ahead[g] = size
                    return g
            elif self._plan is None:
                return None
            self._lock.wait(0 if more else 1.0)  # the lock is let go between steps of the walk
        return None

    def _fetch_ahead(self) -> None:
        """A fetching thread: row groups of the hint, one after another, through ``_decode``'s
        path (a read that needs one waits for it), until the hint is done or the storage closes."""
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    g = self._next_ahead_locked()
                    if g is None:
                        return
                    mine = self._decoding[g] = _Decoding(ahead=True)
                try:
                    self._decode_as(g, mine)
                except BaseException:
                    with self._lock:
                        self._ahead_failed.add(g)  # left to its read, which raises its own error
                finally:
                    with self._lock:
                        self._ahead.pop(g, None)
                        self._lock.notify_all()
        finally:
            with self._lock:
                if me in self._fetchers:
                    self._fetchers.remove(me)

    def _stop_ahead(self, *, join: bool = True) -> None:
        """Stop fetching ahead (a fetch in progress completes) and, with ``join``, wait for it."""
        with self._lock:
            self._stopping = True
            self._forget_plan_locked()
            self._lock.notify_all()
            threads = list(self._fetchers)
        if join:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()

    async def close(self) -> None:
        """Stop fetching ahead (the loader closes its storage after its last read)."""
        if self._fetchers:
            await self._blocking(self._stop_ahead)

    def _decode_new(self, group: int) -> _Decoded:
        """Row group ``group``'s column read and decoded (nothing of arrow's kept)."""
        f = int(self._file_of[group])
        e = self._entries[f]
        md, reader, leaves = self._reader(f)
        g = int(self._group_in_file[group])
        if not self._files.remote:
            self._check_unchanged(e)
        try:
            table = self._files.read_group(e.path, reader, g, [self.column], _chunk_range(md, g, leaves))
            array = table.column(self.column).combine_chunks()
            if len(array) != e.rows[g]:
                raise DatasetFormatError(f"decoded {plural(len(array), 'row')}, the footer says {e.rows[g]}")
            decoded = _Decoded(array, e.kind)
        except (DatasetIntegrityError, FileNotFoundError, PermissionError, StorageError):
            raise
        except DatasetFormatError as exc:
            raise DatasetFormatError(f"{self._where(group)}: {exc}") from None
        except (OSError, ValueError, IndexError) as exc:
            raise DatasetFormatError(f"{self._where(group)}: cannot be decoded ({exc})") from None
        if not self._files.remote:
            self._check_unchanged(e)  # a file written over while it was read: not delivered
        self._check_values(group, md, leaves, decoded)
        return decoded

    def _check_values(self, group: int, md: Any, leaves: list[int], decoded: _Decoded) -> None:
        """Refuse a row group whose footer's row count is not what its column chunk holds: the
        chunk's own count of values (``num_values``: one a row for a text column, one a list
        element or empty list for a list column) against the rows decoded. A footer that says
        fewer rows than the pages hold would otherwise drop the rest silently."""
        g = int(self._group_in_file[group])
        if decoded.text:
            values = len(decoded.offsets) - 1
        else:
            lengths = np.maximum(decoded.lengths(), 1)
            if decoded.nulls is not None:
                lengths[decoded.nulls] = 1
            values = int(lengths.sum())
        for j in leaves:
            chunk = int(md.row_group(g).column(j).num_values)
            if chunk != values:
                raise DatasetIntegrityError(
                    f"{self._where(group)}: the footer says {plural(int(self._sizes[group]), 'row')}, "
                    f"which hold {plural(values, 'value')}, but the column chunk holds "
                    f"{plural(chunk, 'value')}: the file's footer does not match its pages (damaged, "
                    "edited or written by a faulty writer); write the file again"
                )

    def _nulls(self, group: int, decoded: _Decoded, local: I64) -> None:
        if decoded.nulls is None:
            return
        hit = local[decoded.nulls[local]]
        if not len(hit):
            return
        if self.on_null == "error":
            row = int(hit[0])
            raise DatasetFormatError(
                f"{self._where(group)}: row {row} (document {int(self._gstarts[group]) + row}) is null; "
                "pass on_null='empty' to read null rows as empty documents (they are counted in "
                "stats()), or filter them out of the files"
            )
        with self._lock:
            self.counts["parquet_null_rows"] += len(hit)

    def _cut(self, group: int, decoded: _Decoded, local: I64) -> list[Any]:
        """Rows ``local`` of row group ``group``; a text that is not UTF-8 (a damaged page that
        decoded) is refused by its place."""
        try:
            return decoded.rows(local)
        except UnicodeDecodeError as exc:
            raise DatasetFormatError(
                f"{self._where(group)}: a row is not valid UTF-8 text ({exc.reason}): the file is "
                "damaged, or the column holds bytes that are not text"
            ) from None

    def _rows(self, indices: I64) -> list[Any]:
        """The rows at ``indices``: every row group they touch decoded once, then, for a list
        column, one view per row cut from its group's values (the cuts computed with numpy per
        row group; the only per-row Python work is the slice itself)."""
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return []
        if indices.min() < 0 or indices.max() >= len(self):
            raise IndexError(f"document index outside [0, {len(self)})")
        groups = np.searchsorted(self._gstarts, indices, side="right") - 1
        local = indices - self._gstarts[groups]
        first = int(groups[0])
        if (groups == first).all():  # the common case under a row-group shuffle's windows
            decoded = self._decode(first)
            self._nulls(first, decoded, local)
            return self._cut(first, decoded, local)
        distinct, which = np.unique(groups, return_inverse=True)
        order = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[order], np.arange(len(distinct) + 1)).tolist()
        ats = [order[cuts[k] : cuts[k + 1]] for k in range(len(distinct))]
        # one row group at a time: a read over many (a global row shuffle) holds one decoded
        # group beyond the cache, and for a list column the rows' own values
        out: list[Any] = [None] * len(indices)
        for g, at in zip(distinct.tolist(), ats, strict=True):
            decoded = self._decode(g)
            self._nulls(g, decoded, local[at])
            for i, row in zip(at.tolist(), self._cut(g, decoded, local[at]), strict=True):
                out[i] = row
        return out

    def read_many_sync(self, indices: I64) -> Sequence[Any]:
        indices = np.asarray(indices, dtype=np.int64)
        rows = self._rows(indices)
        if self._kind == "text" and self._encoder is not None and self._tokenize:
            rows = self._encoder.encode_many(rows)
        if self._offsets is not None and self.tokenized:
            self._check_lengths(indices, rows)
        return rows

    # -- element access (packing): the length index ---------------------------------------------------
    def _lengths_of(self, group: int) -> I64:
        decoded = self._decode(group)
        if not decoded.text:
            lengths = decoded.lengths()
            if decoded.nulls is not None:
                self._nulls(group, decoded, np.flatnonzero(decoded.nulls).astype(np.int64))
                lengths = np.where(decoded.nulls, 0, lengths)  # a null row: an empty document
            return lengths.astype(np.int64)
        if self._encoder is None:
            raise TypeError(
                f"column {self.column!r} holds texts: pass tokenizer= to open_parquet to pack or count tokens"
            )
        rows = np.arange(int(self._sizes[group]), dtype=np.int64)
        self._nulls(group, decoded, rows)
        texts = self._cut(group, decoded, rows)  # a null row (on_null="empty") is "": bos/eos only
        return np.fromiter(map(len, self._encoder.encode_many(texts)), dtype=np.int64, count=len(texts))

    def _tokenizer_identity(self) -> str | None:
        """What names the tokenizing in the files derived from the rows (and in the
        fingerprint): the tokenizer's contents (a digest of a ``tokenizers.Tokenizer``'s or a
        ``tokenizer.json``'s serialisation), ``bos``/``eos`` and ``dtype``, and ``tokenizer_key``
        where given; ``None`` for a tokenizer that cannot be identified by its contents (a
        callable) and has no ``tokenizer_key``; ``""`` where nothing is tokenized."""
        if self._encoder is None:
            return ""
        described = self._encoder.describe()
        if self._tokenizer_key is not None:
            return f"key={self._tokenizer_key}|{described}"
        return described if described.startswith("sha256:") else None

    def _length_key(self) -> dict[str, Any] | None:
        """What the length index derives from, all of it: each file's name, size, version
        (modification time; an object's ETag) and footer digest, the column, ``on_null`` and the
        tokenizing; ``None`` where the tokenizer cannot be identified (nothing is cached then)."""
        tokenizer = self._tokenizer_identity()
        if tokenizer is None:
            return None
        files = [[self._shown(e.path), e.size, e.version, e.footer] for e in self._entries]
        return {
            "format": _LENGTHS_VERSION,
            "column": self.column,
            "kind": self._kind,
            "on_null": self.on_null,
            "tokenizer": tokenizer,
            "files": files,
        }

    def _length_folder(self) -> Path | None:
        """Where ``cache_dir`` keeps the length index: a folder named by the digest of
        :meth:`_length_key` (``None``: not cached)."""
        key = self._length_key()
        if self._cache_dir is None or key is None:
            return None
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return Path(self._cache_dir) / f"lengths-{digest}"

    def _cached_lengths(self, folder: Path, key: dict[str, Any]) -> I64 | None:
        """The whole length index saved in ``folder``, checked: its record names the same key
        and the digest of its bytes, and it holds one non-negative integer per row. A file that
        fails a check is named in a warning, removed and built again (``None``)."""
        whole, record = folder / "lengths.npy", folder / "lengths.json"
        if not whole.exists() and not record.exists():
            return None
        try:
            meta = json.loads(record.read_text())
            if not isinstance(meta, dict) or meta.get("key") != key:
                raise _Stale(f"{record} does not record what the index derives from")
            return _load_checked(whole, str(meta.get("sha256")), len(self))
        except _Stale as exc:
            _rebuilt(str(exc), whole, record)
        except (OSError, ValueError) as exc:
            _rebuilt(f"{record}: cannot be read ({exc})", whole, record)
        return None

    def _cached_groups(self, folder: Path) -> dict[int, I64]:
        """The row groups' lengths saved by a build that did not finish (``group-G-<digest>.npy``,
        the digest of its bytes in its name), checked; one that fails a check is named in a
        warning, removed and built again."""
        done: dict[int, I64] = {}
        for part in sorted(folder.glob("group-*.npy")):
            try:
                _, group, digest = part.stem.split("-")
                g = int(group)
                if not 0 <= g < len(self._sizes):
                    raise _Stale(f"{part}: no row group {g} here")
                done[g] = _load_checked(part, digest, int(self._sizes[g]))
            except _Stale as exc:
                _rebuilt(str(exc), part)
            except (OSError, ValueError):
                _rebuilt(f"{part}: not a row group's lengths of this index", part)
        return done

    def build_length_index(
        self, *, threads: int | None = None, progress: Callable[[int], object] | None = None
    ) -> I64:
        """Every document's length in tokens (one pass over the files, decoding and, for texts,
        tokenizing every row group, on ``threads`` threads). With ``cache_dir`` each row group's
        lengths are saved as they are done, in a folder named by the digest of what they derive
        from (:meth:`_length_key`), each file with the digest of its bytes: a build that was
        interrupted goes on where it stopped, a later open reads them back, and a file that does
        not match its digest is built again. A tokenizer that cannot be identified by its
        contents (a callable) is not cached without ``tokenizer_key``."""
        if self._offsets is not None:
            return self._offsets
        folder, key = self._length_folder(), self._length_key()
        if self._cache_dir is not None and key is None:
            warnings.warn(
                "the length index is not cached in cache_dir: a tokenizer callable cannot be "
                "identified by its contents; pass open_parquet(tokenizer_key=...) naming exactly "
                "this tokenizer (and its version) to cache it",
                RuntimeWarning,
                stacklevel=2,
            )
        done: dict[int, I64] = {}
        if folder is not None and key is not None:
            folder.mkdir(parents=True, exist_ok=True)
            cached = self._cached_lengths(folder, key)
            if cached is not None:
                self._offsets = _offsets_of(cached)
                return self._offsets
            done = self._cached_groups(folder)

        def one(group: int) -> I64:
            got = done.get(group)
            if got is not None:
                return got
            lengths = self._lengths_of(group)
            if folder is not None:
                data = _npy_bytes(lengths.astype(np.int32 if lengths.max(initial=0) < 2**31 else np.int64))
                _write_atomic(folder / f"group-{group}-{hashlib.sha256(data).hexdigest()[:32]}.npy", data)
            if progress is not None:
                progress(1)
            return lengths

        n = len(self._sizes)
        workers = threads or min(8, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            parts = list(pool.map(one, range(n)))
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if folder is not None:
            data = _npy_bytes(lengths)
            _write_atomic(folder / "lengths.npy", data)
            record = {"key": key, "sha256": hashlib.sha256(data).hexdigest(), "documents": len(lengths)}
            _write_atomic(folder / "lengths.json", json.dumps(record).encode())
            for part in folder.glob("group-*.npy"):
                part.unlink(missing_ok=True)
        self._offsets = _offsets_of(lengths)
        return self._offsets

    def _check_lengths(self, indices: I64, docs: Sequence[Any]) -> None:
        """Refuse documents whose length differs from the length index the packing is laid out
        by (a tokenizer that changed under its ``tokenizer_key``, one that does not encode a
        text alike twice, or an index that is wrong), naming the first one's file, row group
        and row."""
        offsets = self._offsets
        if offsets is None or not len(docs):
            return
        got = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        want = offsets[indices + 1] - offsets[indices]
        bad = np.flatnonzero(got != want)
        if not len(bad):
            return
        i = int(bad[0])
        index = int(indices[i])
        file, group, row = self._row_place(index)
        folder = self._length_folder()
        fix = (
            "open the files again"
            if folder is None
            else f"remove {folder} and open the files again (with a new tokenizer_key if the "
            "tokenizer changed)"
        )
        raise DatasetIntegrityError(
            f"{file}: {group}, {row} (document {index}) has {plural(int(got[i]), 'token')}, the length "
            f"index says {int(want[i])}: the documents do not tokenize as when the index was built "
            f"(a tokenizer changed under the same tokenizer_key, or one that encodes a text "
            f"differently from one call to the next); {fix}"
        )

    def document_offsets_sync(self, positions: I64) -> I64:
        return self.build_length_index()[np.asarray(positions, dtype=np.int64)]

    def _row_of(self, index: int) -> tuple[int, int]:
        group = int(np.searchsorted(self._gstarts, index, side="right")) - 1
        return group, index - int(self._gstarts[group])

    def _row_place(self, index: int) -> list[Any]:
        group, row = self._row_of(index)
        e = self._entries[int(self._file_of[group])]
        return [self._shown(e.path), f"row group {int(self._group_in_file[group])}", f"row {row}"]

    def describe_document(self, index: int) -> dict[str, Any]:
        """Row ``index``: its file, row group and row, and its length in tokens (decoding its row
        group and, for a text, tokenizing that row: the whole length index is not built for it);
        where the length index is built (packing), its elements too. A text column without a
        tokenizer has no tokens: its length is ``None``."""
        place = [self._row_place(index)]
        if self._offsets is not None:
            start, stop = self._offsets[index : index + 2].tolist()
            return {"documents": [[index, 0, stop - start]], "elements": [[start, stop]], "files": [place]}
        (row,) = self._rows(np.asarray([index], dtype=np.int64))
        if self._kind == "text":
            length = None if self._encoder is None else len(self._encoder.encode_many([row])[0])
        else:
            length = len(row)
        return {"documents": [[index, 0, length]], "files": [place]}

    def locate(self, start: int, stop: int) -> list[list[Any]]:
        """The rows holding elements ``[start, stop)``: ``[file, "row group G", "row R"]`` each
        (known once the length index is built, as for packing; ``[]`` before)."""
        offsets = self._offsets
        if offsets is None or stop <= start:
            return []
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
        return [self._row_place(i) for i in range(first, last + 1) if offsets[i + 1] > offsets[i]]

    def _all_offsets_sync(self) -> I64:
        return self.build_length_index()


# -- the length index's files ----------------------------------------------------------------------
class _Stale(Exception):
    """A saved file of the length index that fails a check (the message names it and says why)."""


def _rebuilt(why: str, *paths: Path) -> None:
    """Say that a saved file of the length index is not used (and is built again), and remove it."""
    warnings.warn(f"{why}; the length index is built again", RuntimeWarning, stacklevel=4)
    for path in paths:
        path.unlink(missing_ok=True)


def _npy_bytes(array: npt.NDArray[Any]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_checked(path: Path, digest: str, count: int) -> I64:
    """The lengths saved in ``path``, if its bytes have ``digest`` (a prefix of their sha256)
    and it holds ``count`` non-negative integers; :class:`_Stale` naming it otherwise."""
    data = path.read_bytes()
    if len(digest) < 16 or not hashlib.sha256(data).hexdigest().startswith(digest):
        raise _Stale(f"{path}: its bytes do not match the digest recorded for them (damaged or edited)")
    try:
        lengths = np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise _Stale(f"{path}: not an array numpy reads ({exc})") from None
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or len(lengths) != count:
        raise _Stale(f"{path}: holds {lengths.dtype} of shape {lengths.shape}, not {count} lengths")
    if len(lengths) and int(lengths.min()) < 0:
        raise _Stale(f"{path}: holds a negative length")
    out: I64 = lengths.astype(np.int64)
    return out


def _offsets_of(lengths: I64) -> I64:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


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


def _read_index_cache(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    try:  # the text, then its sha256: a damaged index is rebuilt, never read
        text, _, digest = path.read_text().rpartition("\n")
        data = json.loads(text) if hashlib.sha256(text.encode()).hexdigest() == digest else {}
    except (OSError, ValueError):
        return {}
    return data.get("files", {}) if data.get("version") == _INDEX_VERSION else {}


def _write_index_cache(path: Path | None, entries: list[_FileEntry], key: Callable[[str], str]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    files = {
        key(e.path): {
            "size": e.size,
            "version": e.version,
            "rows": e.rows,
            "nbytes": e.nbytes,
            "kind": e.kind,
            "footer": e.footer,
        }
        for e in entries
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    text = json.dumps({"version": _INDEX_VERSION, "files": files})
    tmp.write_text(text + "\n" + hashlib.sha256(text.encode()).hexdigest())
    os.replace(tmp, path)


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


def parquet_columns(source: Any, **options: Any) -> tuple[list[str], list[tuple[str, str]]]:
    """The files ``source`` names and the columns of the first one (name, arrow type): what
    ``guideloom inspect`` shows before it knows which column to read."""
    files, paths, known = _resolve(source, options)
    first = paths[0]
    stat = known.get(first) or (files.stats([first]).get(first) if files.remote else files.stat(first))
    if stat is None:
        raise FileNotFoundError(f"no object {files.name(first)!r}")
    try:
        schema = files.footer(first, stat.size)[0].schema.to_arrow_schema()
    except (OSError, ValueError) as exc:
        if isinstance(exc, DatasetFormatError | StorageError | FileNotFoundError | PermissionError):
            raise
        raise DatasetFormatError(f"{files.name(first)}: damaged or not a Parquet file ({exc})") from None
    return [files.name(p) for p in paths], [(f.name, str(f.type)) for f in schema]


def open_parquet(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    column: str,
    *,
    tokenizer: TokenizerLike | None = None,
    bos: int | str | None = None,
    eos: int | str | None = None,
    dtype: Any = None,
    on_null: OnNull = "error",
    max_decoded_bytes: int = DEFAULT_DECODED_BYTES,
    cache_dir: str | os.PathLike[str] | None = None,
    threads: int = 32,
    fetch_ahead: int = DEFAULT_FETCH_AHEAD,
    tokenizer_key: str | None = None,
    **options: Any,
) -> ParquetStorage:
    """Open the rows of Parquet files as a document storage: row ``i`` of the files (a folder's
    or a glob's in sorted path order, a list's in the order given) is document ``i``.

    ``source``: a folder (every ``*.parquet`` under it), a glob (``data/train-*.parquet``), one
    file, or a list of files; local or ``s3://``, ``gs://``, ``az://``, ``http(s)://`` (an
    ``http(s)://`` folder cannot be listed: pass a list). ``column``: a string column (texts,
    or tokens with ``tokenizer=``) or a list-of-integers column (token ids). ``tokenizer``: a
    ``tokenizers.Tokenizer``, the path of a ``tokenizer.json``, or a callable from a text to
    token ids; ``bos``/``eos`` add those ids (or tokens, by name) around each document.
    ``on_null``: ``"error"`` (the default) or ``"empty"`` (a null row is an empty document,
    counted in ``stats()``). ``max_decoded_bytes``: decoded row groups kept in memory per
    process. ``fetch_ahead``: over an object store, the row groups a loader's upcoming reads
    need are fetched and decoded ahead, this many ranged GETs at once (0: each read fetches its
    own, one after another). ``cache_dir``: where the footer index and a length index (for packing) are kept
    between runs, each keyed by what it derives from. ``tokenizer_key``: a name for exactly this
    tokenizer (and its version), needed to cache the length index of a tokenizer callable (its
    contents cannot be read); change it whenever the callable changes. ``options``: how to reach
    an object store (see ``open_stream``).

    Opening reads the footers only, ``threads`` at a time. Raises ``FileNotFoundError`` for no
    files, :class:`~guideloom.DatasetFormatError` for a damaged footer, a missing column or a
    column of another kind in some file (naming it).
    """
    if on_null not in ("error", "empty"):
        raise ValueError(f"on_null must be 'error' or 'empty', got {on_null!r}")
    if not isinstance(column, str) or not column:
        raise TypeError(f"column must be a column name, got {column!r}")
    threads = check_int("threads", threads, 1)  # footers read at once
    max_decoded_bytes = check_int("max_decoded_bytes", max_decoded_bytes, 1)
    fetch_ahead = check_int("fetch_ahead", fetch_ahead, 0)
    _pq()
    cache = None if cache_dir is None else os.fspath(cache_dir)
    files, paths, known = _resolve(source, options)
    shown = files.name
    if len(set(paths)) != len(paths):
        twice = next(p for i, p in enumerate(paths) if p in paths[:i])
        raise ValueError(f"{shown(twice)!r} is named twice: each file's rows would be read twice")

    encoder = None if tokenizer is None else TextEncoder(tokenizer, bos=bos, eos=eos, dtype=dtype)
    if tokenizer is None and (bos is not None or eos is not None):
        raise ValueError("bos and eos apply to tokenizing a text column: pass tokenizer= too")
    if tokenizer_key is not None and (not isinstance(tokenizer_key, str) or not tokenizer_key):
        raise TypeError(
            f"tokenizer_key must be a non-empty string naming the tokenizer, got {tokenizer_key!r}"
        )
    if tokenizer_key is not None and tokenizer is None:
        raise ValueError("tokenizer_key names the tokenizer= a text column is read with: pass tokenizer= too")
    workers = max(1, min(threads, len(paths)))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    try:
        if files.remote:
            missing = [p for p in paths if p not in known]
            if missing:  # a listing recorded the others' versions: reads are conditional on them
                known.update(files.stats(missing))
            for p in paths:
                if p not in known:
                    raise FileNotFoundError(f"no object {shown(p)!r}")
        else:
            known = dict(zip(paths, pool.map(files.stat, paths), strict=True))
        index_file = None
        if cache is not None:
            digest = hashlib.sha256(json.dumps([shown(p) for p in paths] + [column]).encode()).hexdigest()[
                :24
            ]
            index_file = Path(cache) / f"parquet-index-{digest}.json"
        cached = _read_index_cache(index_file)

        def entry(path: str) -> _FileEntry:
            stat = known[path]
            hit = cached.get(shown(path))
            if hit and hit["size"] == stat.size and hit["version"] == stat.version:
                rows, nbytes = tuple(hit["rows"]), tuple(hit["nbytes"])
                return _FileEntry(path, stat.size, stat.version, rows, nbytes, hit["kind"], hit["footer"])
            return _entry(files, path, stat, column, shown(path))

        entries = list(pool.map(entry, paths))
    finally:
        pool.shutdown(wait=True)
    kinds = {e.kind for e in entries}
    if len(kinds) > 1:
        first = entries[0]
        other = next(e for e in entries if e.kind != first.kind)
        raise DatasetFormatError(
            f"column {column!r} differs between files: {_describe_kind(first.kind)} in {shown(first.path)}, "
            f"{_describe_kind(other.kind)} in {shown(other.path)}; rewrite them with one schema"
        )
    if cache is not None:
        _write_index_cache(index_file, entries, shown)
    if entries[0].kind == "text" and encoder is None and dtype is not None:
        raise ValueError(
            f"dtype= is the type of the tokens a tokenizer makes; column {column!r} holds texts, "
            "read as texts without one: pass tokenizer= too, or drop dtype="
        )
    if entries[0].kind != "text" and encoder is not None:
        raise ValueError(f"column {column!r} holds token ids already; drop tokenizer=")
    if entries[0].kind != "text" and dtype is not None:
        raise ValueError(
            f"dtype= is the type of the tokens a tokenizer makes; column {column!r} holds token ids "
            f"already, read as the files store them ({_describe_kind(entries[0].kind)}): drop dtype= "
            "(cast in collate_fn if you need another type)"
        )
    return ParquetStorage(
        files,
        entries,
        column,
        encoder=encoder,
        on_null=on_null,
        max_decoded_bytes=int(max_decoded_bytes),
        cache_dir=cache,
        fetch_ahead=int(fetch_ahead),
        tokenizer_key=tokenizer_key,
    )


def _describe_kind(kind: str) -> str:
    return "strings" if kind == "text" else f"lists of {kind.split(':', 1)[1]}"
