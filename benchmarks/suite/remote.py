"""The HTTP part: nginx on 127.0.0.1 (``guideloom_dev/servers.py``), optionally behind the loopback
latency proxy (10 ms each way, 20 ms round trip), as an object store across a region has.

guideloom reads ``http://127.0.0.1:PORT/bucket/gl`` (its stream dataset). MosaicML Streaming and
LitData have no plain-HTTP source, so they read the same nginx as an S3 endpoint with path-style
addressing (``s3://bucket/mds``, ``s3://bucket/litdata``): their GETs and ranged GETs are ordinary
HTTP requests, which nginx answers from the same files. The ceiling is the bare concurrent
range-read loop of ``benchmarks/remote_stream.py`` (obstore ``get_range_async`` / ``get_ranges_async``
under a semaphore), run at several concurrencies.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .data import BATCH, Data

ROOT = Path(__file__).resolve().parents[2]


MOTO_SHARD_BYTES = 32 * 2**20  # LitData's chunk size here: moto copies a whole object per GET


def gl_small_shards(d: Data) -> Path:
    """The suite's stream rewritten with 32 MiB shards (LitData's chunk size), for moto."""
    import numpy as np

    import guideloom as gl

    path = d.suite / "gl32"
    if not (path / "manifest.json").exists():
        print(f"  writing the stream with 32 MiB shards to {path}", flush=True)
        rows = np.memmap(d.raw, dtype=np.uint16, mode="r")
        chunk = 8 * 2**20
        gl.write_stream(
            path,
            (np.asarray(rows[i : i + chunk]) for i in range(0, len(rows), chunk)),
            dtype=np.uint16,
            shard_bytes=MOTO_SHARD_BYTES,
            overwrite=True,
        )
    return path


@contextlib.contextmanager
def moto_server(d: Data, peers: list[str]) -> Iterator[str | None]:
    """moto's S3 server in its own process with bucket ``bucket`` holding ``gl`` (32 MiB shards)
    and ``litdata`` (moto holds its objects in memory: Streaming's copy is left out); yields its
    endpoint. ``peers`` without LitData: moto is not started."""
    import subprocess

    import boto3

    if "litdata" not in peers:
        yield None
        return
    sys.path.insert(0, str(ROOT))
    from guideloom_dev.servers import free_port, wait_for_port

    binary = os.environ.get("GUIDELOOM_MOTO_SERVER") or shutil.which("moto_server")
    if binary is None:
        binary = str(ROOT / ".venv" / "bin" / "moto_server")  # the project's own venv has moto
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_port(port, timeout=30)
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="bucket")
        folders = {"gl": gl_small_shards(d), "litdata": d.litdata}
        for prefix, folder in folders.items():
            for f in sorted(folder.rglob("*")):
                if f.is_file():
                    client.upload_file(str(f), "bucket", f"{prefix}/{f.relative_to(folder).as_posix()}")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def servers(d: Data, rtts: tuple[float, ...]) -> Iterator[dict[float, str]]:
    """nginx over ``d.suite``; yields {round trip added: base url} (0.0 is nginx itself)."""
    sys.path.insert(0, str(ROOT))
    from guideloom_dev.servers import Nginx, nginx_binary, proxy_process

    if nginx_binary() is None:
        raise RuntimeError("nginx is not installed (.ci/install-servers.sh)")
    link = d.suite / "bucket" / "gl"
    if not link.exists():
        os.symlink(d.gl, link)
    nginx = Nginx(d.suite)
    try:
        with contextlib.ExitStack() as stack:
            urls = {}
            for rtt in rtts:
                if rtt == 0:
                    urls[rtt] = nginx.url
                else:
                    port = stack.enter_context(proxy_process(nginx.port, delay=rtt / 2, lifetime=1800))
                    urls[rtt] = f"http://127.0.0.1:{port}"
            yield urls
    finally:
        nginx.stop()


def peer_spec(peer: str, base: str, cache: str) -> dict[str, Any]:
    """What a remote run of ``peer`` needs on top of the local spec."""
    env = {
        "S3_ENDPOINT_URL": base,  # MosaicML Streaming
        "AWS_ENDPOINT_URL": base,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    return {
        "env": env,
        "gl": f"{base}/bucket/gl",
        "url": f"{base}/bucket/gl",
        "remote_mds": "s3://bucket/mds",
        "remote_litdata": "s3://bucket/litdata",
        "storage_options": {
            "endpoint_url": base,
            "aws_access_key_id": "bench",
            "aws_secret_access_key": "bench",
            "region_name": "us-east-1",
        },
        "cache": tempfile.mkdtemp(prefix=f"guideloom-bench-{peer}-cache-"),
    }


def measure_remote(spec: dict[str, Any]) -> dict[str, Any]:
    """``remote-ceiling``: the bare concurrent range-read loop, no loader."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.remote_stream import child_ceiling

    samples = spec["batches"] * BATCH
    res = child_ceiling(spec["url"], samples, spec["num_samples"], spec["concurrency"], spec["per_call"])
    res["tokens_per_s"] = res["samples_per_s"] * 2048
    res["cpu_s_per_1k"] = res.pop("cpu_ms_per_1k") * BATCH / 1000  # ms/1k samples -> s/1k batches
    return res
