"""Finding input files and cutting them into tasks for the tokenizing workers.

Inputs are files, globs and folders. A folder is walked recursively and its files are taken in
sorted order of their path within it; a glob's matches are sorted too; the inputs themselves keep
the order they were given in. Reading happens in the main process (sequentially, so the output
order is fixed); parsing and tokenizing happen in :func:`guideloom._cli._work.process`, possibly
in worker processes, on tasks of about ``task_bytes`` of input each.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import gzip
import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, cast

from guideloom._cli._common import InputError, UsageError, require

__all__ = ["FORMATS", "InputFile", "Task", "expand_inputs", "inputs_fingerprint", "iter_tasks", "share_of"]

Format = Literal["text", "jsonl", "parquet"]
FORMATS: tuple[Format, ...] = ("text", "jsonl", "parquet")
_EXTENSIONS: dict[str, Format] = {
    ".txt": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class InputFile:
    path: Path
    format: Format
    compression: str | None
    size: int
    span: tuple[int, int] | None = None
    """An uncompressed JSONL file's share: the lines that start in ``[span[0], span[1])``
    (``None``: the whole file). See :func:`share_of`."""


@dataclass(frozen=True, slots=True)
class Task:
    """A unit of work: whole text files, a block of whole JSON lines, or a batch of parquet rows."""

    kind: Format
    source: str
    """The file name that messages quote."""
    payload: Any
    """text: ``list[InputFile]``; jsonl: ``bytes`` of whole lines, or ``(path, start, stop)`` of an
    uncompressed file (see :func:`read_range`); parquet: ``list`` of the rows' values."""
    first: int
    """parquet: the index of the first row; jsonl: 0 for a file's first task, then -1 (the workers
    count lines, and line numbers are made absolute as results come back in order)."""
    disk_bytes: int
    """How much of the input files (as stored) this task accounts for, for the progress bar."""
    names: tuple[str, ...] = field(default=())
    """text: the file name of each document."""


def _classify(path: Path, forced: str) -> tuple[Format | None, str | None]:
    suffixes = path.name.lower()
    compression = None
    for ext, comp in _COMPRESSIONS.items():
        if suffixes.endswith(ext):
            compression = comp
            suffixes = suffixes[: -len(ext)]
            break
    if forced != "auto":
        return forced, compression  # type: ignore[return-value]
    return _EXTENSIONS.get(os.path.splitext(suffixes)[1]), compression


def _walk(folder: Path, include: Sequence[str], forced: str) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in files:
            if name.startswith("."):
                continue
            path = Path(root, name)
            if include:
                if any(fnmatch.fnmatch(name, pat) for pat in include):
                    found.append(path)
            elif forced != "auto" or _classify(path, "auto")[0] is not None:
                found.append(path)
    found.sort(key=lambda p: p.relative_to(folder).as_posix())
    return found


