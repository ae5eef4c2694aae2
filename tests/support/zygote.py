"""Programs started as processes forked from a zygote that has imported their heavy modules once.

A program that imports torch spends about two CPU-seconds on it (Lightning four), and some tests
start such programs many times: the torchft replicas some twenty times a job, the recipes' ranks
two to five times a test. A zygote (``python [-W ...] -m tests.support.zygote MODULE...``)
imports the modules named once, on its only thread, then forks a child per request. Each child
is still its own process: it takes the request's environment and folder, its output and errors
go to its log file, and it runs the program from its start as ``python -m MODULE ARGS``,
``python SCRIPT ARGS`` (:mod:`runpy`, as ``__main__``) or ``python -c CODE ARGS`` (in a fresh
``__main__`` module with no file, the current folder first on the path) would, and the
interpreter ends it as it ends those: non-daemon threads joined, exit handlers run, an uncaught
exception printed with exit status 1. The zygote's objects are frozen out of the collector's
sight before it forks (:func:`gc.freeze`), so that the children share its pages. It holds a
pidfd per child: it reports each child's exit status (``-9`` for SIGKILL, as
:meth:`subprocess.Popen.poll` gives it), and kills a child through that pidfd, never through a
pid that may have been reused.

Requests and replies are lines of JSON on the zygote's stdin and stdout. It ends, killing the
children still alive, when its stdin closes: a test that dies leaves no child behind.
"""

from __future__ import annotations

import ast
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def imports_of(path: Path) -> list[str]:
    """The modules the program at ``path`` imports at its top level, in its order: what a zygote
    for it preloads."""
    return imports_in(path.read_text())


def imports_in(source: str) -> list[str]:
    """The modules the program ``source`` imports at its top level, in its order."""
    names: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            names.append(node.module or "")
    return [n for n in dict.fromkeys(names) if n]


