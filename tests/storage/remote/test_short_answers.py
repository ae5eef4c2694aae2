"""A server that answers a range request with fewer bytes than asked for: a failed request.

The answers come from a small threaded HTTP server in the test, on 127.0.0.1: a body shorter
than the range asked for under headers that agree with it (obstore's multi-range call panicked
on one), or a well-formed answer for a shorter range. Either is retried as other transient
failures are, then refused with a :class:`RemoteReadError` naming the object and the range; no
byte of it is delivered.
"""

from __future__ import annotations

import hashlib
import http.server
import re
import threading
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom import StatefulDataLoader
from guideloom._errors import RemoteReadError
from tests.support.loader import assert_same
from tests.support.remote import collate

CPU = torch.device("cpu")
SAMPLE = 384 * 1024  # tokens: a 768 KiB sample, cut into requests of max_request_bytes
KW: dict[str, Any] = dict(sequence_length=SAMPLE, local_batch_size=2, shuffle=False, prefetch=2)
FAST = {"timeout": 5.0, "backoff": 0.01, "max_backoff": 0.05, "retries": 2}


class ShortServer:
    """Serves a folder over HTTP/1.1 with ranges; ``mode`` says how range answers fall short:
    ``"body"`` (a shorter body, its Content-Length agreeing, Content-Range the range asked for),
    ``"range"`` (a well-formed answer for the first half of the range), ``"none"`` (whole)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mode = "none"
        self.short_left = -1  # how many range answers fall short (-1: all of them)
        self.ranges: list[tuple[str, int, int]] = []
        self.short: list[tuple[str, int, int]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _file(self) -> Path | None:
                path = (server.root / self.path.lstrip("/")).resolve()
                if not path.is_relative_to(server.root.resolve()) or not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                return path

            def _headers(self, path: Path) -> None:
                st = path.stat()
                tag = hashlib.sha1(f"{st.st_mtime_ns}-{st.st_size}".encode()).hexdigest()[:16]
                self.send_header("ETag", f'"{tag}"')
                self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
                self.send_header("Accept-Ranges", "bytes")

            def do_HEAD(self) -> None:
                path = self._file()
                if path is not None:
                    self.send_response(200)
                    self._headers(path)
                    self.send_header("Content-Length", str(path.stat().st_size))
                    self.end_headers()

            def do_GET(self) -> None:
                path = self._file()
                if path is None:
                    return
                data = path.read_bytes()
                m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
                if m is None:
                    self.send_response(200)
                    self._headers(path)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                start, end = int(m.group(1)), min(int(m.group(2)) + 1, len(data))
                name = path.name
                server.ranges.append((name, start, end))
                body, shown = data[start:end], end
                short = server.mode != "none" and server.short_left != 0
                if short:
                    server.short_left -= 1
                    server.short.append((name, start, end))
                    if server.mode == "body":
                        body = body[: len(body) // 2]
                    else:
                        shown = start + (end - start) // 2
                        body = data[start:shown]
                self.send_response(206)
                self._headers(path)
                self.send_header("Content-Range", f"bytes {start}-{shown - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="test-short-server")
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ShortServer, Path]]:
    folder = tmp_path / "ds"
    tokens = np.random.default_rng(8).integers(0, 60_000, 8 * SAMPLE, dtype=np.uint16)
    guideloom.write_stream(folder, tokens)  # one object of 6 MiB
    server = ShortServer(tmp_path)
    yield server, folder
    server.stop()


def loader(url: str, **options: Any) -> StatefulDataLoader[Any, Any]:
    storage = guideloom.open_stream(url, **{"max_request_bytes": 256 * 1024, **FAST, **options})
    return StatefulDataLoader.from_storage(storage, collate, device=CPU, **KW)


@pytest.mark.parametrize("mode", ["body", "range"])
@pytest.mark.parametrize("request_kib", [256, 1024])
def test_a_short_answer_is_retried_then_refused_naming_the_object_and_range(
    served: tuple[ShortServer, Path], mode: str, request_kib: int
) -> None:
    server, folder = served
    server.mode = mode
    shard = next(p.name for p in folder.iterdir() if p.suffix == ".bin")
    with (
        pytest.raises(RemoteReadError, match=rf"{shard} bytes \d+-\d+ failed after 3 attempts") as err,
        loader(f"{server.url}/ds", max_request_bytes=request_kib * 1024) as it,
    ):
        for _ in it:
            pytest.fail("a batch was delivered from short answers")
    m = re.search(r"bytes (\d+)-(\d+)", str(err.value))
    assert m is not None
    failed = (shard, int(m.group(1)), int(m.group(2)) + 1)
    assert server.short.count(failed) == 3, "the request was retried (2 retries) before it failed"


@pytest.mark.parametrize("mode", ["body", "range"])
def test_short_answers_that_a_retry_mends_deliver_every_batch(
    served: tuple[ShortServer, Path], mode: str
) -> None:
    server, folder = served
    with StatefulDataLoader.from_storage(guideloom.open_stream(folder), collate, device=CPU, **KW) as it:
        expected = list(it)
    server.mode = mode
    server.short_left = 3
    with loader(f"{server.url}/ds") as it:
        got = list(it)
    assert_same(expected, got)
    assert len(server.short) == 3
