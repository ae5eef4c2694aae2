"""``prepare --task I --tasks N`` and ``prepare --merge``: a dataset prepared in parts.

Task ``I`` of ``N`` prepares its share of the inputs (:func:`guideloom._cli._inputs.share_of`)
into ``parts/part-IIIII-of-NNNNN/`` under the destination: a dataset of its own, whose manifest
records the task, the options and the inputs it was prepared from. The merge writes the
destination's ``manifest.json`` over all ``N`` parts: it names their data files where they are
(``parts/part-.../tokens-....bin``), reading only the part manifests. Where a part's values
count from the part's start (document offsets, ``doc_id``), the merged manifest gives each of
its files a ``base`` (the documents or tokens before the part), so no data file is rewritten.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from guideloom._cli._common import CLIError, UsageError
from guideloom._errors import DatasetFormatError
from guideloom.storage._api import local_folder
from guideloom.storage._manifest import MANIFEST_NAME, ArraySpec, FileSpec, Manifest, parse_manifest
from guideloom.storage._sinks import LocalSink, Sink

__all__ = [
    "PARTS",
    "Root",
    "TaskSlot",
    "merge_parts",
    "open_root",
    "part_folder",
    "part_options",
    "task_from_environment",
]

PARTS = "parts"
"""The folder under the destination that holds the parts."""
_PART_RE = re.compile(r"^part-(\d{5,})-of-(\d{5,})$")
_READERS = 32  # part manifests read at once from an object store


def part_folder(task: int, tasks: int) -> str:
    """The part folder of task ``task`` (from 0) of ``tasks``, relative to the destination."""
    return f"{PARTS}/part-{task:05d}-of-{tasks:05d}"


@dataclass(frozen=True, slots=True)
class TaskSlot:
    task: int
    """From 0."""
    tasks: int


def task_from_environment(env: Mapping[str, str]) -> TaskSlot | None:
    """The task of a Slurm array job: ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` of
    ``SLURM_ARRAY_TASK_COUNT`` (an array ``--array=1-64`` is tasks 0..63 of 64), or None outside
    one. An array with gaps or steps (``--array=0-63:2``, ``--array=1,5,9``) has no such
    numbering: it is refused, and ``--task``/``--tasks`` name the task instead."""
    raw = env.get("SLURM_ARRAY_TASK_ID")
    if raw is None:
        return None
    try:
        task_id = int(raw)
        count = int(env["SLURM_ARRAY_TASK_COUNT"])
        low = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        high = int(env.get("SLURM_ARRAY_TASK_MAX", str(low + count - 1)))
    except (KeyError, ValueError):
        raise UsageError(
            "SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT/MIN/MAX are missing or not "
            "integers; pass --task I --tasks N"
        ) from None
    if high - low + 1 != count or not low <= task_id <= high:
        raise UsageError(
            f"the Slurm array (tasks {low}..{high}, {count} of them) is not one contiguous range of "
            "ids, so its tasks cannot be numbered 0..N-1: use --array=0-N-1 (or 1-N), or pass "
            "--task I --tasks N"
        )
    return TaskSlot(task_id - low, count)


class Root(Protocol):
    """The destination, as the tasks and the merge see it."""

    def read(self, relpath: str) -> bytes | None:
        """A small file's bytes, or None when it does not exist."""
        ...

    def part_manifests(self) -> set[str]:
        """The part folders (``parts/part-...``) that hold a manifest."""
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

    def clear(self, folder: str) -> None:
        shutil.rmtree(self.folder / folder, ignore_errors=True)

    def location(self, relpath: str) -> str:
        return str(self.folder / relpath)

    def sink(self) -> Sink:
        return LocalSink(self.folder)


class _ObjectRoot:
    def __init__(self, url: str) -> None:
        from guideloom.storage._sinks import ObjectSink

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
        suffix = "/" + MANIFEST_NAME
        return {
            p[: -len(suffix)] for p in self._list(PARTS + "/") if p.endswith(suffix) and p.count("/") == 2
        }

    def clear(self, folder: str) -> None:
        self._sink._delete(self._list(folder + "/"))

    def location(self, relpath: str) -> str:
        return f"{self.url}/{relpath}"

    def sink(self) -> Sink:
        return self._sink


def open_root(dest: str) -> Root:
    folder = local_folder(dest)
    return _LocalRoot(folder) if folder is not None else _ObjectRoot(dest)


def part_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """What a part records of how it was prepared, and its fingerprint: parts of one dataset
    must agree on all of it."""
    text = json.dumps(dict(options), sort_keys=True, default=str)
    return {
        "options": json.loads(text),
        "fingerprint": hashlib.blake2b(text.encode(), digest_size=8).hexdigest(),
    }


def _parse_name(folder: str) -> TaskSlot | None:
    m = _PART_RE.match(folder.rsplit("/", 1)[-1])
    return TaskSlot(int(m.group(1)), int(m.group(2))) if m else None


def _read_parts(root: Root, names: list[str]) -> list[Manifest]:
    def one(name: str) -> Manifest:
        where = f"{name}/{MANIFEST_NAME}"
        data = root.read(where)
        if data is None:
            raise CLIError(f"{where} disappeared while the parts were merged; run the merge again")
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


def merge_parts(dest: str, *, tasks: int | None = None) -> Manifest:
    """Write ``dest``'s manifest over its ``tasks`` parts (found in ``parts/`` when None).

    Refuses missing parts, parts prepared with other options or inputs, and fields whose dtypes
    differ; reads the part manifests only.
    """
    root = open_root(dest)
    found = {slot: name for name in root.part_manifests() if (slot := _parse_name(name)) is not None}
    if tasks is None:
        counts = sorted({s.tasks for s in found})
        if not counts:
            raise CLIError(
                f"{dest} holds no prepared parts ({PARTS}/part-*-of-*/{MANIFEST_NAME}); prepare them "
                "with `guideloom prepare INPUTS --output DEST --task I --tasks N`"
            )
        if len(counts) > 1:
            raise UsageError(
                f"{dest} holds parts of runs with {', '.join(map(str, counts))} tasks; pass --tasks N "
                "to merge the run you want"
            )
        tasks = counts[0]
    missing = [i for i in range(tasks) if TaskSlot(i, tasks) not in found]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise CLIError(
            f"{dest}: {len(missing)} of {tasks} parts are missing or unfinished (tasks {shown}, "
            "counted from 0); run them again with --task I --tasks N (finished parts are skipped), "
            "then merge"
        )
    names = [part_folder(i, tasks) for i in range(tasks)]
    parts = _read_parts(root, names)
    manifest = merged_manifest(names, parts)
    sink = root.sink()
    replaced = sink.prepare(overwrite=True)
    sink.commit(manifest, replaced)
    return manifest


def _check_same(names: list[str], parts: list[Manifest]) -> None:
    first = parts[0]
    first_part = first.extra.get("part") or {}
    for i, (name, m) in enumerate(zip(names, parts, strict=True)):
        part = m.extra.get("part")
        if not isinstance(part, dict) or part.get("task") != i or part.get("tasks") != len(parts):
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


def merged_manifest(names: list[str], parts: list[Manifest]) -> Manifest:
    """The manifest over ``parts`` (the part manifests in task order, under folders ``names``)."""
    _check_same(names, parts)
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
    specs = {name: ArraySpec(first.fields[name].dtype, tuple(files)) for name, files in fields.items()}
    offsets_spec = ArraySpec(np.dtype("<i8"), tuple(offsets)) if first.offsets is not None else None
    num_documents = sum(m.num_documents for m in parts)
    return Manifest(
        kind=first.kind, fields=specs, offsets=offsets_spec, num_documents=num_documents, extra=extra
    )


def _check_ids_fit(first: Manifest, documents: int) -> None:
    """Values with a base must still fit their dtype: ``doc_id`` up to ``documents - 1``."""
    spec = first.fields.get("doc_id")
    if spec is not None and spec.dtype.kind in "iu" and documents - 1 > np.iinfo(spec.dtype).max:
        raise DatasetFormatError(
            f"the parts hold {documents:,} documents, more than doc_id's {spec.dtype.name} numbers; "
            "prepare the dataset in one run, or without --document-ids"
        )
