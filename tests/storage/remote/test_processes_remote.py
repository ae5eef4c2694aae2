"""Process workers over object storage: the main process reads, as for thread workers, and the
workers collate."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import guideloom
from guideloom._runtime.processes import RemoteTraceback
from guideloom_dev.servers import MotoS3
from tests.support.data import Boom
from tests.support.loader import assert_same
from tests.support.processes import SEQ, collated_where, exits_at_40, fails_at_40, ids, write_positions
from tests.support.remote import BUCKET, Copies, all_batches, loader_over, unique

pytestmark = pytest.mark.slow


def test_process_workers_over_s3_read_as_threads_do(stream_copies: Copies, s3: MotoS3) -> None:
    with loader_over(guideloom.open_stream(stream_copies.local)) as local:
        expected = [list(local), list(local)]  # two epochs
    threads = guideloom.open_stream(stream_copies.s3_url, **s3.options())
    with loader_over(threads, num_workers=2, prefetch=4) as loader:
        before = loader.stats()["requests"]
        [list(loader), list(loader)]
        thread_requests = loader.stats()["requests"] - before
    storage = guideloom.open_stream(stream_copies.s3_url, **s3.options())
    loader = loader_over(storage, num_workers=2, parallel_method="process", prefetch=4)
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
    """The batches read while the workers start are collated here (the first epoch need not wait
    for them); once they are up, every batch is collated by a worker, in order."""
    expected = all_batches(guideloom.open_stream(plain_copies.local), sequence_length=200, local_batch_size=4)
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    loader = loader_over(
        storage,
        collate_fn=collated_where,
        sequence_length=200,
        local_batch_size=4,
        num_workers=2,
        parallel_method="process",
        prefetch=4,
        collate_mode="auto",  # asked for: the batches read while the workers start are made here
    )
    with loader:
        start = loader.state_dict()
        first = list(loader)
        loader.load_state_dict(start)  # the same epoch again, its workers up (they persist)
        assert loader._life.pool is not None
        loader._life.pool.start()  # an epoch may end before they are: they are waited for here
        got = list(loader)
        it = iter(loader)  # an epoch left early: the samples sent for its groups are freed
        next(it)
        it.close()
    for epoch in (first, got):
        assert len(epoch) == len(expected) > 0
        assert all(torch.equal(b["tokens"], e) for b, e in zip(epoch, expected, strict=True))
    here = [b["pid"] == os.getpid() for b in first]
    assert here == sorted(here, reverse=True)  # made here until the workers were up, then theirs
    pids = {b["pid"] for b in got}
    assert os.getpid() not in pids and len(pids) >= 1, pids
    assert own_segments() == []
    assert multiprocessing.active_children() == []


@pytest.fixture(scope="module")
def positions_on_s3(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3) -> str:
    """A stream whose sample ``i`` starts with ``i * SEQ``, on S3."""
    folder = write_positions(tmp_path_factory.mktemp("positions") / "ds")
    prefix = unique("positions")
    s3.upload_folder(folder, BUCKET, prefix)
    return f"s3://{BUCKET}/{prefix}"


def _on_s3(url: str, s3: MotoS3, collate: Any, **kw: Any) -> guideloom.StatefulDataLoader[Any, Any]:
    return guideloom.StatefulDataLoader.from_storage(
        guideloom.open_stream(url, **s3.options()),
        collate,
        sequence_length=SEQ,
        local_batch_size=4,
        num_workers=2,
        parallel_method="process",
        prefetch=4,
        device=torch.device("cpu"),
        **kw,
    )


@pytest.mark.usefixtures("workers_up_first")
def test_a_collate_error_over_s3_reaches_the_consumer_at_its_batch(
    positions_on_s3: str, s3: MotoS3, own_segments: Callable[[], list[str]]
) -> None:
    with _on_s3(positions_on_s3, s3, fails_at_40) as loader:
        got = []
        with pytest.raises(Boom, match="sample 40") as info:
            for batch in loader:
                got.append(batch)
        assert len(got) == 10  # batches 0-9: samples 0-39
        assert all(torch.equal(b[:, 0], torch.arange(4 * k, 4 * k + 4) * SEQ) for k, b in enumerate(got))
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert loader.state_dict()["observation_offset"] == 40
    assert own_segments() == []
    assert multiprocessing.active_children() == []


@pytest.mark.asyncio
async def test_async_for_over_s3_with_process_workers_delivers_every_batch(
    positions_on_s3: str, s3: MotoS3
) -> None:
    got = []
    async with _on_s3(positions_on_s3, s3, ids, shuffle=True, shuffle_seed=3) as loader:
        async for batch in loader:
            got.extend(batch)
    assert sorted(got) == list(range(200))
    assert got != sorted(got)


@pytest.mark.usefixtures("workers_up_first")
def test_a_worker_that_dies_over_s3_is_a_worker_error(
    positions_on_s3: str, s3: MotoS3, own_segments: Callable[[], list[str]]
) -> None:
    with (
        _on_s3(positions_on_s3, s3, exits_at_40) as loader,
        pytest.raises(guideloom.WorkerError, match="died"),
    ):
        for _ in loader:
            pass
    assert own_segments() == []
    assert multiprocessing.active_children() == []
