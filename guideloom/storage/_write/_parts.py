"""A dataset prepared in parts: where the parts lie, and the manifest over them.

Each part is a dataset of its own in a folder under the destination (``parts/...``), written by
one task of ``guideloom prepare --tasks N`` or one write task of a Ray datasink. The merged
manifest names the parts' data files where they are, reading only the part manifests. Where a
part's values count from the part's start (document offsets, ``doc_id``), the merged manifest
gives each of its files a ``base`` (the documents or tokens before the part), so no data file
is rewritten. See the "Datasets prepared in parts" section of docs/format.md.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from guideloom._core.text import plural
from guideloom._errors import DatasetFormatError
from guideloom.storage._api import local_folder
from guideloom.storage._format._manifest import MANIFEST_NAME, ArraySpec, FileSpec, Manifest, parse_manifest
from guideloom.storage._write._sinks import LocalSink, Sink, fsync_dir, write_synced

__all__ = [
    "PARTS",
    "Root",
    "check_present",
    "clear_parts",
    "commit_merged",
    "merged_manifest",
    "open_root",
    "parse_part_name",
    "part_folder",
    "part_manifests_in",
    "read_parts",
    "relocated",
]

PARTS = "parts"
"""The folder under the destination that holds the parts."""
_PART_RE = re.compile(r"^part-(\d{5,})-of-(\d{5,})$")
_READERS = 32  # part manifests read at once from an object store


def part_folder(task: int, tasks: int) -> str:
    """The part folder of task ``task`` (from 0) of ``tasks``, relative to the destination."""
    return f"{PARTS}/part-{task:05d}-of-{tasks:05d}"


def parse_part_name(folder: str) -> tuple[int, int] | None:
    """``(task, tasks)`` of a part folder's name, or None for another name."""
    m = _PART_RE.match(folder.rsplit("/", 1)[-1])
    return (int(m.group(1)), int(m.group(2))) if m else None


class Root(Protocol):
    """The destination, as the tasks and the merge see it."""

    def read(self, relpath: str) -> bytes | None:
        """A small file's bytes, or None when it does not exist."""
        ...

    def part_manifests(self) -> set[str]:
        """The part folders (``parts/part-...``) that hold a manifest."""
        ...

    def files(self, folder: str) -> set[str]:
        """Every file under ``folder`` (recursively), relative to the destination: one listing."""
        ...

    def folders(self) -> set[str]:
        """The folders directly under ``parts/`` (``parts/part-...``), with a manifest or not."""
        ...

    def clear(self, folder: str) -> None:
        """Remove what an interrupted write left in ``folder``."""
        ...

    def location(self, relpath: str) -> str:
        """``relpath`` as a destination the writers take."""
        ...

    def sink(self) -> Sink:
        """A sink for the destination itself (the merged manifest)."""
        ...

    def publish(self, relpath: str, data: bytes) -> bool:
        """Create ``relpath`` holding ``data``, whole, unless it exists: one atomic step that at
        most one of several writers at once wins. False where it existed (nothing written)."""
        ...

    def remove(self, relpath: str) -> None:
        """Remove one file (none there: nothing to do)."""
        ...

    def prune(self, folder: str, keep: str) -> None:
        """Remove everything in ``folder`` but its manifest and its subfolder ``keep``."""
        ...


class _LocalRoot:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def read(self, relpath: str) -> bytes | None:
        try:
            return (self.folder / relpath).read_bytes()
        except FileNotFoundError:
            return None

    def part_manifests(self) -> set[str]:
        parts = self.folder / PARTS
        if not parts.is_dir():
            return set()
        return {f"{PARTS}/{p.name}" for p in parts.iterdir() if (p / MANIFEST_NAME).is_file()}

    def files(self, folder: str) -> set[str]:
        out: set[str] = set()
        stack = [folder]
        while stack:
            rel = stack.pop()
            try:
                entries = os.scandir(self.folder / rel)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(f"{rel}/{e.name}")
                    else:
                        out.add(f"{rel}/{e.name}")
        return out

    def folders(self) -> set[str]:
        parts = self.folder / PARTS
        return {f"{PARTS}/{p.name}" for p in parts.iterdir() if p.is_dir()} if parts.is_dir() else set()

    def clear(self, folder: str) -> None:
        shutil.rmtree(self.folder / folder, ignore_errors=True)

    def location(self, relpath: str) -> str:
        return str(self.folder / relpath)

    def sink(self) -> Sink:
        return LocalSink(self.folder)

    def publish(self, relpath: str, data: bytes) -> bool:
        final = self.folder / relpath
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(6)}.tmp")
        write_synced(tmp, data)
        try:
            os.link(tmp, final)  # a hard link fails where the name exists: create-only, whole
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: an exclusive create, then the bytes
            try:
                fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(final.parent)
        return True

    def remove(self, relpath: str) -> None:
        (self.folder / relpath).unlink(missing_ok=True)

    def prune(self, folder: str, keep: str) -> None:
        try:
            entries = list(os.scandir(self.folder / folder))
        except FileNotFoundError:
            return
        for e in entries:
            if e.name in (MANIFEST_NAME, keep):
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                Path(e.path).unlink(missing_ok=True)


