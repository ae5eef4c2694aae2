"""Read an S3 dataset asynchronously, then exit: the process must always exit with code 0.

Usage: ``python tests/support/exit_script.py s3://bucket/prefix MODE`` with the server in the AWS_* variables.
MODE: ``read`` (read and close), ``noclose`` (read, exit with the storage open), ``inflight``
(exit while range requests are still in flight), ``loader`` (``async for`` over a loader, left
midway).
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

import guideloom


async def main(url: str, mode: str) -> None:
    storage = guideloom.open_stream(url, coalesce_gap=0)
    starts = np.arange(0, 60, dtype=np.int64) * 300
    if mode == "loader":
        from guideloom import StatefulDataLoader

        loader = StatefulDataLoader.from_storage(
            storage, len, sequence_length=300, local_batch_size=4, shuffle=True, shuffle_seed=1
        )
        n = 0
        async for _ in loader:
            n += 1
            if n == 3:
                break
        return
    await storage.open()
    for _ in range(2):
        got = await storage.read_many(starts, 300)
        assert len(got) == len(starts)
    if mode == "inflight":
        task = asyncio.ensure_future(storage.read_many(starts, 300))
        await asyncio.sleep(0.003)
        task.cancel()  # asyncio.run's teardown would cancel it too; requests are still in flight
        return
    if mode == "read":
        await storage.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
