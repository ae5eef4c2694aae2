"""The block shuffle over object storage: "auto" picks ~4 MiB blocks, batches match a local loader
with the same blocks, the order is the local one by default, and ``stats()`` counts GETs and bytes
(at most one GET per MiB read with "auto")."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom import StatefulDataLoader
from guideloom._core.order import DEFAULT_WINDOW
from guideloom_dev.servers import MotoS3, Nginx
from tests.support.remote import BUCKET, Copies

CPU = torch.device("cpu")
SEQ = 2048  # 4 KiB samples of uint16: "auto" blocks of 1,024 samples
MiB = 2**20


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


@pytest.fixture(scope="module")
def big_copies(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3, www: Path) -> Iterator[Copies]:
    """40 MiB of uint16 tokens (10,240 samples of 4 KiB: ten "auto" blocks) in 16 MiB shards."""
    import shutil

    tokens = np.random.default_rng(5).integers(0, 65_000, 10_240 * SEQ, dtype=np.uint16)
    folder = tmp_path_factory.mktemp("big") / "big"
    guideloom.write_stream(folder, tokens, shard_bytes=16 * MiB)
    s3.upload_folder(folder, BUCKET, "copies/big")
    shutil.copytree(folder, www / "big", dirs_exist_ok=True)  # again if set up twice
    yield Copies(folder, f"s3://{BUCKET}/copies/big", "big", tokens)


def loader(storage: Any, **options: Any) -> StatefulDataLoader[Any, torch.Tensor]:
    options.setdefault("local_batch_size", 16)
    return StatefulDataLoader.from_storage(
        storage, collate, sequence_length=SEQ, shuffle=True, shuffle_seed=3, device=CPU, **options
    )


def epoch(storage: Any, **options: Any) -> tuple[list[torch.Tensor], dict[str, float]]:
    with loader(storage, **options) as it:
        out = list(it)
        return out, it.stats()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_auto_reads_whole_blocks_with_few_gets(big_copies: Copies, s3: MotoS3) -> None:
    remote = guideloom.open_stream(big_copies.s3_url, **s3.options())
    got, stats = epoch(remote, shuffle_block_size="auto")
    assert stats["shuffle_block_size"] == 4 * MiB // (SEQ * 2) == 1024
    assert stats["shuffle_window"] == DEFAULT_WINDOW
    # the same blocks over local files give the same batches
    local, local_stats = epoch(
        guideloom.open_stream(big_copies.local), shuffle_block_size=1024, shuffle_window=DEFAULT_WINDOW
    )
    assert same(got, local)
    assert "requests" not in local_stats
    # request economy: the epoch is a handful of large GETs, its bytes about the dataset once
    nbytes = len(big_copies.tokens) * 2
    assert stats["epoch_bytes_read"] == stats["bytes_read"] >= nbytes
    assert stats["bytes_read"] <= 1.05 * nbytes + 64 * 1024, "blocks are read once"
    assert stats["requests"] / (stats["bytes_read"] / MiB) <= 1.0, "at most one GET per MiB"
    assert remote.stats()["requests"] == stats["requests"]


def test_the_default_order_over_s3_is_the_local_one(big_copies: Copies, s3: MotoS3) -> None:
    remote = guideloom.open_stream(big_copies.s3_url, **s3.options())
    got, stats = epoch(remote, local_batch_size=64)
    local, _ = epoch(guideloom.open_stream(big_copies.local), local_batch_size=64)
    assert same(got, local), "the global row shuffle, whatever the storage"
    assert stats["shuffle_block_size"] == 1 and stats["shuffle_window"] == 1
    assert stats["requests"] > 0 and stats["bytes_read"] >= len(big_copies.tokens) * 2 * 0.99
    # the dataset is a few read-ahead windows: its sorted samples share GETs (amplification <= 4)
    assert stats["bytes_read"] <= 4 * len(big_copies.tokens) * 2 + 4 * MiB
    assert stats["requests"] < len(got) * 64 / 4, "far fewer GETs than samples"


def test_epoch_figures_restart_with_each_epoch(big_copies: Copies, nginx: Nginx) -> None:
    storage = guideloom.open_stream(f"{nginx.url}/{big_copies.http_path}")
    it = loader(storage, shuffle_block_size="auto")
    with it:
        first = list(it)
        one = it.stats()
        second = list(it)
        two = it.stats()
    assert len(first) == len(second) == len(it)
    assert two["requests"] > one["requests"] == one["epoch_requests"]
    assert two["epoch_requests"] == two["requests"] - one["requests"]
    assert two["epoch_bytes_read"] == two["bytes_read"] - one["bytes_read"] > 0
    assert not any(torch.equal(a, b) for a, b in zip(first, second, strict=True)), "another epoch's order"


@pytest.mark.slow
def test_a_checkpoint_of_auto_resumes_exactly_over_another_copy(big_copies: Copies, s3: MotoS3) -> None:
    full, _ = epoch(guideloom.open_stream(big_copies.s3_url, **s3.options()), shuffle_block_size="auto")
    first = loader(guideloom.open_stream(big_copies.s3_url, **s3.options()), shuffle_block_size="auto")
    with first:
        it = iter(first)
        head = [next(it) for _ in range(37)]
        state = first.state_dict()
        it.close()
    assert state["shuffle_block_size"] == 1024
    # resumed over the local copy, with the block size "auto" chose there written out, and
    # another batch size: no warning, the rest of the same epoch
    resumed = loader(guideloom.open_stream(big_copies.local), local_batch_size=8, shuffle_block_size=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state)
    with resumed:
        rest = list(resumed)
    flat = torch.cat([*head, *rest])
    assert torch.equal(flat, torch.cat(full))


@pytest.mark.parametrize("bad", [0.5, 0, True, "4", None])
def test_max_read_amplification_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_read_amplification must be a number >= 1"):
        guideloom.open_stream("http://127.0.0.1:9/nothing", max_read_amplification=bad)


@pytest.fixture(scope="module")
def short_block_copies(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3) -> Iterator[Copies]:
    """40,000 samples of 4 KiB: three mixing windows of "auto" blocks, and a short block that each
    epoch puts in another window (the windows after it start earlier)."""
    tokens = np.random.default_rng(6).integers(0, 65_000, 40_000 * SEQ, dtype=np.uint16)
    folder = tmp_path_factory.mktemp("short") / "short"
    guideloom.write_stream(folder, tokens, shard_bytes=64 * MiB)
    s3.upload_folder(folder, BUCKET, "copies/short")
    yield Copies(folder, f"s3://{BUCKET}/copies/short", "short", tokens)


@pytest.mark.slow
def test_auto_fetches_the_dataset_once_in_every_epoch(short_block_copies: Copies, s3: MotoS3) -> None:
    storage = guideloom.open_stream(short_block_copies.s3_url, **s3.options())
    nbytes = len(short_block_copies.tokens) * 2
    it = loader(storage, shuffle_block_size="auto")
    with it:
        for _ in range(3):
            batches = list(it)
            stats = it.stats()
            assert len(batches) == len(it)
            assert nbytes <= stats["epoch_bytes_read"] <= 1.01 * nbytes, "no block fetched twice"
            assert stats["epoch_requests"] <= nbytes / MiB, "at most one GET per MiB"