class _ObjectRoot:
    def __init__(self, url: str) -> None:
        from guideloom.storage._write._sinks import ObjectSink

        self.url = url.rstrip("/")
        self._sink = ObjectSink(self.url, {})
        self.store = self._sink.store

    def read(self, relpath: str) -> bytes | None:
        import obstore

        try:
            return bytes(obstore.get(self.store, relpath).bytes())
        except FileNotFoundError:
            return None
        except Exception as exc:
            error = self._sink.error(exc, f"cannot read {self.url}/{relpath}")
        raise error

    def _list(self, prefix: str) -> list[str]:
        import obstore

        try:
            return [meta["path"] for batch in obstore.list(self.store, prefix=prefix) for meta in batch]
        except Exception as exc:
            error = self._sink.error(exc, f"cannot list {self.url}/{prefix}")
        raise error

    def part_manifests(self) -> set[str]:
        return part_manifests_in(self.files(PARTS))

    def files(self, folder: str) -> set[str]:
        return set(self._list(folder + "/"))

    def folders(self) -> set[str]:
        return {"/".join(p.split("/")[:2]) for p in self._list(PARTS + "/") if p.count("/") >= 2}

    def clear(self, folder: str) -> None:
        self._sink._delete(self._list(folder + "/"))

    def location(self, relpath: str) -> str:
        return f"{self.url}/{relpath}"

    def sink(self) -> Sink:
        return self._sink

    def publish(self, relpath: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        try:  # a conditional PUT (If-None-Match: *): the store refuses a second one
            obstore.put(self.store, relpath, data, mode="create", use_multipart=False)
        except AlreadyExistsError:
            return False
        except Exception as exc:
            error = self._sink.error(exc, f"cannot write {self.url}/{relpath}")
        else:
            return True
        raise error

    def remove(self, relpath: str) -> None:
        self._sink._delete([relpath])

    def prune(self, folder: str, keep: str) -> None:
        mine = (f"{folder}/{MANIFEST_NAME}", f"{folder}/{keep}/")
        self._sink._delete(
            [p for p in self._list(folder + "/") if p != mine[0] and not p.startswith(mine[1])]
        )


def part_manifests_in(files: Iterable[str]) -> set[str]:
    """The part folders (``parts/part-...``) whose manifest is among ``files`` (a listing)."""
    suffix = "/" + MANIFEST_NAME
    return {p[: -len(suffix)] for p in files if p.endswith(suffix) and p.count("/") == 2}


def clear_parts(root: Root, *, keep_tasks: int | None = None) -> list[str]:
    """Remove the folders under ``parts/`` (the removed ones, sorted): all of them, or all but
    the parts of a run of ``keep_tasks`` tasks (``part-*-of-N``), which the other tasks of that
    run write. A destination replaced by ``--overwrite`` keeps no parts of an earlier run, whose
    manifests would name data files the replacement removed."""
    gone = sorted(
        name
        for name in root.folders()
        if keep_tasks is None or (slot := parse_part_name(name)) is None or slot[1] != keep_tasks
    )
    for name in [PARTS] if keep_tasks is None else gone:
        root.clear(name)
    return gone


def check_present(manifest: Manifest, files: set[str], dest: str) -> None:
    """Refuse a merged ``manifest`` that names a data file missing from ``files`` (the listing of
    ``parts/`` the merge made): its part manifest outlived its data (a replaced dataset)."""
    missing = [f.path for _, _, f in manifest.all_files() if f.path not in files]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise DatasetFormatError(
            f"{dest}: {plural(len(missing), 'data file')} named by the part manifests "
            f"{'is' if len(missing) == 1 else 'are'} missing ({shown}); the parts are stale (their "
            "dataset was replaced): prepare them again with --overwrite"
        )


def open_root(dest: str) -> Root:
    folder = local_folder(dest)
    return _LocalRoot(folder) if folder is not None else _ObjectRoot(dest)


def read_parts(root: Root, names: list[str]) -> list[Manifest]:
    """The manifests of the part folders ``names`` (concurrently from an object store)."""

    def one(name: str) -> Manifest:
        where = f"{name}/{MANIFEST_NAME}"
        data = root.read(where)
        if data is None:
            raise DatasetFormatError(f"{where} disappeared while the parts were merged; merge again")
        return parse_manifest(data, where)

    if isinstance(root, _LocalRoot) or len(names) < 2:
        return [one(n) for n in names]
    with concurrent.futures.ThreadPoolExecutor(_READERS) as pool:
        return list(pool.map(one, names))


def _moved(files: Iterable[FileSpec], prefix: str, base: int = 0) -> list[FileSpec]:
    return [f.moved(prefix, base) for f in files]


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    keys = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} here, {b.get(k)!r} in part 0" for k in keys) or "its fingerprint"


