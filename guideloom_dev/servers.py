"""Real servers on 127.0.0.1 for the object-store tests: moto (S3), nginx (HTTP), a fault proxy.

Everything binds to the loopback interface only, and everything stops itself: the proxy after a
hard lifetime, nginx and moto when their fixture ends (and both are killed with their process
groups if the test process dies). Run as a script, this module starts a proxy in its own process (the
benchmark does that, so the proxy does not compete with the loader for the GIL)::

    python -m guideloom_dev.servers proxy --upstream 127.0.0.1:8080 --delay 0.01 --lifetime 600
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
ACCESS_KEY = "guideloom-test-key"
SECRET_KEY = "guideloom-test-secret-5f3a9c"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {LOOPBACK}:{port} after {timeout}s") from None
            time.sleep(0.01)


# -- S3: moto ---------------------------------------------------------------------------------------
class MotoS3:
    """moto's S3 server on 127.0.0.1 in its own process (so its request handling does not share
    the test process's GIL with the loader), with boto3 for test set-up (creating buckets)."""

    #: Ports tried before giving up: the port is free when chosen, not when moto binds it (another
    #: process of the suite may take it in between), so a server that does not answer as moto is
    #: stopped and another port tried.
    TRIES = 3

    def __init__(self) -> None:
        server = Path(__file__).with_name("moto_server.py")  # moto.server, its Host lookup read once
        for attempt in range(1, self.TRIES + 1):
            self.port = free_port()
            self.endpoint = f"http://{LOOPBACK}:{self.port}"
            self._proc = _start_process(
                [sys.executable, str(server), "-H", LOOPBACK, "-p", str(self.port)],
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_for_port(self.port, timeout=30)
                self._check_answers()
                return
            except (TimeoutError, OSError):
                self.stop()
                if attempt == self.TRIES:
                    raise

    def _check_answers(self) -> None:
        """Raise ``OSError`` unless the process started answers on the port as moto does (a
        bucket listing), rather than something else that listens there or nothing at all."""
        import urllib.request

        with urllib.request.urlopen(self.endpoint + "/", timeout=10) as reply:
            body = reply.read()
        if self._proc.poll() is not None or b"ListAllMyBucketsResult" not in body:
            raise OSError(f"{self.endpoint} does not answer as the moto server started for it")

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def options(self, endpoint: str | None = None) -> dict[str, Any]:
        """Explicit ``open_stream`` options for this server (or for a proxy in front of it)."""
        return {
            "endpoint": endpoint or self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
            "allow_http": True,
        }

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The standard AWS environment variables for this server."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def upload_folder(self, folder: Path, bucket: str, prefix: str) -> None:
        """Copy a dataset folder to ``s3://bucket/prefix`` with boto3 (any copy tool will do)."""
        c = self.client()
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                c.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")

    def stop(self) -> None:
        _stop_process(self._proc)


# -- HTTP: nginx ------------------------------------------------------------------------------------
def nginx_binary() -> str | None:
    path = (
        os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(["/usr/sbin", "/sbin", "/usr/local/sbin"])
    )
    return shutil.which("nginx", path=path)


_NGINX_CONF = """\
{user}
worker_processes 1;
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    default_type application/octet-stream;
    server {{
        listen {host}:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the test process dies (Linux), never linger."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start_process(argv: list[str], *, stderr: int) -> subprocess.Popen[bytes]:
    """A server in its own session, which dies with the test process."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl(), before exec
    )


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
    if proc.stderr is not None:
        proc.stderr.close()


class Nginx:
    """nginx serving ``root`` on 127.0.0.1 (it honours ``Range``, unlike ``http.server``)."""

    def __init__(self, root: Path) -> None:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (run .ci/install-servers.sh)")
        self.root = root
        self._tmp = tempfile.mkdtemp(prefix="guideloom-nginx-")
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        user = ""
        if os.geteuid() == 0:  # workers would run as "nobody" and could not read a private tmp dir
            user = f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};"
        conf = Path(self._tmp) / "nginx.conf"
        conf.write_text(
            _NGINX_CONF.format(user=user, tmp=self._tmp, host=LOOPBACK, port=self.port, root=root)
        )
        self._proc = _start_process(
            [binary, "-c", str(conf), "-p", self._tmp, "-e", f"{self._tmp}/error.log"],
            stderr=subprocess.PIPE,
        )
        try:
            wait_for_port(self.port, timeout=10)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        _stop_process(self._proc)
        shutil.rmtree(self._tmp, ignore_errors=True)


# -- the fault proxy --------------------------------------------------------------------------------
_REQUEST_STARTS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ", b"OPTIONS ", b"PROPFIND ")
_503 = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 0\r\nConnection: close\r\n\r\n"


@dataclass
class ProxyStats:
    connections: int = 0
    requests: int = 0
    faults: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)


