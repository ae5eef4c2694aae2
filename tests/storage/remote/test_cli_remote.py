"""The command line with an object-storage destination (a real S3 server on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import guideloom
from guideloom._cli import main
from guideloom_dev.servers import MotoS3
from tests.support.remote import BUCKET, unique


def test_prepare_to_s3_then_inspect_verify_and_load(
    s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    texts = ["first document", "second, a little longer", "ünïcode third"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    url = f"s3://{BUCKET}/{unique('cli')}"

    assert main(["prepare", str(corpus), "--output", url, "--quiet"]) == 0
    assert main(["verify", url, "--quiet"]) == 0
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "stream" in out
    assert main(["prepare", str(corpus), "--output", url, "--quiet"]) != 0  # no overwrite by default

    expected = np.concatenate(
        [np.append(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), 256) for t in texts]
    )
    loader = guideloom.StatefulDataLoader.from_storage(
        guideloom.open_stream(url),
        lambda s: torch.from_numpy(np.asarray(s).astype(np.int64)),
        sequence_length=1,
        local_batch_size=len(expected),
        device=torch.device("cpu"),
    )
    with loader:
        (batch,) = list(loader)
    assert batch.flatten().tolist() == expected.tolist()
