"""Block checks keyed by a file's identity: a check made by one open of a dataset must be a
check of the bytes another open will read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import guideloom as gl
from guideloom import DatasetIntegrityError
from guideloom.storage._local import _check, _sharded


def _replace_same_size(path: Path) -> None:
    """``path`` replaced by rename with other bytes of its size (a new inode)."""
    other = bytearray(path.read_bytes())
    for at in range(0, len(other), 4096):
        other[at] ^= 0xFF
    tmp = path.with_name("replacement")
    tmp.write_bytes(bytes(other))
    os.replace(tmp, path)
    time.sleep(0.2)  # the change older than a coarse clock tick: not "racily" new


@pytest.mark.parametrize("preads", [False, True])
def test_an_open_reading_the_old_file_does_not_vouch_for_its_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preads: bool
) -> None:
    """Open A holds the original file; the file is replaced by rename; open B maps the new one.
    A's reads check A's bytes (the old inode's), which must not mark the new file's blocks as
    checked: B must refuse, never deliver the replacement's bytes."""
    monkeypatch.setattr(_check, "VERIFY_ON_OPEN_BYTES", 0)  # a dataset too large to hash on open
    if preads:
        monkeypatch.setattr(_sharded, "MAPPED_BUDGET", 2**20)
    data = (np.arange(3 * 2**20) % 50_000).astype(np.uint16)
    gl.write_stream(tmp_path / "ds", data, shard_bytes=8 * 2**20)
    (first,) = [p for p in (tmp_path / "ds").iterdir() if p.name.endswith("00000.bin")]
    a = gl.open_stream(tmp_path / "ds")
    a.open_sync()
    _replace_same_size(first)
    b = gl.open_stream(tmp_path / "ds")
    b.open_sync()
    starts = np.asarray([0, 2**20], np.int64)
    got_a = a.read_many_sync(starts, 4096)  # the old inode: the data as written
    assert np.array_equal(got_a[0], data[:4096])
    with pytest.raises(DatasetIntegrityError, match="does not match its digest"):
        got_b = b.read_many_sync(starts, 4096)
        assert np.array_equal(got_b[0], data[:4096]), "the replacement's bytes were delivered"


def test_a_file_renamed_over_while_open_by_path_watch_is_refused_on_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More mapped files than are watched by descriptor (watched by path): a file renamed over
    while open is seen changed and checked again -- against the old map's bytes. A later open of
    the dataset maps the new file and must check it, not trust that check."""
    monkeypatch.setattr(_check, "VERIFY_ON_OPEN_BYTES", 0)
    monkeypatch.setattr(_sharded, "WATCHED_FDS", 1)  # as a merge of more than WATCHED_FDS files
    data = (np.arange(2**20) % 50_000).astype(np.uint16)
    gl.write_stream(tmp_path / "ds", data, shard_bytes=2**19)
    files = sorted(p for p in (tmp_path / "ds").iterdir() if p.suffix == ".bin")
    assert len(files) > 1
    a = gl.open_stream(tmp_path / "ds")
    a.open_sync()
    _replace_same_size(files[0])
    starts = np.asarray([0, 1000], np.int64)
    assert np.array_equal(a.read_many_sync(starts, 64)[0], data[:64])  # the old map's bytes
    b = gl.open_stream(tmp_path / "ds")
    b.open_sync()
    with pytest.raises(DatasetIntegrityError, match="does not match its digest"):
        got = b.read_many_sync(starts, 64)
        assert np.array_equal(got[0], data[:64]), "the replacement's bytes were delivered"
