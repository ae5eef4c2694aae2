"""What the command-line tests share: a finished run's output, and datasets read back raw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

BYTE_EOS = 256


class Run:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def __repr__(self) -> str:
        return f"Run(code={self.code}, out={self.out!r}, err={self.err!r})"


def manifest_of(dest: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((dest / "manifest.json").read_text())
    return data


def field_of(dest: Path, name: str = "tokens") -> np.ndarray:
    """A stream field (or a document dataset's tokens), read straight from its data files."""
    m = manifest_of(dest)
    spec = m["fields"][name]
    parts = [
        np.fromfile(dest / f["path"], dtype=np.dtype(spec["dtype"]).newbyteorder("<")) for f in spec["files"]
    ]
    return np.concatenate(parts) if parts else np.empty(0, spec["dtype"])


def split_documents(tokens: np.ndarray, eos: int = BYTE_EOS) -> list[np.ndarray]:
    """Split a stream at its end-of-document tokens (each document keeps its EOS)."""
    ends = np.flatnonzero(tokens == eos) + 1
    assert len(ends) == 0 or ends[-1] == len(tokens), "the stream must end with an end-of-document token"
    return np.split(tokens, ends[:-1]) if len(ends) else []


def byte_texts(dest: Path) -> list[str]:
    """The documents of a byte-tokenized stream, decoded."""
    docs = split_documents(field_of(dest))
    for d in docs:
        assert d[-1] == BYTE_EOS and np.all(d[:-1] < 256)
    return [bytes(d[:-1].astype(np.uint8)).decode("utf-8") for d in docs]


def data_files(dest: Path) -> dict[str, bytes]:
    """Field name + shard index -> contents, for every file the manifest lists."""
    m = manifest_of(dest)
    out = {}
    for name, spec in m["fields"].items():
        for i, f in enumerate(spec["files"]):
            out[f"{name}/{i}"] = (dest / f["path"]).read_bytes()
    if "offsets" in m:
        for i, f in enumerate(m["offsets"]["files"]):
            out[f"offsets/{i}"] = (dest / f["path"]).read_bytes()
    return out


def checksums(dest: Path) -> list[tuple[str, int, str]]:
    m = manifest_of(dest)
    specs = list(m["fields"].items()) + ([("offsets", m["offsets"])] if "offsets" in m else [])
    return [(name, f["elements"], f["sha256"]) for name, spec in specs for f in spec["files"]]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