def _check_same(names: list[str], parts: list[Manifest], numbered: bool) -> None:
    first = parts[0]
    first_part = first.extra.get("part") or {}
    for i, (name, m) in enumerate(zip(names, parts, strict=True)):
        part = m.extra.get("part")
        if not isinstance(part, dict):
            raise DatasetFormatError(f"{name}/{MANIFEST_NAME} is not a part's manifest (no 'part' record)")
        if numbered and (part.get("task") != i or part.get("tasks") != len(parts)):
            raise DatasetFormatError(
                f"{name}/{MANIFEST_NAME} is not the manifest of task {i} of {len(parts)} (its 'part' "
                "record says otherwise, or is missing); prepare that part again with --overwrite"
            )
        if part.get("fingerprint") != first_part.get("fingerprint"):
            raise DatasetFormatError(
                f"{name} was prepared with other options or inputs than part 0 "
                f"({_differences(part.get('options') or {}, first_part.get('options') or {})}); "
                "prepare it again with the same command (and --overwrite), or all parts anew"
            )
        if m.kind != first.kind or list(m.fields) != list(first.fields):
            raise DatasetFormatError(
                f"{name} is a {m.kind} dataset with fields {list(m.fields)}, unlike part 0"
            )
        for field, spec in m.fields.items():
            if spec.dtype != first.fields[field].dtype:
                raise DatasetFormatError(
                    f"{name}: field {field!r} is {spec.dtype.name}, part 0's is "
                    f"{first.fields[field].dtype.name}; parts of one dataset store each field in "
                    "one dtype (a part over 2**32 documents or with a document over 2**32 "
                    "tokens needs wider ids: prepare with fewer tasks)"
                )


def merged_manifest(names: list[str], parts: list[Manifest], *, numbered: bool = True) -> Manifest:
    """The manifest over ``parts`` (the part manifests in task order, under folders ``names``).

    ``numbered``: each part's ``info.part`` says it is task ``i`` of ``len(parts)``.
    """
    if not parts:
        raise DatasetFormatError("there are no parts to merge")
    _check_same(names, parts, numbered)
    first = parts[0]
    fields: dict[str, list[FileSpec]] = {name: [] for name in first.fields}
    offsets: list[FileSpec] = []
    tokens_before = documents_before = 0
    for name, m in zip(names, parts, strict=True):
        documents = int(m.extra.get("documents", m.num_documents))
        for field, spec in m.fields.items():
            base = documents_before if field == "doc_id" else 0
            fields[field] += _moved(spec.files, name, base)
        if m.offsets is not None:
            head, *ends = m.offsets.files
            if head.elements != 1:
                raise DatasetFormatError(
                    f"{name}: its first offsets file holds {head.elements} values, not the one (0) "
                    "that parts keep apart; prepare it again with --overwrite"
                )
            if not offsets:
                offsets.append(head.moved(name))
            offsets += _moved(ends, name, tokens_before)
        tokens_before += m.num_elements
        documents_before += documents
    _check_ids_fit(first, documents_before)
    extra = {k: v for k, v in first.extra.items() if k != "part"}
    for key in ("documents", "tokens", "skipped_invalid"):
        if key in extra:
            extra[key] = sum(int(m.extra.get(key, 0)) for m in parts)
    options = (first.extra.get("part") or {}).get("options") or {}
    if "source_files" in options:
        extra["source_files"] = options["source_files"]
    extra["parts"] = {"tasks": len(parts), "folder": PARTS}
    record = first.extra.get("part") or {}
    if "fingerprint" in record:  # what a task of another run is told apart by
        extra["parts"]["fingerprint"] = record["fingerprint"]
    specs = {name: ArraySpec(first.fields[name].dtype, tuple(files)) for name, files in fields.items()}
    offsets_spec = ArraySpec(np.dtype("<i8"), tuple(offsets)) if first.offsets is not None else None
    num_documents = sum(m.num_documents for m in parts)
    return Manifest(
        kind=first.kind, fields=specs, offsets=offsets_spec, num_documents=num_documents, extra=extra
    )


def relocated(manifest: Manifest, prefix: str) -> Manifest:
    """``manifest`` as the folder above ``prefix`` names it: each file as ``prefix/path``."""
    fields = {n: ArraySpec(a.dtype, tuple(_moved(a.files, prefix))) for n, a in manifest.fields.items()}
    offsets = manifest.offsets
    if offsets is not None:
        offsets = ArraySpec(offsets.dtype, tuple(_moved(offsets.files, prefix)))
    return Manifest(manifest.kind, fields, offsets, manifest.num_documents, dict(manifest.extra))


def _check_ids_fit(first: Manifest, documents: int) -> None:
    """Values with a base must still fit their dtype: ``doc_id`` up to ``documents - 1``."""
    spec = first.fields.get("doc_id")
    if spec is not None and spec.dtype.kind in "iu" and documents - 1 > np.iinfo(spec.dtype).max:
        raise DatasetFormatError(
            f"the parts hold {documents:,} documents, more than doc_id's {spec.dtype.name} numbers; "
            "prepare the dataset in one run, or without --document-ids"
        )


def commit_merged(root: Root, manifest: Manifest) -> None:
    """Write ``manifest`` as the destination's, replacing (and removing the files of) the dataset
    there unless the new one names them too."""
    sink = root.sink()
    replaced = sink.prepare(overwrite=True)
    sink.commit(manifest, replaced)
