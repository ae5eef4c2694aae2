"""Checking a whole dataset: every data file's sha256 and block digests, and adding block
digests to a dataset written without them.

One pass over each file computes both its sha256 and its block digests. :func:`verify_files`
is the core of ``verify_dataset`` (``guideloom verify``) and of
:func:`guideloom.storage._api.check_dataset_blocks`, the small internal API that tools (a
corruption fuzzer) call to check a dataset's block digests.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._format._blocks import (
    BLOCK_BYTES,
    BlockHasher,
    local_reader,
    make_blocks,
    sidecar_name,
)
from guideloom.storage._format._manifest import MANIFEST_NAME, ArraySpec, FileSpec, Manifest

__all__ = ["verify_files", "verify_local", "with_blocks"]

#: ``chunks(path)``: a data file's bytes in order; ``read(path)``: a small file whole.
Chunks = Callable[[str], Iterator[Any]]


def verify_files(
    manifest: Manifest,
    where: str,
    chunks: Chunks,
    read: Callable[[str], bytes],
    *,
    sha256: bool = True,
    progress: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    """Read every data file once: check its sha256 (with ``sha256=False`` only where it has no
    block digests) and, where it has them, its block digests; return each file's block digests
    as computed (uint64 arrays).

    :class:`DatasetIntegrityError` names the first file (and block) that does not match."""
    computed: dict[str, Any] = {}
    for name, _spec, f in manifest.all_files():
        hasher = BlockHasher(f.blocks.size if f.blocks is not None else BLOCK_BYTES)
        digest = hashlib.sha256()
        for chunk in chunks(f.path):
            hasher.update(chunk)
            if sha256 or f.blocks is None:
                digest.update(chunk)
            if progress is not None:
                progress(memoryview(chunk).nbytes)
        if (sha256 or f.blocks is None) and digest.hexdigest() != f.sha256:
            raise DatasetIntegrityError(
                f"{where}: file {f.path!r} of field {name!r} does not match its checksum; the "
                "dataset is damaged: write or copy it again"
            )
        got = hasher.digests()
        if f.blocks is not None:
            want = f.blocks.load(read, f.nbytes, where)
            bad = np.flatnonzero(got != want) if len(got) == len(want) else np.zeros(1, np.int64)
            if len(bad):
                b = int(bad[0])
                raise DatasetIntegrityError(
                    f"{where}: file {f.path!r} of field {name!r}: block {b} (bytes {b * f.blocks.size}-"
                    f"{min(f.nbytes, (b + 1) * f.blocks.size) - 1}) does not match its digest in the "
                    "manifest; the dataset is damaged: write or copy it again"
                )
        computed[f.path] = got
    return computed


def with_blocks(
    manifest: Manifest,
    computed: dict[str, Any],
    write: Callable[[str, bytes], None],
    *,
    replace: bool = False,
) -> Manifest:
    """``manifest`` with block digests for its files that have none (every file with
    ``replace``), from ``computed``, their sidecars written with ``write(path, bytes)``."""

    def redo(spec: ArraySpec) -> ArraySpec:
        files = []
        for f in spec.files:
            blocks = f.blocks
            if blocks is None or replace:
                blocks, sidecar = make_blocks(computed[f.path], BLOCK_BYTES, sidecar_name(f.path))
                if sidecar is not None:
                    write(sidecar_name(f.path), sidecar)
            files.append(FileSpec(f.path, f.elements, f.nbytes, f.sha256, f.base, blocks))
        return ArraySpec(spec.dtype, tuple(files))

    return Manifest(
        kind=manifest.kind,
        fields={name: redo(spec) for name, spec in manifest.fields.items()},
        offsets=None if manifest.offsets is None else redo(manifest.offsets),
        num_documents=manifest.num_documents,
        extra=manifest.extra,
    )


def local_chunks(folder: Path) -> Chunks:
    def chunks(path: str) -> Iterator[bytes]:
        with open(folder / path, "rb") as fh:
            while block := fh.read(8 * 2**20):
                yield block

    return chunks


def verify_local(
    folder: Path,
    manifest: Manifest,
    *,
    progress: Callable[[int], object] | None = None,
    add_block_digests: bool = False,
    sha256: bool = True,
) -> Manifest:
    """:func:`verify_files` over a local folder; with ``add_block_digests`` a dataset without
    them gets them (sidecars first, then the manifest, atomically)."""
    from guideloom.storage._write._sinks import fsync_dir, write_synced

    computed = verify_files(
        manifest, str(folder), local_chunks(folder), local_reader(folder), sha256=sha256, progress=progress
    )
    if not add_block_digests or manifest.has_blocks:
        return manifest
    added = with_blocks(manifest, computed, lambda rel, data: write_synced(folder / rel, data))
    tmp = folder / f".{MANIFEST_NAME}.blocks.tmp"
    write_synced(tmp, added.to_json_bytes())
    os.replace(tmp, folder / MANIFEST_NAME)
    fsync_dir(folder)
    return added
