"""The whole copy (``guideloom.storage._cache``): what it puts on disk, and in what order.

``cache_dir`` over a real object store, through the loader, is in
``tests/storage/remote/test_cache_remote.py``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import guideloom
from guideloom.storage._cache import DatasetCache, copy_footprint


def test_the_copy_is_on_disk_before_the_folder_that_says_complete_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every data file, the manifest and the folder are fsynced before the rename that makes the
    copy look complete (after a crash, sizes alone would pass for data), and the rename after it."""
    manifest = guideloom.write_stream(tmp_path / "ds", np.arange(50_000, dtype=np.uint16), shard_bytes=30_000)
    data = {f.path: (tmp_path / "ds" / f.path).read_bytes() for f in manifest.tokens.files}
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    (tmp_path / "c").mkdir()
    cache = DatasetCache(tmp_path / "c", "s3://bucket/ds", manifest, lambda p, s, e: data[p][s:e])
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    cache._download()
    monkeypatch.undo()
    assert (cache.folder / "manifest.json").is_file()
    partial = str(cache.folder) + ".partial"
    done = events.index(("replace", str(cache.folder)))
    synced = {path for kind, path in events[:done] if kind == "fsync"}
    want = {f"{partial}/{f.path}" for f in manifest.tokens.files} | {f"{partial}/manifest.json", partial}
    assert want <= synced, sorted(want - synced)
    assert ("fsync", str(cache.root)) in events[done:]
    for f in manifest.tokens.files:
        assert (cache.folder / f.path).read_bytes() == data[f.path]
    assert sum(-(-p.stat().st_size // 4096) * 4096 for p in cache.folder.iterdir()) <= copy_footprint(
        manifest
    )
