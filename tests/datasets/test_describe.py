"""What datasets say of a sample (``describe``), through ``loader.explain()``: the documents,
element ranges, files and byte ranges a step read are the ones its samples hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl


def documents(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 60000, int(rng.integers(1, 40)), dtype=np.uint16) for _ in range(count)]


def file_bytes(path: str, lo: int, hi: int) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(lo)
        return np.frombuffer(f.read(hi - lo), dtype=np.uint16)


def check_sample(sample: Any, record: dict[str, Any], docs: list[np.ndarray], whole: np.ndarray) -> None:
    """The record's pieces hold the sample's tokens: by document, by element range and by bytes."""
    tokens = np.asarray(sample["tokens"] if hasattr(sample, "keys") else sample)
    pieces = [docs[d][a:b] for d, a, b in record["documents"]] if "documents" in record else []
    by_range = [whole[a:b] for a, b in record["elements"]]
    by_bytes = [np.concatenate([file_bytes(*f) for f in files]) for files in record["files"]]
    held = np.concatenate(by_range)
    np.testing.assert_array_equal(tokens[: len(held)], held)
    for got in (pieces or by_range, by_bytes):
        np.testing.assert_array_equal(np.concatenate(got), held)
    if hasattr(sample, "keys"):
        ids = np.asarray(sample["doc_ids"])
        ids = ids[ids >= 0]
        assert [d for d, _, _ in record["documents"]] == [
            int(d) for d in ids[np.r_[True, ids[1:] != ids[:-1]]]
        ]


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_explain_of_packed_documents_names_their_documents_files_and_bytes(tmp_path: Path, mode: str) -> None:
    docs = documents(1, 300)
    gl.write_documents(tmp_path / "docs", docs, shard_bytes=512)
    whole = np.concatenate(docs)
    dataset = gl.pack(gl.open_documents(tmp_path / "docs"), 16, mode)  # type: ignore[arg-type]
    loader = gl.StatefulDataLoader(
        dataset,
        list,
        device=torch.device("cpu"),
        local_batch_size=4,
        world_size=2,
        rank=1,
        shuffle=True,
        shuffle_seed=3,
    )
    with loader:
        it = iter(loader)
        for step in range(6):
            batch = next(it)
            records = loader.explain(step)
            assert len(records) == len(batch)
            for sample, record in zip(batch, records, strict=True):
                check_sample(sample, record, docs, whole)
        it.close()


def test_explain_of_a_mixture_names_the_source_and_what_it_read(tmp_path: Path) -> None:
    docs = documents(2, 200)
    gl.write_documents(tmp_path / "docs", docs, shard_bytes=300)
    stream = np.arange(5000, dtype=np.uint16)
    gl.write_stream(tmp_path / "stream", stream, shard_bytes=1000)
    mixture = gl.mix(
        {"docs": gl.open_documents(tmp_path / "docs"), "web": gl.open_stream(tmp_path / "stream")},
        {"docs": 0.3, "web": 0.7},
        sequence_length=10,
        with_source=True,
    )
    loader = gl.StatefulDataLoader(
        mixture, list, device=torch.device("cpu"), local_batch_size=8, shuffle=True, shuffle_seed=9
    )
    with loader:
        it = iter(loader)
        for step in range(5):
            batch = next(it)
            for (name, sample), record in zip(batch, loader.explain(step), strict=True):
                assert record["source"] == name
                check_sample(
                    sample,
                    record,
                    docs if name == "docs" else [],
                    np.concatenate(docs) if name == "docs" else stream,
                )
        it.close()


def test_explain_in_memory_has_no_files() -> None:
    storage = gl.MemoryStreamStorage(np.arange(100, dtype=np.uint16))
    loader = gl.StatefulDataLoader.from_storage(storage, list, sequence_length=5, device=torch.device("cpu"))
    (record,) = loader.explain(3)
    assert record == {
        "epoch": 0,
        "step": 3,
        "rank": 0,
        "position": 3,
        "index": 3,
        "elements": [[15, 20]],
        "files": [[]],
    }
