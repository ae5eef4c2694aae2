"""``cache_max_bytes``: a remote dataset cached in chunks under a byte limit, through the loader,
against real servers (moto S3, nginx, the fault proxy)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import guideloom
from guideloom import StatefulDataLoader
from guideloom.storage._cache._chunks import ChunkCache
from guideloom.storage._cache._copy import DatasetCache, copy_footprint
from guideloom.storage._remote._storage import ObjectStreamStorage
from guideloom_dev.servers import FaultProxy, MotoS3, Nginx
from tests.support.chunks import Sampler
from tests.support.loader import assert_same
from tests.support.remote import Copies, collate, start_proxy

CPU = torch.device("cpu")
DATASET = 80_000  # plain_copies: 40,000 uint16 in three objects
LIMIT = DATASET // 4
KW: dict[str, Any] = dict(sequence_length=100, local_batch_size=4, shuffle=False, prefetch=2)


def cached(url: str, root: Path, **options: Any) -> ObjectStreamStorage:
    storage = guideloom.open_stream(
        url, cache_dir=root, cache_max_bytes=LIMIT, cache_chunk_bytes=4096, **options
    )
    assert isinstance(storage, ObjectStreamStorage) and isinstance(storage._chunks, ChunkCache)
    storage.read_window_bytes = 4000  # windows of 5 batches: the plan has many steps
    return storage


def batches(storage: Any, **kw: Any) -> list[Any]:
    with StatefulDataLoader.from_storage(storage, collate, device=CPU, **{**KW, **kw}) as loader:
        return list(loader)


def test_a_limit_below_the_dataset_caches_chunks_within_it_and_delivers_the_same_batches(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    storage = cached(plain_copies.s3_url, tmp_path, **s3.options())
    assert storage._chunks is not None
    for shuffle in (False, True):
        expected = batches(guideloom.open_stream(plain_copies.local), shuffle=shuffle, shuffle_seed=4)
        with Sampler(storage._chunks.folder) as sampler:
            for _epoch in range(2):
                assert_same(expected, batches(storage, shuffle=shuffle, shuffle_seed=4))
        assert 0 < sampler.peak <= LIMIT, f"{sampler.peak} bytes on disk for a limit of {LIMIT}"
    stats = storage.stats()
    assert stats["cache_downloads"] > 0 and stats["cache_local_ranges"] > 0 and stats["cache_evictions"] > 0


def test_resume_mid_epoch_over_a_chunk_cache_is_exact(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    kw = dict(shuffle=True, shuffle_seed=9)
    expected = batches(guideloom.open_stream(plain_copies.local), **kw)
    first = StatefulDataLoader.from_storage(
        cached(plain_copies.s3_url, tmp_path, **s3.options()), collate, device=CPU, **{**KW, **kw}
    )
    with first:
        it = iter(first)
        head = [next(it) for _ in range(37)]
        state = first.state_dict()
    again = StatefulDataLoader.from_storage(
        cached(plain_copies.s3_url, tmp_path, **s3.options()),
        collate,
        device=CPU,
        **{**KW, **kw, "local_batch_size": 3},
    )
    again.load_state_dict(state)
    with again:
        rest = list(again)
    flat = [row for b in expected for row in b]
    got = [row for b in head for row in b] + [row for b in rest for row in b]
    assert len(got) == len(flat) and all(torch.equal(a, b) for a, b in zip(got, flat, strict=True))


def test_resets_stalls_and_503s_during_chunk_downloads_do_not_change_the_batches(
    plain_copies: Copies, nginx: Nginx, proxy_for: list[FaultProxy], tmp_path: Path
) -> None:
    proxy = start_proxy(proxy_for, nginx.port)
    url = f"{proxy.url}/{plain_copies.http_path}"
    storage = cached(url, tmp_path, retries=20, backoff=0.01, max_backoff=0.05, timeout=1.0)
    expected = batches(guideloom.open_stream(plain_copies.local), shuffle=True, shuffle_seed=2)
    proxy.fail_every = 3  # reset, truncate, 503 in turn
    got = batches(storage, shuffle=True, shuffle_seed=2)
    assert proxy.stats.faults > 0
    assert_same(expected, got)
    proxy.fail_every = 0
    proxy.stall = True  # a server that stops answering for a moment

    def unstall() -> None:
        proxy.stall = False

    import threading

    timer = threading.Timer(0.5, unstall)
    timer.start()
    try:
        assert_same(expected, batches(storage, shuffle=True, shuffle_seed=2))
    finally:
        timer.cancel()


_FSIZE = """
import json, resource, signal, sys
import numpy as np
import guideloom
from guideloom import StatefulDataLoader
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
url, root, options, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
s = guideloom.open_stream(url, cache_dir=root, cache_max_bytes=20_000, cache_chunk_bytes=4096, **options)
s.read_window_bytes = 4000
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))  # no chunk fits in a file
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loader = StatefulDataLoader.from_storage(s, lambda b: np.asarray(b).tolist(), sequence_length=100,
                                             local_batch_size=4, device="cpu", shuffle=True, shuffle_seed=1)
    with loader:
        rows = [r for b in loader for r in b]
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
with open(out, "w") as f:  # a file, not stdout: a large write to a pipe can be cut short
    json.dump({"rows": rows, "warnings": [str(w.message) for w in caught]}, f)