def expand_inputs(
    inputs: Sequence[str], *, include: Sequence[str] = (), forced: str = "auto"
) -> list[InputFile]:
    """Resolve the command line's inputs to files, in order, each file once.

    A folder contributes the files whose format is known from their extension (``.txt``,
    ``.jsonl``, ``.ndjson``, ``.parquet``, each optionally ``.gz``/``.zst``), or those whose
    name matches one of ``include``; a file named directly or matched by a glob is read whatever
    its extension (an unknown one is read as text).
    """
    paths: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            found = _walk(p, include, forced)
            if not found:
                what = " or ".join(include) if include else "known extension (.txt, .jsonl, .parquet, ...)"
                raise UsageError(f"input folder {item!r} holds no files of {what}; use --include '*.ext'")
            paths += found
        elif p.is_file():
            paths.append(p)
        elif _GLOB_CHARS & set(item):
            matches = sorted(glob.glob(os.path.expanduser(item), recursive=True))
            if not matches:
                raise UsageError(f"input {item!r} matches no files")
            for m in matches:
                mp = Path(m)
                paths += _walk(mp, include, forced) if mp.is_dir() else [mp]
        else:
            raise UsageError(f"input {item!r}: no such file or folder")
    seen: set[str] = set()
    files = []
    for p in paths:
        key = os.path.realpath(p)
        if key in seen:
            continue
        seen.add(key)
        fmt, compression = _classify(p, forced)
        files.append(InputFile(p, fmt or "text", compression, p.stat().st_size))
    return files


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of the zstd frames in ``raw``; refuses a file cut inside a frame.

    zstandard's ``stream_reader`` returns what it has when the file ends in the middle of a frame,
    so a truncated file would read as a shorter one; its ``decompressobj`` says when a frame is
    complete (``eof``), one frame per object, and hands back the bytes past it (``unused_data``),
    where the next frame starts. Compressed input is fed ``read_size`` bytes at a time, which
    bounds the output of one step to what those bytes expand to. Errors are ``EOFError`` for a
    cut file (as :mod:`gzip` raises) and ``ValueError`` for bytes that are not zstd.
    """

    def __init__(self, zstandard: Any, raw: IO[bytes], read_size: int = 2**17) -> None:
        super().__init__()
        self._zstandard = zstandard
        self._dctx = zstandard.ZstdDecompressor()
        self._raw = raw
        self._read_size = read_size
        self._frame: Any = None  # the decompressobj of the frame under way; None between frames
        self._pending = b""  # compressed bytes read past the end of the last frame
        self._out = b""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def _fill(self, read_size: int = 0) -> bool:
        """Decompress another step into ``_out``; False at the end of the last whole frame."""
        data, self._pending = self._pending or self._raw.read(read_size or self._read_size), b""
        if not data:
            if self._frame is not None:
                raise EOFError("the file ends inside a zstd frame (truncated?)")
            return False
        if self._frame is None:
            self._frame = self._dctx.decompressobj()
        try:
            out = self._frame.decompress(data)
        except self._zstandard.ZstdError as exc:
            raise ValueError(f"not valid zstd data ({exc})") from None
        if self._frame.eof:
            self._pending, self._frame = self._frame.unused_data, None
        self._out, self._pos = out, 0
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        while self._pos >= len(self._out):
            if size == 0 or not self._fill():
                return b""
        part = self._out[self._pos : self._pos + size]
        self._pos += len(part)
        return part

    def readall(self) -> bytes:
        parts = [self._out[self._pos :]]
        while self._fill(2**20):  # all of it is kept anyway: fewer, larger steps
            parts.append(self._out)
        self._out, self._pos = b"", 0
        return b"".join(parts)

    def readinto(self, buffer: Any) -> int:
        part = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[: len(part)] = part
        return len(part)


@contextmanager
def _open(f: InputFile) -> Iterator[tuple[IO[bytes], IO[bytes]]]:
    """(decompressed stream, raw file): the raw one's position measures progress.

    A compressed file that ends early, or is not in its format, raises ``EOFError``, ``OSError``
    or ``ValueError`` as it is read (the readers below turn them into an :class:`InputError`).
    """
    with open(f.path, "rb") as raw:
        if f.compression == "gzip":
            yield cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb")), raw
        elif f.compression == "zstd":
            zstandard = require("zstandard", f"reading {f.path.name}")
            yield cast(IO[bytes], _ZstdReader(zstandard, raw)), raw
        else:
            yield raw, raw


def _read_all(f: InputFile) -> bytes:
    try:
        with _open(f) as (stream, _raw):
            return stream.read()
    except (OSError, EOFError, ValueError) as exc:
        raise InputError(f"{f.path}: cannot read: {exc}") from None


def _read_block(stream: IO[bytes], size: int) -> bytes:
    """Up to ``size`` bytes, fewer only at the end (decompressors may return short reads)."""
    parts = []
    want = size
    while want > 0:
        part = stream.read(want)
        if not part:
            break
        parts.append(part)
        want -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _jsonl_tasks(f: InputFile, task_bytes: int) -> Iterator[Task]:
    name = str(f.path)
    if f.compression is None:
        # The workers read their own byte ranges: the main process does not touch the data.
        low, high = f.span or (0, max(f.size, 1))
        for start in range(low, high, task_bytes):
            stop = min(f.size, start + task_bytes)
            yield Task("jsonl", name, (name, start, stop), 0 if start == 0 else -1, stop - start)
        return
    first = 0
    carry = b""
    told = 0
    try:
        with _open(f) as (stream, raw):
            while True:
                block = _read_block(stream, task_bytes)
                if not block:
                    break
                data = carry + block if carry else block
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    carry = data
                    continue
                carry = data[cut:]
                chunk = data[:cut]
                pos = raw.tell()
                yield Task("jsonl", name, chunk, first, pos - told)
                told, first = pos, -1
    except (OSError, EOFError, ValueError) as exc:
        raise InputError(f"{name}: cannot read: {exc}") from None
    yield Task("jsonl", name, carry, first, f.size - told)


@contextmanager
def _seekable(f: InputFile) -> Iterator[str]:
    """A path to the file's decompressed bytes (parquet needs to seek)."""
    if f.compression is None:
        yield str(f.path)
        return
    with tempfile.NamedTemporaryFile(suffix=".parquet") as tmp:
        try:
            with _open(f) as (stream, _raw):
                shutil.copyfileobj(stream, tmp, 8 * 2**20)
        except (OSError, EOFError, ValueError) as exc:
            raise InputError(f"{f.path}: cannot read: {exc}") from None
        tmp.flush()
        yield tmp.name


