"""Writing a guideloom dataset from a ``ray.data.Dataset``: a datasink.

Each write task of the dataset writes a part (``parts/ray-<write id>-<task index>/``, a dataset
of its own); when all have finished, the datasink writes the destination's one manifest over the
parts' files where they are, in the order of the write tasks (the dataset's order when Ray Data
preserves it: ``DataContext.get_current().execution_options.preserve_order = True``). Nothing is
copied; document offsets count from each part's start and the manifest gives them their base, as
for ``guideloom prepare --tasks N`` (see docs/format.md).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa  # type: ignore[import-untyped]
from ray.data import Datasink
from ray.data.block import BlockAccessor

from guideloom.storage._api import _sink
from guideloom.storage._format._manifest import MANIFEST_NAME, Manifest, parse_manifest, storage_dtype
from guideloom.storage._write._parts import PARTS, commit_merged, merged_manifest, open_root, read_parts
from guideloom.storage._write._writer import DEFAULT_SHARD_BYTES, write_documents_to, write_stream_to

__all__ = ["GuideloomDatasink"]


def _documents(blocks: Iterable[Any], column: str) -> Iterator[npt.NDArray[Any]]:
    """Each row's ``column`` (a list or array of token ids) as a 1-D array, block by block."""
    for block in blocks:
        table = BlockAccessor.for_block(block).to_arrow()
        if column not in table.column_names:
            raise ValueError(
                f"the dataset has no column {column!r} (columns: {', '.join(table.column_names)}); "
                "pass column= the name of the token ids' column"
            )
        for chunk in table.column(column).chunks:
            if pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
                if chunk.null_count:
                    raise ValueError(f"column {column!r} holds null rows; every row needs its token ids")
                values = chunk.flatten().to_numpy(zero_copy_only=False)
                offsets = np.asarray(chunk.offsets)
                for a, b in itertools.pairwise((offsets - offsets[0]).tolist()):
                    yield values[a:b]
            else:  # tensors and other array types: one row at a time
                for row in chunk.to_pylist():
                    yield np.asarray(row).reshape(-1)


class GuideloomDatasink(Datasink[dict[str, Any]]):
    """A Ray Data datasink that writes a guideloom stream or document dataset at ``destination``.

    ``column`` holds each row's token ids (one document); ``kind="stream"`` concatenates the
    documents, ``"documents"`` keeps one sample per row. ``dtype`` is required: every write task
    stores the same dtype. ``ds.write_datasink(GuideloomDatasink("s3://b/ds", dtype="uint16"))``;
    then ``.manifest`` is the dataset's manifest (on the driver).
    """

    def __init__(
        self,
        destination: str,
        *,
        dtype: Any,
        column: str = "tokens",
        kind: str = "stream",
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        overwrite: bool = False,
        info: dict[str, Any] | None = None,
    ) -> None:
        if kind not in ("stream", "documents"):
            raise ValueError(f"kind must be 'stream' or 'documents', got {kind!r}")
        self.destination = str(destination).rstrip("/")
        self.dtype = storage_dtype(dtype)
        self.column, self.kind, self.shard_bytes = column, kind, shard_bytes
        self.overwrite = overwrite
        self.info = dict(info or {})
        self.write_id = secrets.token_hex(4)
        options = json.dumps([self.kind, self.dtype.name, self.column, self.write_id])
        self._fingerprint = hashlib.blake2b(options.encode(), digest_size=8).hexdigest()
        self.manifest: Manifest | None = None

    def on_write_start(self, schema: Any = None) -> None:
        existing = open_root(self.destination).read(MANIFEST_NAME)
        if existing is not None and not self.overwrite:
            raise FileExistsError(
                f"a dataset already exists at {self.destination}; pass overwrite=True to replace it"
            )

    def _folder(self, task: int) -> str:
        return f"{PARTS}/ray-{self.write_id}-{task:05d}"

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        task = int(ctx.task_idx)
        folder = self._folder(task)
        root = open_root(self.destination)
        root.clear(folder)  # a task run again starts its part over
        sink = _sink(root.location(folder), {})
        docs = _documents(blocks, self.column)
        info: dict[str, Any] = {"part": {"task": task, "fingerprint": self._fingerprint}}
        options: dict[str, Any] = {"dtype": self.dtype, "shard_bytes": self.shard_bytes, "overwrite": True}
        if self.kind == "stream":
            counted = {"documents": 0}

            def chunks() -> Iterator[npt.NDArray[Any]]:
                for d in docs:
                    counted["documents"] += 1
                    yield d
                info["documents"] = counted["documents"]

            write_stream_to(sink, chunks(), info=info, **options)
        else:
            write_documents_to(sink, docs, info=info, offsets_head=True, **options)
        return {"task": task, "folder": folder}

    def on_write_complete(self, write_result: Any) -> None:
        returns = sorted(write_result.write_returns, key=lambda r: r["task"])
        names = [r["folder"] for r in returns]
        root = open_root(self.destination)
        if not names:  # an empty dataset: no write task ran
            empty = _sink(root.location(self._folder(0)), {})
            data: list[npt.NDArray[Any]] = []
            info = {"part": {"task": 0, "fingerprint": self._fingerprint}, "documents": 0}
            options: dict[str, Any] = {"dtype": self.dtype, "overwrite": True, "info": info}
            if self.kind == "stream":
                write_stream_to(empty, data, **options)
            else:
                write_documents_to(empty, data, offsets_head=True, **options)
            names = [self._folder(0)]
        manifest = merged_manifest(names, read_parts(root, names), numbered=False)
        extra = {**self.info, **manifest.extra, "created_by": "guideloom ray datasink"}
        manifest = Manifest(manifest.kind, manifest.fields, manifest.offsets, manifest.num_documents, extra)
        commit_merged(root, manifest)
        self.manifest = parse_manifest(manifest.to_json_bytes(), f"{self.destination}/{MANIFEST_NAME}")