"""


@pytest.mark.slow
def test_a_file_size_limit_on_the_cache_warns_and_reads_stay_exact(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _FSIZE,
            plain_copies.s3_url,
            str(tmp_path / "c"),
            json.dumps(s3.options()),
            str(tmp_path / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    local = StatefulDataLoader.from_storage(
        guideloom.open_stream(plain_copies.local),
        lambda b: [list(map(int, r)) for r in b],
        sequence_length=100,
        local_batch_size=4,
        device=CPU,
        shuffle=True,
        shuffle_seed=1,
    )
    with local:
        rows = [r for b in local for r in b]
    assert out["rows"] == rows
    assert len(out["warnings"]) == 1 and "File too large" in out["warnings"][0], out["warnings"]
    assert "nothing is lost" in out["warnings"][0]


def test_cache_limits_need_cache_dir_and_are_checked(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="cache_max_bytes only apply with cache_dir"):
        guideloom.open_stream(plain_copies.s3_url, cache_max_bytes=10**6, **s3.options())
    with pytest.raises(ValueError, match="cache_max_bytes must be an integer >= 0"):
        guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, cache_max_bytes=-1, **s3.options())
    with pytest.raises(ValueError, match="cache_chunk_bytes must be an integer >= 4096"):
        guideloom.open_stream(plain_copies.s3_url, cache_dir=tmp_path, cache_chunk_bytes=100, **s3.options())
    with pytest.raises(TypeError, match="only apply to reading"):
        guideloom.write_stream("s3://b/x", [1, 2], cache_max_bytes=5, **s3.options())


def test_a_limit_at_least_the_dataset_is_the_whole_copy(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    """... counted as the chunk cache counts its limit: the files in 4 KiB blocks and the
    manifest. A limit of just the files' bytes is too small for the whole copy: chunks."""
    probe = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    assert isinstance(probe, ObjectStreamStorage)
    footprint = copy_footprint(probe.manifest)
    assert footprint > DATASET
    for limit in (footprint, 10 * DATASET, None):
        s = guideloom.open_stream(
            plain_copies.s3_url, cache_dir=tmp_path, cache_max_bytes=limit, **s3.options()
        )
        assert isinstance(s, ObjectStreamStorage)
        assert isinstance(s._cache, DatasetCache) and s._chunks is None
    for limit in (DATASET, footprint - 1):
        s = guideloom.open_stream(
            plain_copies.s3_url, cache_dir=tmp_path, cache_max_bytes=limit, **s3.options()
        )
        assert isinstance(s, ObjectStreamStorage) and s._cache is None
        assert isinstance(s._chunks, ChunkCache)
        asyncio.run(s.close())


