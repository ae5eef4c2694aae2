"""The chunk cache on its own (``guideloom.storage._cache._chunks``): plan-order downloads, Belady
eviction, the byte limit, checksums, crashed and concurrent holders, folder faults.

The "object store" here is a local dataset's bytes behind a ``fetch`` function
(``tests/support/chunks.py``), so every test can count what was fetched and inject faults;
``tests/storage/remote/test_chunks_remote.py`` runs the same cache against real servers through
the loader.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from guideloom._errors import DatasetIntegrityError
from guideloom.storage._cache import _chunk_download, _chunk_folder, _chunks
from guideloom.storage._cache._chunks import ChunkCache
from guideloom.storage._remote._ranges import Limits, plan_windows
from tests.support.chunks import CHUNK, SEQ, Sampler, Store, folder_bytes, settle

pytestmark = pytest.mark.usefixtures("short_first_read_grace")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path)


def test_chunks_are_downloaded_in_plan_order_and_reads_come_from_disk(
    store: Store, tmp_path: Path, stopped: list[ChunkCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_chunk_download, "FETCHES_IN_FLIGHT", 1)  # one at a time: the order is observable
    cache = store.cache(tmp_path / "c", max_bytes=4 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    order = [5, 2, 7, 0]
    cache.plan(store.window(cache, [i]) for i in order)
    settle(cache)
    assert [s // CHUNK for _p, s, _e in store.fetched] == order, "one GET per chunk, in plan order"
    for i in order:
        assert np.array_equal(store.read(cache, [i]), store.expected([i]))
    assert store.remote_ranges == 0
    assert cache.stats()["cache_local_ranges"] == 4


def test_eviction_is_by_next_use_not_by_last_use(
    store: Store, tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    """Room for two chunks; the plan reads 0, 1, 2, 0, 1. Once 2 is read, 1 must come back:
    least-recently-used would evict 0; the plan says 2, the chunk just read, is never needed
    again: 2 goes, and every read finds its chunk on disk."""
    cache = store.cache(tmp_path / "c", max_bytes=2 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    order = [0, 1, 2, 0, 1]
    cache.plan(store.window(cache, [i]) for i in order)
    on_disk = []
    for i in order:
        settle(cache)
        got = store.read(cache, [i])
        assert np.array_equal(got, store.expected([i]))
        settle(cache)
        on_disk.append(sorted(cache._local))
    assert on_disk[2] == [0, 1], "after reading 2: 1 (needed again) replaced 2 (never needed again)"
    assert store.remote_ranges == 0, "every read found its chunk on disk"
    fetched = [s // CHUNK for _p, s, _e in store.fetched]
    assert sorted(fetched[:2]) == [0, 1] and fetched[2:] == [2, 0, 1]


def test_a_chunk_is_not_evicted_for_one_needed_later(
    store: Store, tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    cache = store.cache(tmp_path / "c", max_bytes=2 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    cache.plan(store.window(cache, [i]) for i in [0, 1, 2])
    settle(cache)
    assert sorted(cache._local) == [0, 1], "2 waits: both chunks on disk are needed before it"
    store.read(cache, [0])
    settle(cache)
    assert sorted(cache._local) == [1, 2]


def test_the_folder_never_exceeds_the_limit_over_random_plans(
    tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    store = Store(tmp_path, chunks=24, shard_bytes=5 * CHUNK + 1000)  # chunks of several sizes
    limit = 5 * CHUNK + 123
    cache = store.cache(tmp_path / "c", max_bytes=limit, chunk_bytes=CHUNK)
    stopped.append(cache)
    rng = np.random.default_rng(0)
    windows = [sorted(rng.choice(24, size=3, replace=False).tolist()) for _ in range(60)]
    cache.plan(store.window(cache, w) for w in windows)
    with Sampler(cache.folder) as sampler:
        for n, w in enumerate(windows):
            if n % 2:
                settle(cache)  # half the reads wait for the downloads, half race them
            assert np.array_equal(store.read(cache, w), store.expected(w))
    assert sampler.samples > 10 and 0 < sampler.peak <= limit
    assert cache.stats()["cache_evictions"] > 0 and cache.stats()["cache_local_ranges"] > 0


@pytest.mark.slow
def test_reads_outside_the_plan_are_served_and_a_read_waits_for_its_chunk_in_flight(
    store: Store, tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    cache = store.cache(tmp_path / "c", max_bytes=4 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    assert np.array_equal(store.read(cache, [5, 1], planned=False), store.expected([5, 1]))
    assert store.remote_ranges == 2 and not store.fetched, "no plan: nothing is downloaded"
    store.delay = 0.1
    cache.plan(store.window(cache, [i]) for i in [4])
    deadline = time.monotonic() + 5
    while 4 not in cache._fetching:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert np.array_equal(store.read(cache, [4]), store.expected([4]))
    assert store.remote_ranges == 2, "the read waited for the chunk on its way instead of a GET"
    # ... but only for so long: a slow download does not hold a read up (a first batch)
    store.delay = 3.0
    cache.plan(store.window(cache, [i]) for i in [6])
    deadline = time.monotonic() + 5
    while 6 not in cache._fetching:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    t0 = time.monotonic()
    assert np.array_equal(store.read(cache, [6]), store.expected([6]))
    assert time.monotonic() - t0 < _chunks.CHUNK_WAIT_SECONDS + 1.0
    assert store.remote_ranges == 3
    store.hurry.set()  # the slow download need not be waited out when the cache stops


def test_a_sample_across_chunks_and_objects_reads_exactly(tmp_path: Path, stopped: list[ChunkCache]) -> None:
    store = Store(tmp_path, chunks=6, shard_bytes=3 * CHUNK - 500)
    cache = store.cache(tmp_path / "c", max_bytes=3 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    layouts = store.layouts
    rng = np.random.default_rng(1)
    starts_list = [np.sort(rng.integers(0, 6 * SEQ - 700, size=4)).astype(np.int64) for _ in range(30)]
    cache.plan(((len(s), int(s[0]), int(s[-1])), cache.table.of_rows(layouts, s, 700)) for s in starts_list)
    for i, starts in enumerate(starts_list):
        if i % 2:
            settle(cache)  # half the reads find their chunks downloaded, half race the downloads
        jobs, outs = plan_windows(layouts, starts, 700, Limits())
        asyncio.run(cache.run(jobs, (len(starts), int(starts[0]), int(starts[-1])), store.remote))
        assert np.array_equal(outs["tokens"], np.stack([store.tokens[s : s + 700] for s in starts]))
    assert cache.stats()["cache_local_ranges"] > 0


def test_a_damaged_chunk_warns_is_deleted_and_read_remotely(
    store: Store, tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    first = store.cache(tmp_path / "c", max_bytes=4 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(first)
    first.plan(store.window(first, [i]) for i in [0, 1])
    settle(first)
    first.stop()
    victim = next(p for p in first.folder.iterdir() if p.name.startswith("c000000001."))
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    again = store.cache(tmp_path / "c", max_bytes=4 * CHUNK, chunk_bytes=CHUNK)  # another process
    stopped.append(again)
    assert np.array_equal(store.read(again, [0], planned=False), store.expected([0]))  # sound: used
    with pytest.warns(RuntimeWarning, match="damaged chunk.*nothing is lost"):
        assert np.array_equal(store.read(again, [1], planned=False), store.expected([1]))
    assert store.remote_ranges == 1 and not victim.exists()


@pytest.mark.parametrize("read_first", [False, True])
def test_a_chunk_damaged_in_place_after_it_was_downloaded_or_read_is_never_delivered(
    store: Store, tmp_path: Path, stopped: list[ChunkCache], read_first: bool
) -> None:
    """The same process downloaded the chunk (and with ``read_first`` read it from disk): a
    write over it in place, its modification time kept, is caught by the block check of the next
    read; the chunk is deleted and the range read remotely."""
    cache = store.cache(tmp_path / "c", max_bytes=4 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    cache.plan(store.window(cache, [i]) for i in [0, 1, 1])
    settle(cache)
    if read_first:
        assert np.array_equal(store.read(cache, [1]), store.expected([1]))
    victim = next(p for p in cache.folder.iterdir() if p.name.startswith("c000000001."))
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    with open(victim, "r+b") as fh:
        fh.write(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    remote = store.remote_ranges
    with pytest.warns(RuntimeWarning, match="damaged chunk.*nothing is lost"):
        assert np.array_equal(store.read(cache, [1], planned=False), store.expected([1]))
    assert store.remote_ranges == remote + 1
    # the damaged copy is gone (a download the plan still wants may have written it again, sound)
    assert not victim.exists() or victim.read_bytes() != bytes(data)


def test_an_object_that_does_not_match_its_manifest_checksum_is_not_cached_and_refused(
    tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    store = Store(tmp_path, chunks=2, shard_bytes=3000)  # objects smaller than a chunk: whole
    path = store.manifest.tokens.files[0].path
    damaged = bytearray(store.data[path])
    damaged[5] ^= 0xFF
    store.data[path] = bytes(damaged)  # what the store serves from now on
    cache = store.cache(tmp_path / "c", max_bytes=8 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    cache.plan(store.window(cache, [i]) for i in [0])
    settle(cache)
    assert 0 not in cache._local and not list(cache.folder.glob("c000000000.*"))
    assert 1 in cache._local, "the sound object beside it is cached"
    remote = store.remote_ranges
    for sample in (0, 1):  # the sound object's too: the dataset is refused, never read remotely
        with pytest.raises(DatasetIntegrityError, match=f"{path}.*does not match its checksum"):
            store.read(cache, [sample])
    assert store.remote_ranges == remote


def test_a_full_folder_warns_once_stops_downloading_and_reads_stay_exact(
    store: Store, tmp_path: Path, stopped: list[ChunkCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _chunk_folder._write
    calls = []

    def full(path: Path, data: memoryview) -> None:
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(_chunk_folder, "_write", full)
    monkeypatch.setattr(_chunk_download, "FETCHES_IN_FLIGHT", 1)
    cache = store.cache(tmp_path / "c", max_bytes=8 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    order = list(range(8))
    cache.plan(store.window(cache, [i]) for i in order)
    settle(cache)
    assert len(calls) == 2 and sorted(cache._local) == [0]
    assert not [p for p in cache.folder.iterdir() if ".tmp-" in p.name], "the failed write left nothing"
    with pytest.warns(RuntimeWarning, match="cannot write its chunk cache.*No space left.*nothing is lost"):
        got = [store.read(cache, [i]) for i in order]
    assert all(np.array_equal(g, store.expected([i])) for g, i in zip(got, order, strict=True))
    assert store.remote_ranges == 7


def test_a_read_only_folder_warns_and_reads_remotely(
    store: Store, tmp_path: Path, stopped: list[ChunkCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_only(path: Path, size: int) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(_chunk_folder, "_create", read_only)
    cache = store.cache(tmp_path / "c", max_bytes=8 * CHUNK, chunk_bytes=CHUNK)
    stopped.append(cache)
    cache.plan(store.window(cache, [i]) for i in [0, 1])
    settle(cache)
    with pytest.warns(RuntimeWarning, match="Read-only file system"):
        assert np.array_equal(store.read(cache, [0]), store.expected([0]))
    assert np.array_equal(store.read(cache, [1]), store.expected([1]))
    assert store.remote_ranges == 2 and not store.fetched


_HOLDER = """
import os, sys, time
import numpy as np
import guideloom
from guideloom.storage._cache._chunks import ChunkCache
from guideloom.storage._format._manifest import Manifest
folder = sys.argv[1]
manifest = guideloom.open_stream(folder).manifest
data = {f.path: open(os.path.join(folder, f.path), "rb").read() for f in manifest.tokens.files}
def fetch(path, start, end):
    print("fetching", flush=True)
    time.sleep(60)  # killed here, mid-download
    return data[path][start:end]
