"""A shuffled epoch over S3 with ``shuffle_block_size="auto"`` fetches the dataset's bytes once:
the first batch's verified blocks, read alone for a fast first batch, are not fetched again by
the window read that follows it, nor are those of a mixing window's earlier parts by its later
ones where the window is read in parts."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom import StatefulDataLoader
from guideloom._errors import DatasetIntegrityError
from guideloom.storage._remote import _held
from guideloom.storage._remote._fetch import RangeFetcher
from guideloom.storage._remote._ranges import Job
from guideloom_dev.servers import FaultProxy, MotoS3
from tests.support.remote import BUCKET, Copies

CPU = torch.device("cpu")
SEQ = 512  # 1 KiB samples of uint16: a 64 KiB block holds 64 of them
MiB = 2**20


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


@pytest.fixture(scope="module")
def four_mib(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3) -> Iterator[Copies]:
    """4 MiB of uint16 tokens in 1 MiB shards (block digests, 64 KiB blocks, in sidecars)."""
    tokens = np.random.default_rng(11).integers(0, 65_000, 4 * MiB // 2, dtype=np.uint16)
    folder = tmp_path_factory.mktemp("once") / "once"
    guideloom.write_stream(folder, tokens, shard_bytes=MiB)
    s3.upload_folder(folder, BUCKET, "copies/once")
    yield Copies(folder, f"s3://{BUCKET}/copies/once", "once", tokens)
    shutil.rmtree(folder, ignore_errors=True)


class _CountedReader:
    """A stream reader that counts what it reads."""

    def __init__(self, reader: asyncio.StreamReader, proxy: CountingProxy) -> None:
        self._reader, self._proxy = reader, proxy

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._proxy.sent += len(data)
        return data


class CountingProxy(FaultProxy):
    """The loopback proxy, without faults or delay, counting the bytes the server sent
    (responses whole: status lines, headers and bodies)."""

    sent = 0

    async def _pump(self, reader: Any, writer: Any, other: Any, conn: Any, *, upstream: bool) -> None:
        await super()._pump(
            reader if upstream else _CountedReader(reader, self), writer, other, conn, upstream=upstream
        )


def loader(storage: Any, batch: int, **options: Any) -> StatefulDataLoader[Any, torch.Tensor]:
    options.setdefault("shuffle_block_size", "auto")
    return StatefulDataLoader.from_storage(
        storage,
        collate,
        sequence_length=SEQ,
        local_batch_size=batch,
        shuffle=True,
        shuffle_seed=5,
        device=CPU,
        **options,
    )


def one_epoch(it: StatefulDataLoader[Any, torch.Tensor], mode: str) -> list[torch.Tensor]:
    """One epoch's batches, by ``async for`` where ``mode`` is "async", else by ``for``."""
    if mode == "async":

        async def run() -> list[torch.Tensor]:
            return [b async for b in it]

        return asyncio.run(run())
    return list(it)


def local_epochs(
    copies: Copies, batch: int, figures: dict[str, float], epochs: int
) -> list[list[torch.Tensor]]:
    """The same epochs over the local copy, with the blocks "auto" chose over S3."""
    blocks = {"shuffle_block_size": int(figures["shuffle_block_size"])}
    with loader(guideloom.open_stream(copies.local), batch, **blocks) as it:
        assert it.stats()["shuffle_window"] == figures["shuffle_window"]
        return [list(it) for _ in range(epochs)]


@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("mode", ["sync", "async", "threads"])
def test_every_epoch_fetches_the_data_once_where_every_held_block_is_cut_out(
    four_mib: Copies,
    s3: MotoS3,
    proxy_for: list[FaultProxy],
    batch: int,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every held run cut out of the ranges that cover it (however short: what the cost
    rule leaves out is the ranges' business), an epoch fetches the data once."""
    monkeypatch.setattr(_held, "MIN_CUT_BYTES", 0)
    nbytes = four_mib.tokens.nbytes
    proxy = CountingProxy(s3.port, lifetime=100.0).start()
    proxy_for.append(proxy)
    storage = guideloom.open_stream(four_mib.s3_url, **s3.options(proxy.url))
    options: dict[str, Any] = {"num_workers": 2} if mode == "threads" else {}
    with loader(storage, batch, **options) as it:
        assert it.stats()["shuffle_block_size"] == 4 * MiB // (SEQ * 2)
        epochs: list[list[torch.Tensor]] = []
        figures: list[dict[str, float]] = []
        sent: list[int] = []
        for _ in range(2):
            before = proxy.sent
            epochs.append(one_epoch(it, mode))
            figures.append(dict(it.stats()))
            sent.append(proxy.sent - before)
    # what was delivered is the data, as a loader over the local copy delivers it
    for got, want in zip(epochs, local_epochs(four_mib, batch, figures[0], 2), strict=True):
        assert len(got) == len(want) == len(four_mib.tokens) // SEQ // batch
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for f, wire in zip(figures, sent, strict=True):
        assert nbytes <= f["epoch_bytes_read"] <= 1.01 * nbytes, (batch, mode, f["epoch_bytes_read"] / nbytes)
        # what the server sent, its responses' headers included
        assert f["epoch_bytes_read"] < wire <= 1.01 * nbytes, (batch, mode, wire / nbytes)
    assert storage.stats()["bytes_read"] == figures[-1]["bytes_read"]


def test_a_resumed_epoch_fetches_the_rest_once(
    four_mib: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_held, "MIN_CUT_BYTES", 0)
    nbytes = four_mib.tokens.nbytes
    with loader(guideloom.open_stream(four_mib.s3_url, **s3.options()), 8) as first:
        it = iter(first)
        head = [next(it) for _ in range(100)]
        state = first.state_dict()
        it.close()
    storage = guideloom.open_stream(four_mib.s3_url, **s3.options())
    with loader(storage, 8) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
        figures = resumed.stats()
    with loader(
        guideloom.open_stream(four_mib.local), 8, shuffle_block_size=int(figures["shuffle_block_size"])
    ) as local:
        whole = list(local)
    assert len(head) + len(rest) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, whole, strict=True))
    # the rest of the one mixing window: its blocks once, the resumed first batch's included
    assert storage.stats()["bytes_read"] <= 1.01 * nbytes


