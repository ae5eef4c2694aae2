"""The index of the files: what each footer says of the column (rows and bytes per row group,
its kind), checked against the column chunks; kept between runs in ``cache_dir``."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError, DatasetIntegrityError, StorageError
from guideloom.storage._parquet._files import _pa, _Stat

_INDEX_VERSION = 2


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
