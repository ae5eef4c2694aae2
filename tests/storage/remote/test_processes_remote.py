"""Process workers over object storage: each worker opens its own connection to the store."""

from __future__ import annotations

import multiprocessing

import pytest

import guideloom
from tests.support.remote import Copies, assert_same, loader_for
from tests.support.servers import MotoS3

pytestmark = pytest.mark.slow


def test_process_workers_read_an_s3_dataset_themselves(stream_copies: Copies, s3: MotoS3) -> None:
    with loader_for(guideloom.open_stream(stream_copies.local)) as local:
        expected = [list(local), list(local)]  # two epochs
    storage = guideloom.open_stream(stream_copies.s3_url, **s3.options())
    loader = loader_for(storage, num_workers=2, parallel_method="process", prefetch=4)
    with loader:
        requests_before = storage._remote.requests  # type: ignore[attr-defined]
        got = [list(loader), list(loader)]  # epoch 2 on the same workers and their connections
        # Every range was read by the workers' own connections, none by the main process's.
        assert storage._remote.requests == requests_before  # type: ignore[attr-defined]
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    assert multiprocessing.active_children() == []
