"""One storage object read by several loaders (a train and an eval loader, say): each loader's
close closes the storage only once no other open loader reads it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom as gl
from tests.support.data import IdsOf

pytestmark = pytest.mark.usefixtures("no_thread_leak")


@pytest.fixture
def stream(tmp_path: Path) -> Any:
    gl.write_stream(tmp_path / "ds", np.arange(4096, dtype=np.int64), shard_bytes=1 << 12)
    return gl.open_stream(tmp_path / "ds")


def loader(storage: Any, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    return gl.StatefulDataLoader.from_storage(
        storage, IdsOf(16), sequence_length=16, local_batch_size=4, **kw
    )


def test_closing_one_of_two_loaders_over_one_storage_leaves_the_other_reading(stream: Any) -> None:
    with loader(stream) as alone:
        expected = list(alone)
    a, b = loader(stream), loader(stream)
    with a:
        with b:
            ia = iter(a)
            first = [next(ia) for _ in range(3)]
            assert next(iter(b)) == expected[0]
        rest = list(ia)  # b closed: a goes on over the storage still open for it
    assert first + rest == expected
    with pytest.raises(RuntimeError, match="not open"):  # the last close closed it
        stream.read_many_sync(np.array([0]), 16)


def test_two_async_loaders_over_one_storage_close_in_either_order(stream: Any) -> None:
    with loader(stream) as alone:
        expected = list(alone)

    async def run() -> tuple[list[Any], list[Any]]:
        a, b = loader(stream, shuffle=False), loader(stream, shuffle=False)
        async with a:
            async with b:
                got_b = [x async for x in b]
            got_a = [x async for x in a]
        return got_a, got_b

    got_a, got_b = asyncio.run(run())
    assert got_a == expected and got_b == expected
    with pytest.raises(RuntimeError, match="not open"):
        stream.read_many_sync(np.array([0]), 16)


def tokens_of(rows: Any) -> list[list[int]]:
    return [r["tokens"].tolist() for r in rows]


def test_packed_loaders_over_one_document_storage(tmp_path: Path) -> None:
    docs = [np.arange(i % 37 + 3, dtype=np.int64) + 1000 * i for i in range(300)]
    gl.write_documents(tmp_path / "docs", docs)
    storage = gl.open_documents(tmp_path / "docs")

    def packed() -> gl.StatefulDataLoader[Any, Any]:
        return gl.StatefulDataLoader(gl.pack(storage, 32), tokens_of, local_batch_size=2)

    with packed() as alone:
        expected = list(alone)
    a, b = packed(), packed()
    with a:
        it = iter(a)
        head = [next(it)]
        with b:
            assert list(b) == expected
        assert head + list(it) == expected