@pytest.mark.slow
def test_process_workers_read_through_a_bounded_cache(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    """A storage with a chunk cache pickles for process workers (each makes its own cache on the
    shared folder) and they deliver the batches of the local dataset (it failed to pickle)."""
    expected = batches(guideloom.open_stream(plain_copies.local), shuffle=True, shuffle_seed=2)
    storage = cached(plain_copies.s3_url, tmp_path, **s3.options())
    got = batches(storage, shuffle=True, shuffle_seed=2, num_workers=2, parallel_method="process")
    assert_same(expected, got)


def test_documents_are_cached_in_chunks_by_the_plan_too(s3: MotoS3, tmp_path: Path) -> None:
    import numpy as np

    from tests.support.remote import BUCKET, unique

    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 60_000, int(n), dtype=np.uint16) for n in rng.integers(0, 300, 400)]
    folder = tmp_path / "docs"
    guideloom.write_documents(folder, docs, shard_bytes=30_000)
    prefix = unique("chunked-docs")
    s3.upload_folder(folder, BUCKET, prefix)
    total = sum(d.nbytes for d in docs)
    storage = guideloom.open_documents(
        f"s3://{BUCKET}/{prefix}",
        cache_dir=tmp_path / "c",
        cache_max_bytes=total // 4,
        cache_chunk_bytes=4096,
        **s3.options(),
    )
    assert storage._chunks is not None  # type: ignore[attr-defined]
    storage.read_window_bytes = 4000

    def rows(s: Any) -> list[list[int]]:
        kw: dict[str, Any] = dict(local_batch_size=4, shuffle=True, shuffle_seed=5, prefetch=2, device=CPU)
        with StatefulDataLoader.from_storage(s, lambda b: [d.tolist() for d in b], **kw) as loader:
            return [d for b in loader for d in b]

    expected = rows(guideloom.open_documents(folder))
    with Sampler(storage._chunks.folder) as sampler:  # type: ignore[attr-defined]
        assert rows(storage) == expected
        assert rows(storage) == expected
    assert sampler.peak <= total // 4
    assert storage.stats()["cache_local_ranges"] > 0  # type: ignore[attr-defined]


_RANK = """
import json, sys
import numpy as np
import guideloom
from guideloom import StatefulDataLoader
url, root, rank, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]
options = json.loads(sys.argv[4])
s = guideloom.open_stream(url, cache_dir=root, cache_max_bytes=20_000, cache_chunk_bytes=4096, **options)
s.read_window_bytes = 4000
loader = StatefulDataLoader.from_storage(s, lambda b: np.asarray(b).tolist(), sequence_length=100,
                                         local_batch_size=4, rank=rank, world_size=2, device="cpu",
                                         shuffle=False, prefetch=2)
with loader:
    rows = [[r for b in loader for r in b] for _epoch in range(2)]
with open(out, "w") as f:  # a file, not stdout: a large write to a pipe can be cut short
    json.dump({"rows": rows, "stats": s.stats()}, f)
"""


@pytest.mark.slow
def test_two_ranks_of_a_node_share_one_bounded_folder(
    plain_copies: Copies, s3: MotoS3, tmp_path: Path
) -> None:
    probe = cached(plain_copies.s3_url, tmp_path, **s3.options())
    assert probe._chunks is not None
    with Sampler(probe._chunks.folder) as sampler:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _RANK,
                    plain_copies.s3_url,
                    str(tmp_path),
                    str(r),
                    json.dumps(s3.options()),
                    str(tmp_path / f"rank{r}.json"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=100) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _o, e in outs]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        kw: dict[str, Any] = dict(
            sequence_length=100, local_batch_size=4, rank=rank, world_size=2, device=CPU
        )
        local = StatefulDataLoader.from_storage(
            guideloom.open_stream(plain_copies.local), lambda b: [list(map(int, r)) for r in b], **kw
        )
        with local:
            expected = [r for b in local for r in b]
        assert res["rows"] == [expected, expected]
    assert 0 < sampler.peak <= LIMIT, f"{sampler.peak} bytes on disk for a limit of {LIMIT}"
    assert sum(r["stats"]["cache_downloads"] for r in results) > 0