class FaultProxy:
    """A loopback TCP proxy that adds latency and injects faults on command.

    - ``delay``: seconds added in *each* direction (a round trip costs ``2 * delay`` more);
      data is pipelined, so the delay adds latency without limiting bandwidth.
    - ``fail_every = n``: every n-th HTTP request (counted across connections) fails, cycling
      through ``fault_kinds``: ``"reset"`` (the connection is reset before the request reaches
      the server), ``"truncate"`` (half of the response arrives, then a reset), ``"503"`` (the
      proxy answers 503 itself).
    - ``stall = True``: accept and read, but forward nothing (a server that stops answering).
    - the proxy closes everything after ``lifetime`` seconds, whatever happens.

    It runs its own event loop on a daemon thread (``start()``), or in the foreground
    (``serve_forever()``, used when run as a script).
    """

    def __init__(
        self, upstream_port: int, *, delay: float = 0.0, lifetime: float = 300.0, port: int = 0
    ) -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self.lifetime = lifetime
        self.fail_every = 0
        self.fault_kinds: tuple[str, ...] = ("reset", "truncate", "503")
        self.stall = False
        self.stats = ProxyStats()
        self._want_port = port
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # -- control ---------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run_thread, name="test-fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("the proxy did not start")
        return self

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def reset_all(self) -> None:
        """Reset every open connection now."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._reset_all)

    def _reset_all(self) -> None:
        for w in list(self._writers):
            _hard_close(w)

    def _next_fault(self) -> str | None:
        with self._lock:
            self.stats.requests += 1
            if self.fail_every and self.stats.requests % self.fail_every == 0:
                kind = self.fault_kinds[self.stats.faults % len(self.fault_kinds)]
                self.stats.faults += 1
                self.stats.faults_by_kind[kind] = self.stats.faults_by_kind.get(kind, 0) + 1
                return kind
        return None

    # -- the server ------------------------------------------------------------------------------
    def _run_thread(self) -> None:
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            for _ in range(5):  # whatever still runs is cancelled and awaited before the loop closes
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                if not pending:
                    break
                for t in pending:
                    t.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def serve_forever(self, port_file: str | None = None) -> None:
        def announce() -> None:
            if port_file:
                tmp = f"{port_file}.tmp"
                Path(tmp).write_text(str(self.port))
                os.replace(tmp, port_file)

        self._announce = announce
        self._run_thread()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, LOOPBACK, self._want_port, backlog=1024)
        self.port = int(server.sockets[0].getsockname()[1])
        self._ready.set()
        announce = getattr(self, "_announce", None)
        if announce is not None:
            announce()
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=self.lifetime)
        except TimeoutError:
            pass
        server.close()
        self._reset_all()
        handlers = [t for t in self._handlers if not t.done()]
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            await self._proxy(creader, cwriter)
        except asyncio.CancelledError:
            pass  # the proxy is stopping (asyncio would log a cancelled handler as an error)

    async def _proxy(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        self._writers.add(cwriter)
        swriter: asyncio.StreamWriter | None = None
        try:
            try:
                sreader, swriter = await asyncio.open_connection(LOOPBACK, self.upstream_port)
            except OSError:
                _hard_close(cwriter)
                return
            self._writers.add(swriter)
            conn = _Conn()
            up = asyncio.ensure_future(self._pump(creader, swriter, cwriter, conn, upstream=True))
            down = asyncio.ensure_future(self._pump(sreader, cwriter, swriter, conn, upstream=False))
            _done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            # A half-close (EOF) on one side: let the other finish briefly, then tear down.
            if pending:
                _, pending = await asyncio.wait(pending, timeout=5)
            for t in pending:
                t.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
        finally:
            for w in (cwriter, swriter):
                if w is not None:
                    self._writers.discard(w)
                    if not w.is_closing():
                        w.close()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 1)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
        conn: _Conn,
        *,
        upstream: bool,
    ) -> None:
        """Forward one direction; data is delayed by ``delay`` but pipelined (latency, not rate)."""
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    with contextlib.suppress(OSError, RuntimeError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                if not upstream and conn.cut_after is not None:
                    if len(data) >= conn.cut_after:
                        writer.write(data[: conn.cut_after])
                        with contextlib.suppress(Exception):
                            await writer.drain()
                        _hard_close(writer)
                        _hard_close(other)
                        return
                    conn.cut_after -= len(data)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await reader.read(256 * 1024)
                if self.stall:
                    if not data:
                        await asyncio.sleep(3600)
                    continue  # swallow everything, answer nothing
                if upstream and data.startswith(_REQUEST_STARTS):
                    kind = self._next_fault()
                    if kind == "reset":
                        _hard_close(other)
                        _hard_close(writer)
                        return
                    if kind == "503":
                        other.write(_503)
                        with contextlib.suppress(Exception):
                            await other.drain()
                        _hard_close(other)
                        _hard_close(writer)
                        return
                    if kind == "truncate":
                        conn.cut_after = 600  # headers and a little of the body, then a reset
                queue.put_nowait((loop.time() + self.delay, data or None))
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            _hard_close(writer)
        finally:
            if not sender.done():
                sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)


@dataclass
class _Conn:
    cut_after: int | None = None


def _hard_close(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a crashing peer or middlebox would."""
    with contextlib.suppress(Exception):  # a closed uvloop transport cannot even name its socket
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()


@contextlib.contextmanager
def proxy_process(upstream_port: int, *, delay: float, lifetime: float) -> Iterator[int]:
    """A :class:`FaultProxy` in a child process; yields its port."""
    with tempfile.TemporaryDirectory(prefix="guideloom-proxy-") as tmp:
        port_file = os.path.join(tmp, "port")
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "proxy",
                "--upstream",
                str(upstream_port),
                "--delay",
                str(delay),
                "--lifetime",
                str(lifetime),
                "--port-file",
                port_file,
            ],
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl(), before exec
        )
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(port_file):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the proxy process did not start")
                time.sleep(0.02)
            yield int(Path(port_file).read_text())
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("proxy")
    p.add_argument("--upstream", required=True, help="PORT or 127.0.0.1:PORT")
    p.add_argument("--delay", type=float, default=0.0, help="seconds added in each direction")
    p.add_argument("--lifetime", type=float, default=600.0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file")
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    if host not in ("", LOOPBACK, "localhost"):
        raise SystemExit("the proxy only forwards to 127.0.0.1")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    FaultProxy(int(port), delay=args.delay, lifetime=min(args.lifetime, 3600), port=args.port).serve_forever(
        args.port_file
    )


if __name__ == "__main__":
    _main(sys.argv[1:])
