"""What ``source`` names: a folder, a glob, a file or a list, local or on one store prefix,
resolved to files in sorted path order (hidden names skipped as pyarrow, Spark and Hugging Face
skip them)."""

from __future__ import annotations

import fnmatch
import glob as globlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from guideloom.storage._parquet._files import _has_glob, _is_remote, _LocalFiles, _RemoteFiles, _Stat


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