class Child:
    """A program forked from the zygote: ``pid``, ``poll()``, ``wait()`` and ``kill()``, as for
    :class:`subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        """The exit status once the child has ended (``-N`` for signal N), else None."""
        return self.zygote.returncode(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        """Until the child has ended; its exit status."""
        return self.zygote.wait(self.pid, timeout)

    def kill(self) -> None:
        """SIGKILL the child, if it has not ended yet."""
        self.zygote.kill(self.pid)


class Zygote:
    """The test's side: starts the zygote, asks it for children, follows their exit statuses."""

    def __init__(
        self, log: Path, preload: Sequence[str], *, cwd: Path, env: dict[str, str], python: Sequence[str] = ()
    ) -> None:
        """A zygote that imports ``preload``, run as ``python [python...] -m tests.support.zygote``
        in ``cwd`` with ``env`` (``python``: the interpreter's options, such as ``-W error``), its
        own errors in ``log``."""
        self.log = log
        self.cwd, self.env = cwd, env
        with open(log, "ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, *python, "-m", "tests.support.zygote", *preload],
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}  # request -> pid
        self._codes: dict[int, int] = {}  # pid -> exit status
        self._gone = False
        self._next = 0
        self._reader = threading.Thread(target=self._read, name="zygote-replies", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            reply = json.loads(line)
            with self._cond:
                if "started" in reply:
                    self._pids[reply["started"]] = reply["pid"]
                else:
                    self._codes[reply["pid"]] = reply["returncode"]
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def _send(self, request: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()

    def _check(self) -> None:
        if self._gone:
            raise RuntimeError(f"the zygote exited ({self._proc.poll()}): {self.log.read_text()[-3000:]}")

    def start(
        self,
        argv: Sequence[str],
        log: Path,
        *,
        module: str = "",
        code: str | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Child:
        """Fork a child that runs ``python -m module argv...`` (with ``code``, ``python -c code
        argv...``; with neither, ``python argv...``, ``argv[0]`` a script) in ``cwd`` with ``env``
        (the zygote's by default), its output and errors appended to ``log``."""
        with self._cond:
            request, self._next = self._next, self._next + 1
        self._send(
            {
                "op": "start",
                "id": request,
                "module": module,
                "code": code,
                "argv": list(argv),
                "log": str(log),
                "env": self.env if env is None else env,
                "cwd": str(self.cwd if cwd is None else cwd),
            }
        )
        with self._cond:
            # the first start waits for the zygote's imports
            self._cond.wait_for(lambda: request in self._pids or self._gone, timeout=120)
            if request not in self._pids:
                self._check()
                raise TimeoutError(f"the zygote did not fork in 120 s: {self.log.read_text()[-3000:]}")
            return Child(self, self._pids.pop(request))

    def alive(self) -> bool:
        """Whether the zygote still answers (it has not exited)."""
        with self._cond:
            return not self._gone and self._proc.poll() is None

    def returncode(self, pid: int) -> int | None:
        with self._cond:
            if pid not in self._codes:
                self._check()
            return self._codes.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: pid in self._codes or self._gone, timeout=timeout):
                raise subprocess.TimeoutExpired(f"child {pid} of the zygote", timeout or 0.0)
            if pid not in self._codes:
                self._check()
            return self._codes[pid]

    def kill(self, pid: int) -> None:
        with self._cond:
            if pid in self._codes or self._gone:
                return
        try:
            self._send({"op": "kill", "pid": pid})
        except BrokenPipeError:  # the zygote is gone, and its children with it
            pass

    def close(self) -> None:
        """End the zygote: it kills the children still alive, reaps them and exits."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._proc.wait(timeout=30)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._reader.join(timeout=10)
            assert self._proc.stdout is not None
            self._proc.stdout.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reply(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def serve(requests: int, replies: int) -> dict[str, Any] | None:
    """The zygote's loop, on its only thread; returns a start request in each forked child, and
    None in the zygote once ``requests`` is closed (every child killed and reaped by then)."""
    sel = selectors.DefaultSelector()
    sel.register(requests, selectors.EVENT_READ, None)
    children: dict[int, int] = {}  # pid -> pidfd
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.data is not None:  # a child ended
                pid = key.data
                _, status = os.waitpid(pid, 0)
                sel.unregister(key.fd)
                os.close(children.pop(pid))
                _reply(replies, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(requests, 1 << 16)
            if not chunk:  # the test is done (or gone): no child outlives the zygote
                for pid, fd in children.items():
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    os.close(fd)
                sel.close()
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request: dict[str, Any] = json.loads(line)
                if request["op"] == "kill":
                    target = children.get(request["pid"])
                    if target is not None:
                        signal.pidfd_send_signal(target, signal.SIGKILL)
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for fd in [requests, replies, *children.values()]:
                        os.close(fd)
                    return request
                fd = os.pidfd_open(pid)
                children[pid] = fd
                sel.register(fd, selectors.EVENT_READ, pid)
                _reply(replies, {"started": request["id"], "pid": pid})


def run(request: dict[str, Any]) -> None:
    """In a forked child: its environment, folder and log, then the program as ``__main__``."""
    devnull = os.open(os.devnull, os.O_RDONLY)  # 0 itself where the zygote's requests were
    if devnull != 0:
        os.dup2(devnull, 0)
        os.close(devnull)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    if request.get("code") is not None:
        sys.argv = ["-c", *argv]
        sys.path[0] = ""  # python -c puts the current folder first
        main = types.ModuleType("__main__")  # no __file__, as under -c: nothing for a spawn to import
        sys.modules["__main__"] = main
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    elif request["module"]:
        sys.argv = ["-m", *argv]  # runpy puts the module's path first, as python -m does
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # python SCRIPT puts its folder first
        runpy.run_path(argv[0], run_name="__main__")


def main(preload: list[str]) -> int:
    for name in preload:
        importlib.import_module(name)
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # a fork would copy locks other threads hold
        print(f"the zygote has {len(threads)} threads after its imports: a fork is not safe", file=sys.stderr)
        return 1
    # What the imports made lives as long as a child does: out of the collector's sight, its
    # pages stay shared (each collection in a child would otherwise write to all of them, about a
    # CPU-second of copied pages a child), as the gc module's documentation advises before a fork.
    gc.collect()
    gc.freeze()
    replies = os.dup(1)  # stray output of the zygote goes to its log, not among the replies
    os.dup2(2, 1)
    sys.stdout.flush()
    request = serve(0, replies)
    if request is None:
        return 0
    run(request)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
