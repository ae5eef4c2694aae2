"""What stands before the first batch over object storage: no round trip that can be skipped."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import guideloom
from guideloom._errors import DatasetIntegrityError
from guideloom.storage._remote import _client
from guideloom_dev.servers import MotoS3
from tests.support.remote import BUCKET, Copies, unique


def _count_manifest_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = _client.Remote.read_manifest

    def counted(self: _client.Remote) -> Any:
        calls[0] += 1
        return original(self)

    monkeypatch.setattr(_client.Remote, "read_manifest", counted)
    return calls


def test_open_right_after_open_stream_does_not_read_the_manifest_again(
    plain_copies: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_manifest_reads(monkeypatch)
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    assert calls[0] == 1
    asyncio.run(storage.open())
    assert calls[0] == 1  # checked a moment ago by open_stream, with every object's size
    rows = asyncio.run(storage.read_many(np.asarray([0, 500], dtype=np.int64), 10))
    assert np.array_equal(np.asarray(rows)[1], plain_copies.tokens[500:510])
    asyncio.run(storage.close())
    asyncio.run(storage.open())  # a later open (the next epoch) reads it again
    assert calls[0] == 2
    asyncio.run(storage.close())


def test_a_manifest_rewritten_between_opens_is_still_refused(
    plain_copies: Copies, stream_copies: Copies, s3: MotoS3
) -> None:
    prefix = unique("rewritten")
    s3.upload_folder(plain_copies.local, BUCKET, prefix)
    storage = guideloom.open_stream(f"s3://{BUCKET}/{prefix}", **s3.options())
    asyncio.run(storage.open())
    asyncio.run(storage.close())
    other = (stream_copies.local / "manifest.json").read_bytes()  # another dataset's, valid
    s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/manifest.json", Body=other)
    with pytest.raises(DatasetIntegrityError, match="manifest changed"):
        asyncio.run(storage.open())


def test_an_open_long_after_open_stream_reads_the_manifest_again(
    plain_copies: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_client, "MANIFEST_FRESH_SECONDS", 0.0)
    calls = _count_manifest_reads(monkeypatch)
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    asyncio.run(storage.open())
    assert calls[0] == 2
    asyncio.run(storage.close())


def test_open_stream_lists_the_objects_while_it_reads_the_manifest(
    plain_copies: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing does not wait for the manifest: the manifest read here waits for the listing
    to have started, which only a concurrent listing lets happen."""
    listing = threading.Event()
    list_sizes, read_manifest = _client.Remote.list_sizes, _client.Remote.read_manifest

    def listed(self: _client.Remote) -> Any:
        listing.set()
        return list_sizes(self)

    def manifest(self: _client.Remote) -> Any:
        assert listing.wait(10), "the objects were not listed while the manifest was read"
        return read_manifest(self)

    monkeypatch.setattr(_client.Remote, "list_sizes", listed)
    monkeypatch.setattr(_client.Remote, "read_manifest", manifest)
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    assert len(storage) == len(plain_copies.tokens)


def test_a_listing_that_is_refused_falls_back_to_heads(
    plain_copies: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_client.Remote, "list_sizes", lambda self: None)
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    assert len(storage) == len(plain_copies.tokens)
