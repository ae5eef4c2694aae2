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
    threads = guideloom.open_stream(stream_copies.s3_url, **s3.options())
    with loader_for(threads, num_workers=2, prefetch=4) as loader:
        before = loader.stats()["requests"]
        [list(loader), list(loader)]
        thread_requests = loader.stats()["requests"] - before
    storage = guideloom.open_stream(stream_copies.s3_url, **s3.options())
    loader = loader_for(storage, num_workers=2, parallel_method="process", prefetch=4)
    with loader:
        before = loader.stats()["requests"]
        got = [list(loader), list(loader)]  # epoch 2 on the same workers and their connections
        # The workers read with their own connections, a read window at a time as the main
        # process does (not a request per sample), and stats() counts their requests.
        worker_requests = loader.stats()["requests"] - before
    assert 0 < worker_requests <= 1.25 * thread_requests + 2, (worker_requests, thread_requests)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    assert multiprocessing.active_children() == []
