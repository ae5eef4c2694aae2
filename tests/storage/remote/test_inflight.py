"""The limit on requests and bytes in flight: the earliest read's waiting requests are admitted
first, each read's in the order asked, so that reads in flight together finish in order."""

from __future__ import annotations

import asyncio

import pytest

from guideloom.storage._remote._fetch import InflightLimit


async def _admitted(limit: InflightLimit, asks: list[tuple[str, int | None]]) -> list[str]:
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
    limit = InflightLimit(max_requests=1, max_bytes=1 << 20)
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
    limit = InflightLimit(max_requests=1, max_bytes=1 << 20)
    got = await _admitted(limit, [(str(i), None) for i in range(6)])
    assert got == [str(i) for i in range(6)]


@pytest.mark.asyncio
async def test_a_waiter_cancelled_leaves_the_others_admitted_in_order_and_the_limit_whole() -> None:
    limit = InflightLimit(max_requests=1, max_bytes=100)
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
    limit = InflightLimit(max_requests=8, max_bytes=100)
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
