"""Files with a ``base`` (a merge of prepared parts): the manifest's rules and every reader."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom as gl
from guideloom._errors import DatasetFormatError, DatasetIntegrityError
from guideloom.storage._format._manifest import Manifest, parse_manifest
from guideloom.storage._local._sharded import ShardedArray


def _stream_with_bases(folder: Path, bases: list[int]) -> tuple[dict[str, Any], np.ndarray]:
    """A stream whose ``doc_id`` field spans ``len(bases)`` files, with those bases; the values read."""
    tokens = np.arange(30, dtype=np.uint16)
    ids = (np.arange(30) % 10).astype(np.uint32)
    gl.write_stream(folder, tokens, metadata={"doc_id": ids}, shard_bytes=40)  # 10 ids a file
    doc = json.loads((folder / "manifest.json").read_text())
    for f, base in zip(doc["fields"]["doc_id"]["files"], bases, strict=True):
        f["base"] = base
    doc["format_version"] = 2
    (folder / "manifest.json").write_text(json.dumps(doc))
    return doc, ids + np.repeat(np.asarray(bases, dtype=np.uint32), 10)


def test_every_local_read_adds_the_bases(tmp_path: Path) -> None:
    doc, want = _stream_with_bases(tmp_path / "ds", [0, 100, 7])
    manifest = parse_manifest(json.dumps(doc).encode(), "m")
    array = ShardedArray(tmp_path / "ds", manifest.fields["doc_id"])
    assert array.slice(0, 30).tolist() == want.tolist()
    assert array.slice(8, 23).tolist() == want[8:23].tolist()
    positions = np.asarray([29, 0, 10, 9, 15], dtype=np.int64)
    assert array.take(positions).tolist() == want[positions].tolist()
    starts = np.arange(0, 25, 3, dtype=np.int64)
    assert array.gather(starts, 6).tolist() == [want[s : s + 6].tolist() for s in starts]
    storage = gl.open_stream(tmp_path / "ds")
    storage.open_sync()
    rows = storage.read_many_sync(starts, 6)
    assert [r["doc_id"].tolist() for r in rows] == [want[s : s + 6].tolist() for s in starts]
    assert [r["tokens"].tolist() for r in rows] == [list(range(s, s + 6)) for s in starts]


def test_bases_round_trip_and_set_the_version(tmp_path: Path) -> None:
    doc, _ = _stream_with_bases(tmp_path / "ds", [0, 5, 9])
    manifest = parse_manifest(json.dumps(doc).encode(), "m")
    again = json.loads(manifest.to_json_bytes())
    assert again["format_version"] == 2
    assert [f.get("base", 0) for f in again["fields"]["doc_id"]["files"]] == [0, 5, 9]
    assert parse_manifest(manifest.to_json_bytes(), "m") == manifest
    for f in doc["fields"]["doc_id"]["files"]:
        f.pop("base")
    plain = Manifest.from_json_bytes(json.dumps(doc).encode(), source="x")
    assert plain.digest() != manifest.digest()  # other values, another digest


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.__setitem__("format_version", 1), "needs format_version 2"),
        (lambda d: d["fields"]["doc_id"]["files"][1].__setitem__("base", -1), "'base' must be an integer"),
        (lambda d: d["fields"]["doc_id"]["files"][1].__setitem__("base", 1.5), "'base' must be an integer"),
        (lambda d: d["fields"]["doc_id"]["files"][1].__setitem__("base", True), "'base' must be an integer"),
        (lambda d: d["fields"]["tokens"]["files"][0].__setitem__("base", 3), "token files carry no 'base'"),
        (lambda d: d.__setitem__("format_version", 3), "upgrade guideloom"),
    ],
)
def test_bad_bases_are_refused(tmp_path: Path, change: Any, message: str) -> None:
    doc, _ = _stream_with_bases(tmp_path / "ds", [0, 5, 9])
    change(doc)
    with pytest.raises(DatasetFormatError, match=message):
        parse_manifest(json.dumps(doc).encode(), "m")


def test_a_base_on_a_float_field_is_refused(tmp_path: Path) -> None:
    gl.write_stream(tmp_path / "ds", np.arange(4, dtype=np.uint8), metadata={"w": np.ones(4, np.float32)})
    doc = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    doc["format_version"] = 2
    doc["fields"]["w"]["files"][0]["base"] = 1
    with pytest.raises(DatasetFormatError, match="of an integer array"):
        parse_manifest(json.dumps(doc).encode(), "m")


def _in_subfolder(folder: Path) -> None:
    """Move a dataset's files into ``folder/sub/`` and name them so in the manifest."""
    doc = json.loads((folder / "manifest.json").read_text())
    (folder / "sub").mkdir()
    for spec in doc["fields"].values():
        for f in spec["files"]:
            os.replace(folder / f["path"], folder / "sub" / f["path"])
            f["path"] = "sub/" + f["path"]
    (folder / "manifest.json").write_text(json.dumps(doc))


def test_files_in_subfolders_open_and_links_out_of_the_folder_are_refused(tmp_path: Path) -> None:
    data = np.arange(100, dtype=np.uint16)
    gl.write_stream(tmp_path / "ds", data, shard_bytes=64)
    _in_subfolder(tmp_path / "ds")
    storage = gl.open_stream(tmp_path / "ds")
    storage.open_sync()
    assert storage.read_many_sync(np.asarray([0], np.int64), 100)[0].tolist() == data.tolist()
    # a subfolder that is a link to a folder outside
    os.replace(tmp_path / "ds" / "sub", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "ds" / "sub")
    with pytest.raises(DatasetIntegrityError, match="lies outside the dataset folder"):
        gl.open_stream(tmp_path / "ds")
    # a link inside the folder is followed
    os.unlink(tmp_path / "ds" / "sub")
    os.replace(tmp_path / "elsewhere", tmp_path / "ds" / "real")
    os.symlink("real", tmp_path / "ds" / "sub")
    gl.open_stream(tmp_path / "ds").open_sync()
    # a file that is a link to a file outside
    first = sorted((tmp_path / "ds" / "real").iterdir())[0]
    os.replace(first, tmp_path / "outside.bin")
    os.symlink(tmp_path / "outside.bin", first)
    with pytest.raises(DatasetIntegrityError, match="lies outside the dataset folder"):
        gl.open_stream(tmp_path / "ds")


def test_small_files_are_read_whole_and_hold_no_descriptor(tmp_path: Path) -> None:
    gl.write_documents(tmp_path / "d", [np.arange(n, dtype=np.uint16) for n in (3, 5)])
    docs = gl.open_documents(tmp_path / "d")
    docs.open_sync()
    offsets = docs._offsets  # type: ignore[attr-defined]
    assert not offsets._maps and not offsets._fds
    view = offsets.slice(0, 3)
    assert view.tolist() == [0, 3, 8] and not view.flags.writeable
