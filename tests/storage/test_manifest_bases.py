"""Files with a ``base`` (a merge of prepared parts): the manifest's rules and every reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom as gl
from guideloom._errors import DatasetFormatError
from guideloom.storage._local import ShardedArray
from guideloom.storage._manifest import Manifest, parse_manifest


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
