"""The manifest reader's bounds: hostile or damaged manifests are DatasetFormatErrors naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom as gl
from guideloom import DatasetFormatError
from guideloom.storage._format import _manifest as manifest_module
from guideloom.storage._format._manifest import (
    MANIFEST_NAME,
    MAX_INFO_DEPTH,
    MAX_MANIFEST_BYTES,
    parse_manifest,
    read_manifest_file,
)

WHERE = "ds/manifest.json"


def _doc(tmp_path: Path, **info: Any) -> dict[str, Any]:
    gl.write_stream(tmp_path / "src", [np.arange(10, dtype=np.uint16)], info=info or None)
    doc: dict[str, Any] = json.loads((tmp_path / "src" / MANIFEST_NAME).read_text())
    return doc


def _refused(data: bytes, match: str) -> DatasetFormatError:
    with pytest.raises(DatasetFormatError, match=match) as info:
        parse_manifest(data, WHERE)
    assert str(info.value).startswith(WHERE)
    return info.value


def test_a_5000_digit_integer_is_a_format_error(tmp_path: Path) -> None:
    text = json.dumps(_doc(tmp_path)).replace('"num_elements": 10', '"num_elements": ' + "9" * 5000)
    _refused(text.encode(), "integer of thousands of digits")
    (tmp_path / "src" / MANIFEST_NAME).write_text(text)
    with pytest.raises(DatasetFormatError, match=f"{tmp_path / 'src' / MANIFEST_NAME}"):
        gl.open_stream(tmp_path / "src")


@pytest.mark.parametrize("opener", ["[", '{"a":', "{"])
def test_deep_nesting_is_a_format_error(tmp_path: Path, opener: str) -> None:
    _refused(opener.encode() * 100_000, "nested too deeply|not valid JSON")
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / MANIFEST_NAME).write_bytes(b'{"info": ' + b"[" * 100_000)
    with pytest.raises(DatasetFormatError, match=str(tmp_path / "deep")):
        gl.open_stream(tmp_path / "deep")


def test_info_nesting_is_bounded_and_what_is_allowed_round_trips(tmp_path: Path) -> None:
    doc = _doc(tmp_path)
    value: Any = 1
    for _ in range(MAX_INFO_DEPTH - 1):
        value = [value]
    doc["info"] = {"deep": value}  # the info object itself is level 1
    m = parse_manifest(json.dumps(doc).encode(), WHERE)
    assert parse_manifest(m.to_json_bytes(), WHERE).to_json_bytes() == m.to_json_bytes()
    doc["info"] = {"deep": [value]}
    _refused(json.dumps(doc).encode(), f"nested deeper than {MAX_INFO_DEPTH}")


def test_size_bound_before_parsing(tmp_path: Path) -> None:
    _refused(b" " * (MAX_MANIFEST_BYTES + 1), f"more than the {MAX_MANIFEST_BYTES}")
    big = tmp_path / MANIFEST_NAME
    with open(big, "wb") as fh:  # sparse: refused from its size, never read
        fh.truncate(2**40)
    with pytest.raises(DatasetFormatError, match=f"{big} is {2**40} bytes"):
        read_manifest_file(big)
    with pytest.raises(FileNotFoundError):
        read_manifest_file(tmp_path / "missing.json")
    good = _doc(tmp_path)
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert parse_manifest(read_manifest_file(tmp_path / "good.json"), WHERE).num_elements == 10


def test_the_bound_holds_for_a_file_that_grows_while_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / MANIFEST_NAME
    path.write_bytes(b"x" * 100)
    real_fstat = manifest_module.os.fstat

    class Small:
        def __init__(self, st: Any) -> None:
            self.st_size = 10

    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 50)
    monkeypatch.setattr(manifest_module.os, "fstat", lambda fd: Small(real_fstat(fd)))
    with pytest.raises(DatasetFormatError, match="is 51 bytes, more than the 50"):
        read_manifest_file(path)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(format_version=True), "format_version True"),
        (lambda d: d.update(num_elements=10.0), "num_elements 10.0"),
        (lambda d: d["fields"]["tokens"]["files"][0].update(elements=True, bytes=2), "must be integers"),
        (lambda d: d["fields"]["tokens"]["files"][0].update(elements=2**63, bytes=2**64), "< 2\\*\\*63"),
        (lambda d: d["fields"]["tokens"].update(dtype={"names": 1}), "dtype must be a name"),
        (lambda d: d["fields"]["tokens"].update(dtype="(2)i4"), "cannot be stored|unknown dtype"),
        (lambda d: d["fields"]["tokens"]["files"][0].update(path="a\ud800.bin"), "not a plain relative path"),
        (lambda d: d["fields"]["tokens"]["files"][0].update(path="a\nb.bin"), "not a plain relative path"),
        (lambda d: d.update(kind="x" * 10_000), r"got 'xxx+\.\.\.$"),
        (
            lambda d: d["fields"]["tokens"].update(dtype="1" * 5000 + "bool"),
            r"dtype must be a name such as 'uint16', got '111+\.\.\.",
        ),
        (lambda d: d["fields"]["tokens"].update(dtype="9" * 30 + "i"), "unknown dtype"),
    ],
)
def test_values_of_the_wrong_kind_are_refused(tmp_path: Path, edit: Any, match: str) -> None:
    doc = _doc(tmp_path)
    edit(doc)
    err = _refused(json.dumps(doc).encode(), match)
    assert len(str(err)) < 300
