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


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3) -> Iterator[dict[str, Copies]]:
    """Streams of 1 KiB samples (a 64 KiB integrity block holds 64) in 1 MiB shards, 8 and 28
    MiB: a first batch's blocks lie inside ranges of the window read (one per shard)."""
    out = {}
    for mib in (8, 28):
        tokens = np.random.default_rng(mib).integers(0, 65_000, mib * MiB // 2, dtype=np.uint16)
        folder = tmp_path_factory.mktemp("small") / f"small{mib}"
        guideloom.write_stream(folder, tokens, shard_bytes=MiB)
        s3.upload_folder(folder, BUCKET, f"copies/small{mib}")
        out[f"{mib}"] = Copies(folder, f"s3://{BUCKET}/copies/small{mib}", f"small{mib}", tokens)
    yield out


#: (dataset, sequence_length, batch, loader options, storage settings): one "auto" mixing window
#: in large shards, the one window in 1 MiB shards, and 1 MiB shards past the bound on what is
#: held (three mixing windows of 8 MiB, each read in two parts, then the last 4 MiB in one: the
#: next window's first part is planned while the last window's blocks fill the bound), and mixing
#: windows of 12 MiB read in parts of 3 MiB at most, the last one of 4 MiB read in two equal parts
#: (a first part of 3 MiB would span too little more than its samples to be told from a window
#: read whole: its blocks not held, the last part would fetch them again).
LAYOUTS = {
    "64 MiB shards, batch 16": ("short", SEQ, 16, {}, {}),
    "1 MiB shards, batch 8": ("8", 512, 8, {}, {}),
    "1 MiB shards, batch 32": ("8", 512, 32, {}, {}),
    **{
        f"past the held bound, batch {batch}": (
            "28",
            512,
            batch,
            {"shuffle_window": 2},
            {"read_window_bytes": 8 * MiB, "read_window_batches": 4096 // batch},
        )
        for batch in (8, 32)
    },
    "past the held bound, a window longer than a read": (
        "28",
        512,
        32,
        {"shuffle_window": 3},
        {"read_window_bytes": 12 * MiB, "read_window_batches": 96},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_auto_fetches_the_dataset_once_in_every_epoch(
    short_block_copies: Copies, small_shards: dict[str, Copies], s3: MotoS3, layout: str
) -> None:
    """The first batch's blocks, read alone before the rest of its mixing window, and a window's
    blocks read in parts are fetched once: bytes per epoch within 1% of the dataset's, with no
    more GETs than one per MiB (or per shard) and the first batch's, every epoch, and the
    batches those of the local copy."""
    name, seq, batch, options, settings = LAYOUTS[layout]
    copies = short_block_copies if name == "short" else small_shards[name]
    storage = guideloom.open_stream(copies.s3_url, **s3.options())
    for key, value in settings.items():
        setattr(storage, key, value)
    nbytes = len(copies.tokens) * 2
    shards = sum(1 for p in copies.local.iterdir() if p.suffix == ".bin")
    most_gets = max(nbytes / MiB, shards) + batch

    def make(source: Any, **extra: Any) -> StatefulDataLoader[Any, torch.Tensor]:
        return StatefulDataLoader.from_storage(
            source,
            collate,
            sequence_length=seq,
            local_batch_size=batch,
            shuffle=True,
            shuffle_seed=3,
            device=CPU,
            **options,
            **extra,
        )

    got: list[list[torch.Tensor]] = []
    with make(storage, shuffle_block_size="auto") as it:
        blocks = int(it.stats()["shuffle_block_size"])
        for epoch in range(3):
            got.append(list(it))
            stats = it.stats()
            assert len(got[-1]) == len(it)
            share = stats["epoch_bytes_read"] / nbytes
            held = storage._remote.fetcher.held
            assert 1 <= share <= 1.01, (
                f"no block fetched twice: {share:.4f}x in epoch {epoch} "
                f"({stats['epoch_requests']} GETs, {held.peak_nbytes} bytes held at most)"
            )
            assert stats["epoch_requests"] <= most_gets, "a GET per MiB or per shard, and the first batch's"
        assert storage._remote.fetcher.held.peak_nbytes <= storage.read_window_bytes
    with make(guideloom.open_stream(copies.local), shuffle_block_size=blocks) as local:
        for epoch in got:
            assert same(epoch, list(local))
