"""Session-wide servers for the object-store tests (all on 127.0.0.1, all stopped at the end)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import guideloom
from guideloom_dev.servers import FaultProxy, MotoS3, Nginx, nginx_binary
from tests.support.remote import BUCKET, Copies


@pytest.fixture(scope="session")
def s3() -> Iterator[MotoS3]:
    server = MotoS3()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def www(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("www")


@pytest.fixture(scope="session")
def nginx(www: Path) -> Iterator[Nginx]:
    if nginx_binary() is None:
        pytest.skip("nginx is not installed here (CI installs it with .ci/install-servers.sh)")
    server = Nginx(www)
    yield server
    server.stop()


@pytest.fixture
def proxy_for() -> Iterator[list[FaultProxy]]:
    """Start proxies with ``proxy_for[0]`` ... ; every one started is stopped after the test."""
    started: list[FaultProxy] = []
    yield started
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def stream_copies(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3, www: Path) -> Copies:
    """A small stream with a metadata field, in several shards, copied to S3 and the web root."""
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, 50_000, 24_000, dtype=np.uint16)
    meta = (np.arange(24_000) % 11).astype(np.uint8)
    folder = tmp_path_factory.mktemp("local") / "stream"
    guideloom.write_stream(folder, tokens, metadata={"doc_id": meta}, shard_bytes=20_000)
    s3.upload_folder(folder, BUCKET, "copies/stream")
    shutil.copytree(folder, www / "stream")
    return Copies(folder, f"s3://{BUCKET}/copies/stream", "stream", tokens, meta)


@pytest.fixture(scope="session")
def plain_copies(tmp_path_factory: pytest.TempPathFactory, s3: MotoS3, www: Path) -> Copies:
    """A plain uint16 stream (no metadata), copied to S3 and the web root."""
    rng = np.random.default_rng(99)
    tokens = rng.integers(0, 65_000, 40_000, dtype=np.uint16)
    folder = tmp_path_factory.mktemp("local") / "plain"
    guideloom.write_stream(folder, tokens, shard_bytes=32_000)
    s3.upload_folder(folder, BUCKET, "copies/plain")
    shutil.copytree(folder, www / "plain")
    return Copies(folder, f"s3://{BUCKET}/copies/plain", "plain", tokens)
