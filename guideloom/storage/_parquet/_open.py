"""Opening Parquet files: :func:`open_parquet` (the footers read in parallel, checked, and
indexed) and :func:`parquet_columns` (what ``guideloom inspect`` shows first)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Unpack

from guideloom._core.checks import check_int
from guideloom._errors import DatasetFormatError, StorageError
from guideloom.storage._parquet._files import _pq, _resolve
from guideloom.storage._parquet._footers import _entry, _FileEntry, _read_index_cache, _write_index_cache
from guideloom.storage._parquet._options import ParquetOptions, ParquetSettings
from guideloom.storage._parquet._storage import ParquetStorage
from guideloom.storage._text import TextEncoder


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
    **options: Unpack[ParquetOptions],
) -> ParquetStorage:
    """Open the rows of Parquet files as a document storage: row ``i`` of the files (a folder's
    or a glob's in sorted path order, a list's in the order given) is document ``i``.

    ``source``: a folder (every ``*.parquet`` under it), a glob (``data/train-*.parquet``), one
    file, or a list of files; local or ``s3://``, ``gs://``, ``az://``, ``http(s)://`` (an
    ``http(s)://`` folder cannot be listed: pass a list). ``column``: a string column (texts,
    or tokens with ``tokenizer=``) or a list-of-integers column (token ids). ``tokenizer``: a
    ``tokenizers.Tokenizer``, the path of a ``tokenizer.json``, or a callable from a text to
    token ids; ``bos``/``eos`` add those ids (or tokens, by name) around each document;
    ``dtype``: the dtype of the tokens a tokenizer makes (default ``uint32``; ``int64`` for a
    vocabulary over ``2**32`` ids).
    ``on_null``: ``"error"`` (the default) or ``"empty"`` (a null row is an empty document,
    counted in ``stats()``). ``max_decoded_bytes``: decoded row groups kept in memory per
    process. ``fetch_ahead``: over an object store, the row groups a loader's upcoming reads
    need are fetched and decoded ahead, this many ranged GETs at once (0: each read fetches its
    own, one after another). Where a text column is tokenized as it is read (packing, a
    mixture), one thread decodes and tokenizes ahead whatever ``fetch_ahead`` says, as over
    local files, and two at most over an object store: the tokenizer is the bound.
    ``cache_dir``: where the footer index and a length index (for packing) are kept between
    runs, each keyed by what it derives from. ``tokenizer_key``: a
    name for exactly this tokenizer (and its version), needed to cache the length index of a
    tokenizer callable (its contents cannot be read); change it whenever the callable changes.
    ``options``: how to reach an object store (see ``open_stream``). The keys and their types:
    :class:`ParquetOptions`.

    Opening reads the footers only, ``threads`` at a time. Raises ``FileNotFoundError`` for no
    files, :class:`~guideloom.DatasetFormatError` for a damaged footer, a missing column or a
    column of another kind in some file (naming it).
    """
    settings = ParquetSettings.of(options)
    tokenizer, bos, eos, dtype = settings.tokenizer, settings.bos, settings.eos, settings.dtype
    on_null, tokenizer_key = settings.on_null, settings.tokenizer_key
    if on_null not in ("error", "empty"):
        raise ValueError(f"on_null must be 'error' or 'empty', got {on_null!r}")
    if not isinstance(column, str) or not column:
        raise TypeError(f"column must be a column name, got {column!r}")
    threads = check_int("threads", settings.threads, 1)  # footers read at once
    max_decoded_bytes = check_int("max_decoded_bytes", settings.max_decoded_bytes, 1)
    fetch_ahead = check_int("fetch_ahead", settings.fetch_ahead, 0)
    _pq()
    cache = None if settings.cache_dir is None else os.fspath(settings.cache_dir)
    files, paths, known = _resolve(source, settings.store)
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
