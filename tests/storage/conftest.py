"""Fixtures shared by the storage tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from guideloom.storage._cache._chunks import ChunkCache


@pytest.fixture
def stopped() -> Iterator[list[ChunkCache]]:
    """Chunk caches a test appends here are stopped when it ends, whatever it raised."""
    caches: list[ChunkCache] = []
    yield caches
    for c in caches:
        c.stop()
