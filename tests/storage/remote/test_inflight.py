"""The limit on requests and bytes in flight: the earliest read's waiting requests are admitted
first, each read's in the order asked, so that reads in flight together finish in order."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom
from guideloom.storage._remote import _fetch
from guideloom.storage._remote._locations import parse_location
from guideloom.storage._remote._options import ReadSettings
from guideloom.storage._remote._ranges import Job
from guideloom_dev.servers import MotoS3
from tests.support.remote import BUCKET, unique


async def _admitted(limit: _fetch.InflightLimit, asks: list[tuple[str, int | None]]) -> list[str]:
    """Fill the limit, queue ``asks`` (a name and a rank each, one request of 1 byte), then let
    the limit go: each admitted gives its room back at once, the names in the order admitted."""
    await limit.acquire(limit.max_requests, 1)  # everything in flight: the asks all wait
    order: list[str] = []

    async def ask(name: str, rank: int | None) -> None:
        await limit.acquire(1, 1, rank)
        order.append(name)
        limit.release(1, 1)  # the next one's turn

    tasks = []
    for name, rank in asks:
        tasks.append(asyncio.create_task(ask(name, rank)))
        await asyncio.sleep(0)  # asked in this order
    assert order == []
    limit.release(limit.max_requests, 1)
    await asyncio.gather(*tasks)
    return order


@pytest.mark.asyncio
async def test_the_earliest_reads_requests_go_first_then_each_reads_in_the_order_asked() -> None:
    limit = _fetch.InflightLimit(max_requests=1, max_bytes=1 << 20)
    asks = [
        ("w2-a", 2),
        ("w1-a", 1),
        ("w2-b", 2),
        ("none-a", None),
        ("w1-b", 1),
        ("w0-a", 0),
        ("none-b", None),
    ]
    got = await _admitted(limit, asks)
    assert got == ["w0-a", "w1-a", "w1-b", "w2-a", "w2-b", "none-a", "none-b"]


@pytest.mark.asyncio
async def test_without_ranks_requests_are_admitted_in_the_order_asked() -> None:
    limit = _fetch.InflightLimit(max_requests=1, max_bytes=1 << 20)
    got = await _admitted(limit, [(str(i), None) for i in range(6)])
    assert got == [str(i) for i in range(6)]


@pytest.mark.asyncio
async def test_a_waiter_cancelled_leaves_the_others_admitted_in_order_and_the_limit_whole() -> None:
    limit = _fetch.InflightLimit(max_requests=1, max_bytes=100)
    await limit.acquire(1, 10)
    admitted: list[int] = []

    async def ask(rank: int) -> None:
        await limit.acquire(1, 10, rank)
        admitted.append(rank)
        limit.release(1, 10)

    tasks = {rank: asyncio.create_task(ask(rank)) for rank in (3, 1, 2)}
    await asyncio.sleep(0)
    tasks[1].cancel()
    limit.release(1, 10)
    await asyncio.gather(tasks[2], tasks[3])
    assert tasks[1].cancelled()
    assert admitted == [2, 3]
    assert (limit.requests, limit.nbytes) == (0, 0)


@pytest.mark.asyncio
async def test_an_acquisition_above_the_byte_budget_is_admitted_alone_in_its_turn() -> None:
    limit = _fetch.InflightLimit(max_requests=8, max_bytes=100)
    await limit.acquire(1, 60)
    big = asyncio.create_task(limit.acquire(1, 500, 0))
    later = asyncio.create_task(limit.acquire(1, 10, 1))  # fits, but waits behind the earlier read
    await asyncio.sleep(0)
    assert not big.done() and not later.done()
    limit.release(1, 60)
    await big
    await asyncio.sleep(0)
    assert not later.done() and limit.nbytes == 500
    limit.release(1, 500)
    await later
    assert (limit.requests, limit.nbytes) == (1, 10)


def test_a_window_called_first_ends_first_though_the_next_is_ready_to_fetch_before_it(
    s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two windows read together, each the in-flight byte budget's size. The one called first
    is slow to get from its plan to its first request (slowed here, on its I/O thread; on a
    busy machine a thread switch is enough), and the next one, woken as soon as it was planned,
    is ready first: it must still wait for the first to start fetching. It took the whole budget
    at once instead, and ended first, while the batches to hand out next (the first window's)
    waited for its bytes."""
    tokens = (np.arange(2**18) % 65_521).astype(np.uint16)  # 512 KiB: 8 blocks of 64 KiB
    prefix = unique("ready-first")
    guideloom.write_stream(tmp_path / "data", tokens, shard_bytes=2**17)
    s3.upload_folder(tmp_path / "data", BUCKET, prefix)
    cut = _fetch.RangeFetcher.cut

    def slow_for_the_first(self: _fetch.RangeFetcher, jobs: list[Any]) -> None:
        if jobs and jobs[0].path.endswith("-00000.bin") and jobs[0].starts[0] == 0:
            time.sleep(0.3)
        cut(self, jobs)

    monkeypatch.setattr(_fetch.RangeFetcher, "cut", slow_for_the_first)
    options = {**s3.options(), "max_inflight_bytes": 2**18, "max_request_bytes": 2**16}
    storage = guideloom.open_stream(f"s3://{BUCKET}/{prefix}", **options)
    length = 256
    first = np.arange(0, 2**17, length, dtype=np.int64)  # 512 samples: planned off the loop
    second = first + 2**17  # no block of the first window's
    ended: list[str] = []

    async def read(name: str, starts: np.ndarray) -> None:
        rows = await storage.read_many(starts, length)
        assert np.array_equal(np.asarray(rows), tokens[starts[:, None] + np.arange(length)])
        ended.append(name)

    async def both() -> None:
        await storage.open()
        try:
            await asyncio.gather(read("first", first), read("second", second))
        finally:
            await storage.close()

    asyncio.run(both())
    assert ended == ["first", "second"]


def test_a_read_cancelled_before_its_jobs_start_gives_their_room_back() -> None:
    """A read cancelled in the moment after it was given room for its jobs, before their tasks
    ran a step (the consumer cancelled on the same turn of the loop), gives the room back. A
    task cancelled before its start never runs its body: a release there is lost, its requests
    and bytes stay taken for the rest of the loop's life, and once the budget is lost so, no
    later read finds room."""
    opts = ReadSettings(max_inflight_requests=8, max_inflight_bytes=1 << 20)
    fetcher = _fetch.RangeFetcher(parse_location("s3://bucket/data"), opts, [], _fetch.ReadCounters())

    async def fetch_slowly(store: Any, job: Job) -> None:
        await asyncio.sleep(10)

    fetcher._run_job = fetch_slowly  # type: ignore[method-assign]
    dest = np.zeros(300, dtype=np.uint8)
    jobs = [Job("a.bin", dest, [100 * k], [100 * (k + 1)]) for k in range(3)]

    async def cancelled_at_once() -> _fetch.InflightLimit:
        read = asyncio.create_task(fetcher.run(None, jobs))
        await asyncio.sleep(0)  # its step: room for the 3 jobs, their tasks made, not started
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        return fetcher._inflight.get()

    limit = asyncio.run(cancelled_at_once())
    assert (limit.requests, limit.nbytes) == (0, 0)