def _parquet_tasks(f: InputFile, field_name: str, task_bytes: int) -> Iterator[Task]:
    pq = require("pyarrow.parquet", f"reading {f.path.name}")
    name = str(f.path)
    with _seekable(f) as path:
        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
            raise InputError(f"{name}: not a readable parquet file: {exc}") from None
        columns = pf.schema_arrow.names
        if field_name not in columns:
            raise InputError(
                f"{name}: has no column {field_name!r} (columns: {', '.join(columns)}); use --field"
            )
        total_rows = max(1, pf.metadata.num_rows)
        rows: list[Any] = []
        nbytes = 0
        first = 0
        done_rows = 0
        told = 0
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[field_name]):
                col = batch.column(0)
                rows += col.to_pylist()
                nbytes += col.nbytes
                if nbytes >= task_bytes:
                    done_rows = first + len(rows)
                    disk = f.size * done_rows // total_rows - told
                    told += disk
                    yield Task("parquet", name, rows, first, disk)
                    first, rows, nbytes = done_rows, [], 0
        except Exception as exc:
            if isinstance(exc, InputError):
                raise
            raise InputError(f"{name}: cannot read: {exc}") from None
        yield Task("parquet", name, rows, first, f.size - told)


def _text_tasks(files: list[InputFile], task_bytes: int) -> Iterator[Task]:
    """Consecutive text files, grouped; the worker reads (and decompresses) them."""
    group: list[InputFile] = []
    disk = 0
    for f in files:
        group.append(f)
        disk += f.size
        if disk >= task_bytes:
            yield Task("text", str(group[0].path), group, 0, disk, tuple(str(g.path) for g in group))
            group, disk = [], 0
    if group:
        yield Task("text", str(group[0].path), group, 0, disk, tuple(str(g.path) for g in group))


def read_text_file(f: InputFile) -> bytes:
    """A text task's file, decompressed (in the worker)."""
    return _read_all(f)


def read_range(path: str, start: int, stop: int) -> bytes:
    """The whole lines of an uncompressed file that *start* in ``[start, stop)`` (in the worker)."""
    try:
        with open(path, "rb") as fh:
            if start > 0:
                fh.seek(start - 1)
                if fh.read(1) != b"\n":
                    fh.readline()  # the line under way belongs to the task before
            begin = fh.tell()
            if begin >= stop:
                return b""
            data = fh.read(stop - begin)
            if data and not data.endswith(b"\n"):
                data += fh.readline()
            return data
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None


def iter_tasks(files: Sequence[InputFile], *, field_name: str, task_bytes: int) -> Iterator[Task]:
    """The tasks for ``files``, in order; consecutive text files share tasks."""
    i = 0
    while i < len(files):
        if files[i].format == "text":
            j = i
            while j < len(files) and files[j].format == "text":
                j += 1
            yield from _text_tasks(list(files[i:j]), task_bytes)
            i = j
            continue
        f = files[i]
        if f.format == "jsonl":
            yield from _jsonl_tasks(f, task_bytes)
        else:
            yield from _parquet_tasks(f, field_name, task_bytes)
        i += 1


def _units(f: InputFile, task_bytes: int) -> list[tuple[int, int]]:
    """The pieces a file can be shared out in without reading it: an uncompressed JSONL file's
    ``task_bytes`` blocks (the grid the tasks use), else the whole file."""
    if f.format == "jsonl" and f.compression is None and f.size > task_bytes:
        return [(a, min(f.size, a + task_bytes)) for a in range(0, f.size, task_bytes)]
    return [(0, f.size)]


def share_of(files: Sequence[InputFile], *, task_bytes: int, task: int, tasks: int) -> list[InputFile]:
    """Task ``task``'s share of ``files`` when ``tasks`` tasks prepare them: consecutive pieces
    (whole files, or blocks of an uncompressed JSONL file) of about ``1/tasks`` of the bytes.

    Shares follow the inputs' order, the concatenation of all shares is all of the inputs, and
    each piece is read as it would be by one task: so the parts of a dataset prepared by any
    number of tasks, taken in task order, hold what one machine's ``prepare`` writes. Computed
    from the file list and sizes alone, so every task finds the same shares without reading data.
    """
    pieces = [(i, a, b) for i, f in enumerate(files) for a, b in _units(f, task_bytes)]
    total = sum(b - a for _, a, b in pieces)
    out: list[InputFile] = []
    done = 0
    for i, a, b in pieces:
        middle = done + (b - a) / 2  # the share whose byte range holds the piece's middle
        owner = min(tasks - 1, int(middle * tasks / total)) if total else 0
        done += b - a
        if owner != task:
            continue
        f = files[i]
        whole = (a, b) == (0, f.size)
        if out and out[-1].path == f.path and out[-1].span is not None:
            out[-1] = dataclasses.replace(out[-1], span=(out[-1].span[0], b))
        else:
            out.append(f if whole else dataclasses.replace(f, span=(a, b)))
    return [f if f.span != (0, f.size) else dataclasses.replace(f, span=None) for f in out]


def inputs_fingerprint(files: Sequence[InputFile]) -> str:
    """A digest of the input list (each file's path, format and size): parts prepared from other
    inputs are told apart."""
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        h.update(f"{f.path}\0{f.format}\0{f.compression}\0{f.size}\n".encode())
    return h.hexdigest()
