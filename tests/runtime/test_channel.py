"""The credit-based channel between pipeline stages: credits bound prefetch, capacity 0 is
on demand, async and loop-driving consumers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from guideloom._loop import LoopThread
from guideloom._runtime.channel import Channel, EndOfStream


def test_channel_credits_bound_prefetch() -> None:
    """The producer never gets more than capacity batches ahead of the consumer's requests."""
    lt = LoopThread()
    try:
        ch: Channel[int] = Channel(lt.loop, 3)
        produced: list[int] = []

        async def producer() -> None:
            for i in range(50):
                await ch.reserve()
                produced.append(i)
                ch.put(i)
            ch.close()

        lt.submit(producer())
        time.sleep(0.1)
        assert len(produced) == 3  # capacity, and no request yet
        got = [ch.get() for _ in range(10)]
        time.sleep(0.1)
        assert got == list(range(10))
        assert len(produced) == 13  # 10 requests + capacity
        rest = []
        with pytest.raises(EndOfStream):
            while True:
                rest.append(ch.get(timeout=5))
        assert got + rest == list(range(50))
    finally:
        lt.stop()


def test_channel_capacity_zero_is_on_demand() -> None:
    lt = LoopThread()
    try:
        ch: Channel[int] = Channel(lt.loop, 0)
        started = threading.Event()
        count = 0

        async def producer() -> None:
            nonlocal count
            started.set()
            for i in range(5):
                await ch.reserve()
                count += 1
                ch.put(i)

        lt.submit(producer())
        started.wait()
        time.sleep(0.05)
        assert count == 0
        assert ch.get() == 0
        time.sleep(0.05)
        assert count == 1
    finally:
        lt.stop()


def test_channel_async_consumer() -> None:
    async def main() -> list[int]:
        ch: Channel[int] = Channel(asyncio.get_running_loop(), 2)

        async def producer() -> None:
            for i in range(20):
                await ch.reserve()
                ch.put(i)
                await asyncio.sleep(0)
            ch.close()

        task = asyncio.create_task(producer())
        out = []
        try:
            while True:
                out.append(await ch.aget())
        except EndOfStream:
            pass
        await task
        return out

    assert asyncio.run(main()) == list(range(20))


def test_channel_get_future_for_a_loop_driving_consumer() -> None:
    loop = asyncio.new_event_loop()
    try:
        ch: Channel[int] = Channel(loop, 0)
        produced: list[int] = []

        async def producer() -> None:
            for i in range(3):
                await ch.reserve()
                produced.append(i)
                ch.put(i)
            ch.close()

        task = loop.create_task(producer())
        assert [loop.run_until_complete(ch.get_future()) for _ in range(3)] == [0, 1, 2]
        assert produced == [0, 1, 2]
        with pytest.raises(EndOfStream):
            loop.run_until_complete(ch.get_future())
        loop.run_until_complete(task)
    finally:
        loop.close()