def test_objects_replaced_after_the_first_batch_are_refused(
    four_mib: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window read after the first batch copies the blocks that batch verified, and fetches
    the rest with GETs conditional on the objects the dataset was opened with: objects replaced
    in between are refused at that read, not delivered beside the blocks held."""
    prefix = "copies/once-replaced"
    s3.upload_folder(four_mib.local, BUCKET, prefix)
    shards = sorted(p.name for p in four_mib.local.iterdir() if p.name.endswith(".bin"))
    prepare = RangeFetcher.prepare
    planned: list[int] = []

    def replace_before_the_window_read(self: RangeFetcher, jobs: list[Job], *args: Any) -> Any:
        planned.append(len(jobs))
        if len(planned) == 2:  # the first read kept its blocks; the window read is planned now
            assert self.held.nbytes > 0
            client = s3.client()
            for shard in shards:
                body = (four_mib.local / shard).read_bytes()
                client.put_object(Bucket=BUCKET, Key=f"{prefix}/{shard}", Body=body[::-1])  # same size
        return prepare(self, jobs, *args)

    monkeypatch.setattr(RangeFetcher, "prepare", replace_before_the_window_read)
    storage = guideloom.open_stream(f"s3://{BUCKET}/{prefix}", **s3.options())
    with loader(storage, 8) as it:
        batches = iter(it)
        first = next(batches)
        with pytest.raises(DatasetIntegrityError, match="changed on the object store"):
            next(batches)
        blocks = int(it.stats()["shuffle_block_size"])
    assert len(planned) >= 2
    with loader(guideloom.open_stream(four_mib.local), 8, shuffle_block_size=blocks) as local:
        assert torch.equal(first, next(iter(local)))


@pytest.mark.parametrize("mode", ["sync", "async", "threads"])
def test_a_mixing_window_read_in_parts_fetches_each_block_once(
    four_mib: Copies, s3: MotoS3, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads of at most 16 batches of 8: the one mixing window is read in 32 parts, each
    touching most of its blocks; the blocks an earlier part verified are held for the later
    ones (never more than one mixing window's bytes), so each is fetched once, every epoch."""
    monkeypatch.setattr(_held, "MIN_CUT_BYTES", 0)
    nbytes = four_mib.tokens.nbytes
    storage = guideloom.open_stream(four_mib.s3_url, **s3.options())
    storage.read_window_batches = 16
    options: dict[str, Any] = {"num_workers": 2} if mode == "threads" else {}
    with loader(storage, 8, **options) as it:
        epochs: list[list[torch.Tensor]] = []
        figures: list[dict[str, float]] = []
        for _ in range(2):
            epochs.append(one_epoch(it, mode))
            figures.append(dict(it.stats()))
        held = storage._remote.fetcher.held
        assert 0 < held.peak_nbytes <= storage.read_window_bytes
    assert held.nbytes == 0, "closing lets go of what is held"
    for got, want in zip(epochs, local_epochs(four_mib, 8, figures[0], 2), strict=True):
        assert len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for f in figures:
        assert f["shuffle_window"] * 8 > 16, "the mixing window is read in parts"
        assert nbytes <= f["epoch_bytes_read"] <= 1.01 * nbytes, (mode, f["epoch_bytes_read"] / nbytes)


@pytest.mark.parametrize("batch", [8, 32])
def test_by_default_held_blocks_never_cost_a_request_nor_a_byte_more(
    four_mib: Copies, s3: MotoS3, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default cuts a held run out of a range only at its ends or where it is long
    (``MIN_CUT_BYTES``): against reads that hold nothing, no more requests and no more bytes,
    every epoch, and the same batches."""

    def epochs() -> tuple[list[list[torch.Tensor]], list[dict[str, float]]]:
        storage = guideloom.open_stream(four_mib.s3_url, **s3.options())
        storage.read_window_batches = 16  # a window read in parts, beside the first batch read alone
        with loader(storage, batch) as it:
            got, figures = [], []
            for _ in range(2):
                got.append(list(it))
                figures.append(dict(it.stats()))
        return got, figures

    held, with_held = epochs()
    monkeypatch.setattr(_held.HeldBlocks, "take", lambda *a: [])
    plain, without = epochs()
    assert all(torch.equal(a, b) for e, f in zip(held, plain, strict=True) for a, b in zip(e, f, strict=True))
    for h, p in zip(with_held, without, strict=True):
        assert h["epoch_requests"] <= p["epoch_requests"], (h["epoch_requests"], p["epoch_requests"])
        assert h["epoch_bytes_read"] <= p["epoch_bytes_read"]


def test_a_storage_told_its_next_reads_pickles_for_a_process_worker(four_mib: Copies, s3: MotoS3) -> None:
    """The reads ``will_read`` said come next stay with this process's session: a storage told
    them still pickles (a process worker's copy is sent once the first reads began here)."""
    import pickle

    storage = guideloom.open_stream(four_mib.s3_url, **s3.options())
    storage.will_read((np.arange(k, k + 4, dtype=np.int64) * SEQ for k in range(3)), SEQ)
    copy = pickle.loads(pickle.dumps(storage))
    assert len(copy) == len(storage)