limit = int(sys.argv[3])
cache = ChunkCache(sys.argv[2], "s3://bucket/ds", manifest, fetch, max_bytes=limit, chunk_bytes=4096)
cache.plan([((1, 0, 0), np.asarray([0], dtype=np.int64))])
time.sleep(60)
"""


@pytest.mark.slow
def test_a_holder_killed_mid_download_leaves_nothing_complete_and_does_not_wedge_others(
    store: Store, tmp_path: Path, stopped: list[ChunkCache]
) -> None:
    root = tmp_path / "c"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "ds"), str(root), str(2 * CHUNK)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "fetching"
        cache = store.cache(root, max_bytes=2 * CHUNK, chunk_bytes=CHUNK)
        stopped.append(cache)
        names = [p.name for p in cache.folder.iterdir()]
        assert any(".tmp-" in n for n in names), "the holder reserved its chunk"
        assert not cache._local, "a chunk being downloaded does not look complete"
        # While the holder lives, this process reads remotely rather than waiting for it.
        assert np.array_equal(store.read(cache, [0], planned=False), store.expected([0]))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    cache.plan(store.window(cache, [i]) for i in [0, 1])
    settle(cache)
    assert sorted(cache._local) == [0, 1], "the lock died with the holder: this process downloads"
    assert not [p for p in cache.folder.iterdir() if ".tmp-" in p.name], "the dead download is gone"
    assert folder_bytes(cache.folder) <= 2 * CHUNK
    assert np.array_equal(store.read(cache, [0]), store.expected([0]))


_RANK = """
import os, sys, json
import numpy as np
import guideloom
from guideloom.storage._cache._chunks import ChunkCache
from guideloom.storage._remote._ranges import Layout, Limits, fill, plan_windows
import asyncio
folder, root, limit, order = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
manifest = guideloom.open_stream(folder).manifest
data = {f.path: open(os.path.join(folder, f.path), "rb").read() for f in manifest.tokens.files}
fetched = []
def fetch(path, start, end):
    fetched.append(start)
    return data[path][start:end]
