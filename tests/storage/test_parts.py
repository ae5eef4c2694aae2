"""A part's manifest is published once: of several writers at once, the first wins and the
others are told, on any local file system."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from guideloom.storage._write._parts import open_root

WHERE = "parts/part-00000-of-00001/manifest.json"


@pytest.mark.parametrize("links", [True, False])
def test_a_part_manifest_is_published_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool
) -> None:
    def no_links(*_: Any) -> None:
        raise PermissionError("hard links are not supported here")

    if not links:  # a file system without them: an exclusive create instead
        monkeypatch.setattr(os, "link", no_links)
    root = open_root(str(tmp_path))
    (tmp_path / WHERE).parent.mkdir(parents=True)
    assert root.publish(WHERE, b"first")
    assert not root.publish(WHERE, b"second")
    assert (tmp_path / WHERE).read_bytes() == b"first"
    assert [p.name for p in (tmp_path / WHERE).parent.iterdir()] == ["manifest.json"]  # no temporary left


def test_prune_keeps_the_manifest_and_one_run(tmp_path: Path) -> None:
    part = tmp_path / "parts" / "part-00000-of-00001"
    for name in ("run-a/tokens-1.bin", "run-b/tokens-2.bin", "tokens-old.bin", "manifest.json"):
        (part / name).parent.mkdir(parents=True, exist_ok=True)
        (part / name).write_bytes(b"x")
    open_root(str(tmp_path)).prune("parts/part-00000-of-00001", "run-a")
    assert sorted(str(p.relative_to(part)) for p in part.rglob("*")) == [
        "manifest.json",
        "run-a",
        "run-a/tokens-1.bin",
    ]
