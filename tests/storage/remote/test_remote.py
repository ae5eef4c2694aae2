"""Object-store datasets against real servers on 127.0.0.1: moto (S3), nginx (HTTP), a fault proxy."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom
from guideloom import StatefulDataLoader
from guideloom._errors import DatasetFormatError, DatasetIntegrityError, RemoteReadError
from guideloom.storage._format._manifest import MANIFEST_NAME
from guideloom_dev.servers import SECRET_KEY, FaultProxy, MotoS3, Nginx
from tests.support import ROOT
from tests.support.loader import assert_same
from tests.support.remote import (
    BUCKET,
    Copies,
    all_batches,
    all_batches_async,
    loader_over,
    start_proxy,
    unique,
)
from tests.support.zygote import Zygote, imports_of

FAST = {"timeout": 5.0, "backoff": 0.01, "max_backoff": 0.05}


# -- identical batches ------------------------------------------------------------------------------
def test_local_s3_and_http_copies_give_identical_batches(
    stream_copies: Copies, s3: MotoS3, nginx: Nginx
) -> None:
    local = all_batches(guideloom.open_stream(stream_copies.local))
    from_s3 = all_batches(guideloom.open_stream(stream_copies.s3_url, **s3.options()))
    http = guideloom.open_stream(f"{nginx.url}/{stream_copies.http_path}")
    assert_same(local, from_s3)
    assert_same(local, all_batches(http))
    assert_same(local, all_batches(http, num_workers=2, prefetch=3))
    assert_same(local, asyncio.run(all_batches_async(http, prefetch=2)))
    assert set(local[0]) == {"tokens", "doc_id"}


@pytest.mark.asyncio
async def test_async_iteration_over_s3_matches_local(plain_copies: Copies, s3: MotoS3) -> None:
    local = all_batches(guideloom.open_stream(plain_copies.local), sequence_length=64)
    remote = await all_batches_async(
        guideloom.open_stream(plain_copies.s3_url, **s3.options()), sequence_length=64, prefetch=2
    )
    assert_same(local, remote)


def test_env_variables_configure_s3_and_explicit_options_override(
    plain_copies: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    from_env = guideloom.open_stream(plain_copies.s3_url)
    assert len(from_env) == len(plain_copies.tokens)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(OSError):
        guideloom.open_stream(plain_copies.s3_url, timeout=1.0, retries=0)
    explicit = guideloom.open_stream(plain_copies.s3_url, endpoint_url=s3.endpoint)
    assert explicit.manifest == from_env.manifest


def test_documents_from_s3_and_http(tmp_path: Path, s3: MotoS3, nginx: Nginx, www: Path) -> None:
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, int(n), dtype=np.int32) for n in rng.integers(0, 300, 120)]
    folder = tmp_path / "docs"
    guideloom.write_documents(folder, docs, shard_bytes=30_000)
    prefix = unique("docs")
    s3.upload_folder(folder, BUCKET, prefix)
    shutil.copytree(folder, www / prefix)
    direct = f"s3://{BUCKET}/{unique('docs-direct')}"
    guideloom.write_documents(direct, docs, shard_bytes=30_000, **s3.options())
    order = np.random.default_rng(1).permutation(len(docs)).astype(np.int64)

    async def read(storage: Any) -> list[np.ndarray]:
        async with storage:
            return list(await storage.read_many(order))

    for storage in (
        guideloom.open_documents(f"s3://{BUCKET}/{prefix}", **s3.options()),
        guideloom.open_documents(f"s3://{BUCKET}/{prefix}", offsets_cache_bytes=0, **s3.options()),
        guideloom.open_documents(f"{nginx.url}/{prefix}", offsets_cache_bytes=0),
        guideloom.open_documents(direct, **s3.options()),
    ):
        got = asyncio.run(read(storage))
        assert len(got) == len(order)
        for i, g in zip(order.tolist(), got, strict=True):
            assert g.dtype == np.int32 and np.array_equal(g, docs[i])


# -- writing ---------------------------------------------------------------------------------------
def test_write_to_s3_uploads_multipart_and_reads_back(s3: MotoS3) -> None:
    url = f"s3://{BUCKET}/{unique('big')}"
    data = (np.arange(11 * 2**20 + 123) % 251).astype(np.uint8)
    manifest = guideloom.write_stream(url, data, shard_bytes=64 * 2**20, part_size=5 * 2**20, **s3.options())
    (f,) = manifest.tokens.files
    head = s3.client().head_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/{f.path}")
    assert head["ContentLength"] == data.nbytes
    assert "-" in head["ETag"], "an object larger than one part goes up as a multipart upload"
    storage = guideloom.open_stream(url, **s3.options())
    starts = np.asarray([0, 5 * 2**20 - 10, len(data) - 1000], dtype=np.int64)

    async def read() -> Sequence[np.ndarray]:
        async with storage:
            return await storage.read_many(starts, 1000)

    for s, got in zip(starts.tolist(), asyncio.run(read()), strict=True):
        assert np.array_equal(got, data[s : s + 1000])


def test_verify_dataset_checks_remote_checksums(s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    prefix = unique("verify")
    url = f"s3://{BUCKET}/{prefix}"
    guideloom.write_stream(url, np.arange(5000, dtype=np.uint16), shard_bytes=4000)
    seen: list[int] = []
    guideloom.verify_dataset(url, progress=seen.append)
    assert sum(seen) == 10_000
    c = s3.client()
    key = next(
        o["Key"] for o in c.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"] if "tokens" in o["Key"]
    )
    body = bytearray(c.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[0] ^= 0xFF  # same size, different bytes
    c.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    with pytest.raises(DatasetIntegrityError, match="checksum"):
        guideloom.verify_dataset(url)


def test_overwrite_and_failed_write(s3: MotoS3) -> None:
    url = f"s3://{BUCKET}/{unique('over')}"
    opts = s3.options()
    guideloom.write_stream(url, np.arange(1000, dtype=np.uint16), **opts)
    with pytest.raises(FileExistsError):
        guideloom.write_stream(url, np.arange(10, dtype=np.uint16), **opts)

    def failing() -> Any:
        yield np.arange(100, dtype=np.uint16)
        raise RuntimeError("input broke")

    with pytest.raises(RuntimeError, match="input broke"):
        guideloom.write_stream(url, failing(), overwrite=True, **opts)
    assert len(guideloom.open_stream(url, **opts)) == 1000, "a failed overwrite leaves the old dataset"
    guideloom.write_stream(url, np.arange(10, dtype=np.uint16), overwrite=True, **opts)
    assert len(guideloom.open_stream(url, **opts)) == 10
    keys = [
        o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET, Prefix=url.split("/", 3)[3])["Contents"]
    ]
    assert len(keys) == 2, f"the replaced and the failed write's objects are deleted: {keys}"

    fresh = f"s3://{BUCKET}/{unique('failed')}"
    with pytest.raises(RuntimeError):
        guideloom.write_stream(fresh, failing(), **opts)
    with pytest.raises(FileNotFoundError):
        guideloom.open_stream(fresh, **opts)


def test_http_is_read_only(nginx: Nginx) -> None:
    with pytest.raises(ValueError, match="read-only"):
        guideloom.write_stream(f"{nginx.url}/new", np.arange(10, dtype=np.uint16))


# -- refusing what is not a dataset -----------------------------------------------------------------
def test_missing_dataset_is_file_not_found(s3: MotoS3, nginx: Nginx) -> None:
    with pytest.raises(FileNotFoundError, match="no dataset"):
        guideloom.open_stream(f"s3://{BUCKET}/does/not/exist", **s3.options())
    with pytest.raises(FileNotFoundError):
        guideloom.open_stream("s3://no-such-bucket/x", **s3.options())
    with pytest.raises(FileNotFoundError, match="no dataset"):
        guideloom.open_documents(f"{nginx.url}/does/not/exist")


def test_manifest_that_does_not_match_the_objects_is_refused(
    stream_copies: Copies, s3: MotoS3, nginx: Nginx, www: Path
) -> None:
    c = s3.client()
    files = sorted(p.name for p in stream_copies.local.iterdir() if p.name != "manifest.json")
    missing, short = unique("missing"), unique("short")
    s3.upload_folder(stream_copies.local, BUCKET, missing)
    c.delete_object(Bucket=BUCKET, Key=f"{missing}/{files[1]}")
    with pytest.raises(DatasetIntegrityError, match="missing"):
        guideloom.open_stream(f"s3://{BUCKET}/{missing}", **s3.options())
    s3.upload_folder(stream_copies.local, BUCKET, short)
    c.put_object(Bucket=BUCKET, Key=f"{short}/{files[0]}", Body=b"12")
    with pytest.raises(DatasetIntegrityError, match="has 2 bytes"):
        guideloom.open_stream(f"s3://{BUCKET}/{short}", **s3.options())
    with pytest.raises(DatasetFormatError, match="open_stream"):
        guideloom.open_documents(stream_copies.s3_url, **s3.options())
    web = unique("webshort")
    shutil.copytree(stream_copies.local, www / web)
    (www / web / files[0]).write_bytes(b"")
    with pytest.raises(DatasetIntegrityError):
        guideloom.open_stream(f"{nginx.url}/{web}")


def test_object_truncated_after_open_is_refused_not_a_short_sample(
    plain_copies: Copies, nginx: Nginx, www: Path
) -> None:
    web = unique("trunc")
    shutil.copytree(plain_copies.local, www / web)
    storage = guideloom.open_stream(f"{nginx.url}/{web}", retries=1, **FAST)
    shard = sorted((www / web).glob("tokens-*"))[0]
    size = shard.stat().st_size
    asyncio.run(storage.open())
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(DatasetIntegrityError, match=rf"{shard.name}.*changed on the object store"):
        asyncio.run(storage.read_many(np.asarray([(size - 60) // 2], dtype=np.int64), 50))
    asyncio.run(storage.close())


# -- faults ----------------------------------------------------------------------------------------
def test_one_request_in_five_failing_still_delivers_every_batch_in_order(
    plain_copies: Copies, legacy_copies: Copies, nginx: Nginx, proxy_for: list[FaultProxy]
) -> None:
    proxy = start_proxy(proxy_for, nginx.port)
    local = all_batches(guideloom.open_stream(plain_copies.local), sequence_length=64, local_batch_size=8)
    storage = guideloom.open_stream(
        f"{proxy.url}/{legacy_copies.http_path}",
        coalesce_gap=0,
        max_request_bytes=128,  # one request per 128-byte sample, as windows are now 64 MiB
        retries=10,
        max_inflight_requests=16,
        **FAST,
    )
    proxy.fail_every = 5
    got = all_batches(storage, sequence_length=64, local_batch_size=8, prefetch=2)
    assert_same(local, got)
    assert proxy.stats.requests >= 300
    assert set(proxy.stats.faults_by_kind) == {"reset", "truncate", "503"}
    assert proxy.stats.faults >= proxy.stats.requests // 5 - 1


@pytest.mark.asyncio
async def test_faults_on_s3_async(
    plain_copies: Copies, legacy_copies: Copies, s3: MotoS3, proxy_for: list[FaultProxy]
) -> None:
    proxy = start_proxy(proxy_for, s3.port)
    local = all_batches(guideloom.open_stream(plain_copies.local), sequence_length=400)
    storage = guideloom.open_stream(
        legacy_copies.s3_url,
        retries=10,
        coalesce_gap=0,
        max_request_bytes=800,  # one request per 800-byte sample, as windows are now 64 MiB
        **FAST,
        **s3.options(proxy.url),
    )
    proxy.fail_every = 5
    got = await all_batches_async(storage, sequence_length=400)
    assert_same(local, got)
    assert proxy.stats.faults >= 5


def test_a_server_that_stops_answering_fails_within_the_timeout(
    plain_copies: Copies, nginx: Nginx, proxy_for: list[FaultProxy]
) -> None:
    proxy = start_proxy(proxy_for, nginx.port)
    storage = guideloom.open_stream(
        f"{proxy.url}/{plain_copies.http_path}", timeout=0.5, retries=1, retry_timeout=3.0, backoff=0.05
    )
    loader = loader_over(storage, sequence_length=64)
    loader.open()
    proxy.stall = True
    proxy.reset_all()  # pooled connections go; new ones get no answer
    t0 = time.monotonic()
    with pytest.raises(RemoteReadError) as info:
        for _ in loader:
            pass
    elapsed = time.monotonic() - t0
    loader.close()
    assert elapsed < 8.0, f"took {elapsed:.1f}s"
    deadline = time.monotonic() + 5
    while any(t.name.startswith("guideloom-loop") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the loader's thread outlived close()"
        time.sleep(0.02)
    msg = str(info.value)
    assert f"{proxy.url}/{plain_copies.http_path}/tokens-" in msg and "bytes " in msg and "attempts" in msg


def test_credentials_never_appear_in_errors_logs_or_repr(
    plain_copies: Copies,
    s3: MotoS3,
    proxy_for: list[FaultProxy],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    env_secret = "env-secret-b7e2f0c4d1"
    monkeypatch.setenv("AWS_SESSION_TOKEN", env_secret)
    proxy = start_proxy(proxy_for, s3.port)
    storage = guideloom.open_stream(plain_copies.s3_url, retries=1, **FAST, **s3.options(proxy.url))
    texts = [repr(storage), str(storage), repr(loader_over(storage))]
    loader = loader_over(storage, sequence_length=64)
    loader.open()
    proxy.fail_every = 1
    proxy.fault_kinds = ("503",)
    with pytest.raises(RemoteReadError) as info:
        list(loader)
    loader.close()
    texts.append("".join(traceback.format_exception(info.value)))
    with pytest.raises(OSError) as info2:
        guideloom.open_stream(
            f"s3://{BUCKET}/x", timeout=0.5, retries=0, **{**s3.options(), "endpoint": "http://127.0.0.1:9"}
        )
    texts.append("".join(traceback.format_exception(info2.value)))
    texts.append(caplog.text)
    for text in texts:
        assert SECRET_KEY not in text and env_secret not in text
    assert "503" in texts[3] and "s3://" in texts[3]


# -- the event loop and the checkpoint ---------------------------------------------------------------
@pytest.mark.asyncio
async def test_async_for_over_s3_leaves_the_event_loop_responsive(
    plain_copies: Copies, s3: MotoS3, proxy_for: list[FaultProxy]
) -> None:
    proxy = start_proxy(proxy_for, s3.port, delay=0.05)
    storage = guideloom.open_stream(  # one request per 400-byte sample: a load that lasts a while
        plain_copies.s3_url, coalesce_gap=0, max_request_bytes=400, **s3.options(proxy.url)
    )
    from tests.support.loader import loop_gaps

    async with loop_gaps() as gaps:
        batches = await all_batches_async(storage, sequence_length=200, local_batch_size=2)
    assert len(batches) == len(plain_copies.tokens) // 200 // 2
    # Requests overlap (a 50 ms proxy delay each): the load lasts ~0.25 s, about 50 ticks of 5 ms.
    assert len(gaps) >= 10, f"only {len(gaps)} ticks: the load was too short to tell"
    assert max(gaps) < 0.25, f"the loop stalled for {max(gaps):.3f}s"


@pytest.mark.asyncio
async def test_a_large_read_is_planned_and_copied_off_the_event_loop(
    plain_copies: Copies, s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    import guideloom.storage._remote._fetch as fetch
    import guideloom.storage._remote._shared as shared
    import guideloom.storage._remote._storage as remote

    where: dict[str, set[int]] = {"plan": set(), "copy": set()}

    def spy(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            where[name].add(threading.get_ident())
            return fn(*args)

        return call

    monkeypatch.setattr(remote, "plan_windows", spy("plan", remote.plan_windows))
    monkeypatch.setattr(fetch, "fill_range", spy("copy", fetch.fill_range))
    storage = guideloom.open_stream(plain_copies.s3_url, **s3.options())
    await storage.open()
    try:
        n = len(plain_copies.tokens) // 100
        starts = np.arange(0, n * 100, 100, dtype=np.int64)[: shared.PLAN_INLINE_SAMPLES * 2]
        got = await storage.read_many(starts, 100)
    finally:
        await storage.close()
    assert np.array_equal(np.asarray(got), plain_copies.tokens[starts[:, None] + np.arange(100)])
    loop_thread = threading.get_ident()
    assert where["plan"] and loop_thread not in where["plan"], "planned on the event loop"
    assert where["copy"] and loop_thread not in where["copy"], "fetched bytes copied on the event loop"


def test_state_dict_counts_only_delivered_batches(plain_copies: Copies, nginx: Nginx) -> None:
    url = f"{nginx.url}/{plain_copies.http_path}"
    full = all_batches(guideloom.open_stream(url), sequence_length=64)
    loader = loader_over(guideloom.open_stream(url), sequence_length=64, prefetch=4)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    time.sleep(0.2)  # let read-ahead run far ahead of the consumer
    state = loader.state_dict()
    it.close()
    loader.close()
    assert state["observation_offset"] == 3 * 4
    resumed = loader_over(guideloom.open_stream(url), sequence_length=64)
    resumed.load_state_dict(state)
    rest = all_batches_resumed(resumed)
    assert_same(full, first + rest)


def all_batches_resumed(loader: StatefulDataLoader[Any, Any]) -> list[Any]:
    with loader:
        return list(loader)


# -- read-ahead mechanics ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def legacy_copies(plain_copies: Copies, s3: MotoS3, www: Path) -> Copies:
    """``plain_copies`` as a dataset written without block digests: its reads are cut at
    ``max_request_bytes`` exactly, not widened to whole blocks (many small requests)."""
    name = f"{plain_copies.http_path}-no-blocks"
    shutil.copytree(plain_copies.local, www / name, dirs_exist_ok=True)  # again if set up twice
    doc = json.loads((www / name / MANIFEST_NAME).read_text())
    for f in doc["fields"]["tokens"]["files"]:
        del f["blocks"]
    (www / name / MANIFEST_NAME).write_text(json.dumps(doc))
    s3.upload_folder(www / name, BUCKET, f"copies/{name}")
    return Copies(www / name, f"s3://{BUCKET}/copies/{name}", name, plain_copies.tokens)


def _read_all(storage: Any, starts: np.ndarray, length: int) -> Sequence[np.ndarray]:
    async def read() -> Sequence[np.ndarray]:
        async with storage:
            return await storage.read_many(starts, length)

    return asyncio.run(read())


def test_ranges_are_coalesced_and_inflight_bytes_bounded(
    plain_copies: Copies, legacy_copies: Copies, nginx: Nginx
) -> None:
    starts = np.arange(0, 30_000, 100, dtype=np.int64)  # 300 adjacent samples of 200 bytes
    merged = guideloom.open_stream(f"{nginx.url}/{plain_copies.http_path}")
    got = _read_all(merged, starts, 100)
    assert merged.stats()["requests"] <= 3, "adjacent samples in a shard are one request"
    # A dataset written without block digests: requests are cut at max_request_bytes exactly.
    apart = guideloom.open_stream(
        f"{nginx.url}/{legacy_copies.http_path}",
        coalesce_gap=0,
        max_request_bytes=1000,
        max_inflight_bytes=4000,
    )
    got2 = _read_all(apart, starts, 100)
    stats = apart.stats()
    assert stats["requests"] >= 60 and 1000 <= stats["peak_inflight_bytes"] <= 4000 + 1000
    for s, a, b in zip(starts.tolist(), got, got2, strict=True):
        assert np.array_equal(a, plain_copies.tokens[s : s + 100]) and np.array_equal(a, b)


def test_each_block_is_fetched_once_whatever_the_request_cap(plain_copies: Copies, nginx: Nginx) -> None:
    """Every fetched byte is checked against its block's digest, so a range is widened to whole
    blocks: pieces that share a block share its one request, even when the block is larger than
    ``max_request_bytes``."""
    starts = np.arange(0, 30_000, 100, dtype=np.int64)  # 200-byte samples in two 32,000-byte shards
    storage = guideloom.open_stream(
        f"{nginx.url}/{plain_copies.http_path}",
        coalesce_gap=0,
        max_request_bytes=1000,
        max_inflight_bytes=4000,
    )
    got = _read_all(storage, starts, 100)
    stats = storage.stats()
    assert (stats["requests"], stats["bytes_read"]) == (2, 64_000), stats
    assert stats["peak_inflight_bytes"] <= 32_000, "a block is admitted alone when it passes the budget"
    for s, a in zip(starts.tolist(), got, strict=True):
        assert np.array_equal(a, plain_copies.tokens[s : s + 100])


def test_options_are_checked(plain_copies: Copies, s3: MotoS3, nginx: Nginx) -> None:
    with pytest.raises(TypeError, match="unknown option"):
        guideloom.open_stream(plain_copies.s3_url, no_such_option=1, **s3.options())
    with pytest.raises(ValueError, match="max_inflight_requests"):
        guideloom.open_stream(plain_copies.s3_url, max_inflight_requests=0, **s3.options())
    with pytest.raises(TypeError, match="writing"):
        guideloom.open_stream(plain_copies.s3_url, part_size=2**23, **s3.options())
    with pytest.raises(TypeError):
        guideloom.open_stream(f"{nginx.url}/{plain_copies.http_path}", region="x")
    storage = guideloom.open_stream(f"{nginx.url}/{plain_copies.http_path}", max_concurrent_reads=3)
    assert storage.max_concurrent_reads == 3


def test_azure_urls_are_understood_without_a_server() -> None:
    from guideloom.storage._remote._locations import parse_location
    from guideloom.storage._remote._objstore import make_store
    from guideloom.storage._remote._options import RetryPolicy

    loc = parse_location("az://container/some/prefix?sig=SECRETSAS")
    assert (loc.kind, loc.bucket, loc.prefix) == ("azure", "container", "some/prefix")
    assert loc.display == "az://container/some/prefix"
    make_store(
        loc,
        {"account_name": "devstoreaccount1", "use_emulator": True},
        {},
        RetryPolicy(),
        obstore_retries=False,
    )
    if shutil.which("azurite") is None:
        pytest.skip("azurite is not installed: az:// is not tested against a server here")


# -- clean exit ------------------------------------------------------------------------------------
EXIT_SCRIPT = ROOT / "tests" / "support" / "exit_script.py"


@pytest.mark.slow
def test_processes_that_read_s3_asynchronously_always_exit_cleanly(
    plain_copies: Copies, s3: MotoS3, proxy_for: list[FaultProxy], tmp_path: Path
) -> None:
    """Each run is a process of its own that the interpreter ends as ``python exit_script.py``
    would (forked from a zygote that imported its modules once: ``tests/support/zygote.py``; one
    BLAS thread, so that the zygote has a single thread to fork)."""
    import concurrent.futures
    import subprocess

    proxy = start_proxy(proxy_for, s3.port, delay=0.005)
    env = {"OMP_NUM_THREADS": "1", **os.environ, **s3.env(proxy.url), "PYTHONFAULTHANDLER": "1"}
    modes = ["read"] * 12 + ["noclose"] * 10 + ["inflight"] * 10 + ["loader"] * 3

    def run(job: tuple[int, str]) -> tuple[str, int, str]:
        i, mode = job
        log = tmp_path / f"run-{i}-{mode}.log"
        child = zygote.start([str(EXIT_SCRIPT), plain_copies.s3_url, mode], log)
        try:
            code = child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            code = child.wait()
            with log.open("a") as f:
                f.write("\n(no exit in 60 s: killed)")
        return mode, code, log.read_text()[-2000:]

    with (
        Zygote(tmp_path / "zygote.log", imports_of(EXIT_SCRIPT), cwd=ROOT, env=env) as zygote,
        concurrent.futures.ThreadPoolExecutor(3) as pool,
    ):
        results = list(pool.map(run, enumerate(modes)))
    bad = [r for r in results if r[1] != 0]
    assert not bad, f"{len(bad)} of {len(results)} runs did not exit with 0: {bad[:3]}"
