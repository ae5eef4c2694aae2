"""Process workers over object storage: the main process reads, as for thread workers, and the
workers collate."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

import pytest
import torch

import guideloom
from tests.support.processes import collated_where
from tests.support.remote import Copies, all_batches, assert_same, loader_for
from tests.support.servers import MotoS3

pytestmark = pytest.mark.slow


def test_process_workers_over_s3_read_as_threads_do(stream_copies: Copies, s3: MotoS3) -> None:
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
        # A read window at a time, its requests coalesced (not a request per sample), as with
        # thread workers.
        worker_requests = loader.stats()["requests"] - before
    assert 0 < worker_requests <= 1.25 * thread_requests + 2, (worker_requests, thread_requests)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    assert multiprocessing.active_children() == []


def test_process_workers_over_s3_collate_in_the_workers(
    plain_copies: Copies, s3: MotoS3, own_segments: Callable[[], list[str]]
) -> None:
    expected = all_batches(guideloom.open_stream(plain_copies.local), sequence_length=200, local_batch_size=4)
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    loader = loader_for(
        storage,
        collate_fn=collated_where,
        sequence_length=200,
        local_batch_size=4,
        num_workers=2,
        parallel_method="process",
        prefetch=4,
    )
    with loader:
        got = list(loader)
        it = iter(loader)  # an epoch left early: the samples sent for its groups are freed
        next(it)
        it.close()
    assert len(got) == len(expected) > 0
    assert all(torch.equal(b["tokens"], e) for b, e in zip(got, expected, strict=True))
    pids = {b["pid"] for b in got}
    assert os.getpid() not in pids and len(pids) >= 1, pids
    assert own_segments() == []
    assert multiprocessing.active_children() == []