async def remote(jobs):
    for job in jobs:
        fill(job, [data[job.path][s:e] for s, e in zip(job.starts, job.ends)])
layouts = {n: Layout.of(s) for n, s in manifest.fields.items()}
cache = ChunkCache(root, "s3://bucket/ds", manifest, fetch, max_bytes=limit, chunk_bytes=4096)
seq = 2048
cache.plan(((1, i * seq, i * seq), cache.table.of_rows(layouts, np.asarray([i * seq]), seq)) for i in order)
tokens = guideloom.open_stream(folder)
ok = True
for i in order:
    jobs, outs = plan_windows(layouts, np.asarray([i * seq], dtype=np.int64), seq, Limits())
    asyncio.run(cache.run(jobs, (1, i * seq, i * seq), remote))
    whole = np.frombuffer(data[manifest.tokens.files[0].path], np.uint16)
    ok &= bool(np.array_equal(outs["tokens"][0], whole[i * seq : (i + 1) * seq]))
cache.stop()
print(json.dumps({"ok": ok, "fetched": len(fetched)}))
"""


def test_processes_sharing_a_folder_stay_within_the_limit_and_read_exactly(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path, chunks=16)
    root = tmp_path / "c"
    limit = 6 * CHUNK
    rng = np.random.default_rng(5)
    orders = [rng.permutation(16).tolist() * 2 for _ in range(3)]
    probe = store.cache(root, max_bytes=limit, chunk_bytes=CHUNK)
    with Sampler(probe.folder) as sampler:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK, str(tmp_path / "ds"), str(root), str(limit), json.dumps(o)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for o in orders
        ]
        outs = [p.communicate(timeout=100)[0] for p in procs]
    results = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert all(r["ok"] for r in results), results
    assert sampler.peak <= limit, f"{sampler.peak} bytes on disk, the limit is {limit}"
    assert not [p for p in probe.folder.iterdir() if ".tmp-" in p.name]
    probe.stop()


def test_a_reservation_that_fails_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's room that cannot be reserved (EFBIG under RLIMIT_FSIZE, ENOSPC) leaves no
    temporary file behind: this process stops writing to the folder and would not sweep it."""

    def too_large(fd: int, size: int) -> None:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(os, "ftruncate", too_large)
    with pytest.raises(OSError, match="File too large"):
        _chunk_folder._create(tmp_path / "c0.tmp-1", 2 * CHUNK)
    assert list(tmp_path.iterdir()) == []


def test_caches_of_different_limits_keep_different_folders(tmp_path: Path, stopped: list[ChunkCache]) -> None:
    """Each process keeps its own limit on the folder it uses: processes that share a folder
    share its limit, so a cache of another limit (or chunk size) gets a folder of its own."""
    store = Store(tmp_path, chunks=16)
    root = tmp_path / "c"
    a, b, c, d = (
        store.cache(root, max_bytes=m, chunk_bytes=k)
        for m, k in ((6 * CHUNK, CHUNK), (6 * CHUNK, CHUNK), (12 * CHUNK, CHUNK), (12 * CHUNK, 2 * CHUNK))
    )
    stopped.extend((a, b, c, d))
    assert a.folder == b.folder
    assert len({a.folder, c.folder, d.folder}) == 3
