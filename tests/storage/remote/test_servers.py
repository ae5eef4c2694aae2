"""The S3 server the tests start is the one they talk to: a port another process listens on by
the time moto would bind it is given up for another."""

from __future__ import annotations

import socket
import threading

import pytest

from guideloom_dev import servers
from guideloom_dev.servers import LOOPBACK, MotoS3


def test_moto_moves_to_another_port_when_something_else_answers_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    squatter = socket.socket()
    squatter.bind((LOOPBACK, 0))
    squatter.listen()
    taken = squatter.getsockname()[1]

    def reset_each() -> None:  # accepts, then resets: what a test saw in place of moto
        while True:
            try:
                conn, _ = squatter.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()

    threading.Thread(target=reset_each, daemon=True).start()
    ports = iter([taken])
    real = servers.free_port
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real())
    s3 = MotoS3()
    try:
        assert s3.port != taken
        s3.create_bucket("guideloom-ports")
        assert "guideloom-ports" in [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    finally:
        s3.stop()
        squatter.close()
