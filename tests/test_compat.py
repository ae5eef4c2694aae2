"""The private CPython APIs guideloom relies on (``guideloom._compat``) are still there, with the
shape it uses: a Python release that changes one fails here, by name."""

from __future__ import annotations

import ast
import asyncio
import importlib
import io
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from guideloom import _compat

ROOT = Path(__file__).resolve().parents[1]


def _resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name, None)
        return obj
    return None


@pytest.mark.parametrize("name", sorted(_compat.PRIVATE_MODULES))
def test_each_private_module_imported_by_name_still_imports(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} no longer imports ({exc}): guideloom uses it to {_compat.PRIVATE_MODULES[name]}")
    assert _compat.ANYIO_ASYNCIO_BACKEND in _compat.PRIVATE_MODULES


@pytest.mark.parametrize("dotted", sorted(_compat.PRIVATE_APIS))
def test_each_private_api_used_still_exists(dotted: str) -> None:
    assert callable(_resolve(dotted)), (
        f"{dotted} is gone in Python {sys.version.split()[0]}: guideloom uses it to "
        f"{_compat.PRIVATE_APIS[dotted]}; see guideloom/_compat.py"
    )


def test_at_threads_exit_runs_before_the_interpreter_joins_threads() -> None:
    """A non-daemon thread that waits for a stop signal: without the hook the process would never
    exit."""
    code = (
        "import threading\n"
        "from guideloom._compat import at_threads_exit\n"
        "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait).start()\n"
        "at_threads_exit(stop.set)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30)


def test_current_frames_names_every_live_thread() -> None:
    started, stop = threading.Event(), threading.Event()

    def wait() -> None:
        started.set()
        stop.wait()

    t = threading.Thread(target=wait)
    t.start()
    started.wait()
    try:
        assert {threading.get_ident(), t.ident} <= set(_compat.current_frames())
    finally:
        stop.set()
        t.join()


def test_clear_running_loop_forgets_the_loop_of_this_thread() -> None:
    async def inside() -> None:
        loop = asyncio.get_running_loop()
        _compat.clear_running_loop()
        try:
            with pytest.raises(RuntimeError, match="no running event loop"):
                asyncio.get_running_loop()
        finally:
            asyncio.events._set_running_loop(loop)

    asyncio.run(inside())


def test_flush_std_streams_flushes_stdout_and_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    flushed: list[str] = []

    class Stream(io.StringIO):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def flush(self) -> None:
            flushed.append(self.name)

    monkeypatch.setattr(sys, "stdout", Stream("stdout"))
    monkeypatch.setattr(sys, "stderr", Stream("stderr"))
    _compat.flush_std_streams()
    assert sorted(flushed) == ["stderr", "stdout"]


def test_the_fork_server_has_the_private_attributes_a_zygote_sets() -> None:
    """A Python whose fork server has other attributes (3.14's authentication key) gets no
    zygote (guideloom falls back to multiprocessing's fork server); this names the change."""
    got = set(vars(_compat.ForkServer()))
    assert _compat.fork_server_is_known(), (
        f"multiprocessing.forkserver.ForkServer's attributes changed in Python "
        f"{sys.version.split()[0]}: {sorted(got ^ _compat.FORK_SERVER_ATTRS)}; see guideloom/_compat.py"
    )


def test_a_socket_address_is_abstract_only_in_the_abstract_namespace() -> None:
    assert _compat.is_abstract_address("\0guideloom-test")
    assert not _compat.is_abstract_address("/tmp/guideloom-test.sock")
    address = _compat.new_unix_address()
    assert isinstance(address, str) and address != _compat.new_unix_address()


#: A fork server run with the helpers, in a process forked from a script (as a zygote is): a
#: process it forks reports its parent, its own ``__main__`` function is found without importing
#: the script again, and the server ends once its alive pipe is closed.
FORK_SERVER = """
import os, socket
from multiprocessing import Pipe
from guideloom import _compat as c

def report(conn, value):
    conn.send((os.getppid(), value))
    conn.close()

server = c.new_fork_server([])
with socket.socket(socket.AF_UNIX) as listener:
    address = c.new_unix_address()
    listener.bind(address)
    listener.listen()
    alive_r, alive_w = os.pipe()
    c.flush_std_streams()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.close(alive_w)
            c.serve_forks(listener.fileno(), alive_r)
        except SystemExit:
            code = 0
        finally:
            os._exit(code)
    os.close(alive_r)
c.attach_fork_server(server, address, alive_w, pid)
assert c.fork_server_pid(server) == pid
ours, theirs = Pipe()
proc = c.OwnServerProcess(target=report, args=(theirs, "from the zygote"))
proc.fork_server = server
proc.start()
theirs.close()
assert ours.recv() == (pid, "from the zygote"), "forked by the zygote"
proc.join(30)
assert proc.exitcode == 0, proc.exitcode
fd, got_address, got_pid = c.detach_fork_server(server)
assert (fd, got_address, got_pid) == (alive_w, address, pid)
assert c.fork_server_pid(server) is None and c.detach_fork_server(server)[::2] == (None, None)
os.close(fd)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, "the loop ends at the end of its alive pipe"
if not c.is_abstract_address(address):
    os.unlink(address)
print("ok")
"""


def test_a_fork_server_run_and_asked_with_the_helpers_forks_processes() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORK_SERVER)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("dotted", sorted(_compat.PRIVATE_ATTRIBUTES))
def test_each_private_attribute_read_is_still_set_where_it_is_read(dotted: str) -> None:
    """The attribute is still assigned by the module that owns it (its source names it)."""
    import inspect

    attribute = dotted.rpartition(".")[2]
    setters = {
        "_preload_modules": [importlib.import_module("multiprocessing.forkserver")],
        "_inheriting": [
            importlib.import_module(m) for m in ("multiprocessing.spawn", "multiprocessing.forkserver")
        ],
        "_args": [importlib.import_module("multiprocessing.process")],
        "_forkserver": [importlib.import_module("multiprocessing.forkserver")],
        "_fds": [importlib.import_module("multiprocessing.popen_forkserver")],
        **{
            name: [importlib.import_module("concurrent.futures.thread")]
            for name in (
                "_idle_semaphore",
                "_threads",
                "_max_workers",
                "_shutdown_lock",
                "_work_queue",
                "_global_shutdown_lock",
                "_shutdown",
            )
        },
    }[attribute]
    for setter in setters:
        source = inspect.getsource(setter)
        assert f".{attribute} = " in source or f"\n{attribute} = " in source, (
            f"{dotted} is no longer set by {setter.__name__} in Python {sys.version.split()[0]}: guideloom "
            f"reads it to {_compat.PRIVATE_ATTRIBUTES[dotted]}; see guideloom/_compat.py"
        )


def test_a_worker_importing_the_main_script_is_told_from_the_main_process(tmp_path: Path) -> None:
    """``bootstrapping()`` is False here and True while a spawned child imports the main script."""
    assert not _compat.bootstrapping()
    script = tmp_path / "child_main.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing, sys
            from guideloom._compat import bootstrapping
            if __name__ == "__mp_main__":  # the child importing this script
                sys.stdout.write(f"child:{bootstrapping()}\\n"); sys.stdout.flush()
            def nothing():
                pass
            if __name__ == "__main__":
                p = multiprocessing.get_context("spawn").Process(target=nothing)
                p.start(); p.join()
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], check=True, cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    ).stdout  # fmt: skip
    assert "child:True" in out


def _private_uses(path: Path) -> set[str]:
    """``module._name`` and ``from module import _name`` in ``path``, for a module of the standard
    library or anyio (a dunder is not private)."""
    tree = ast.parse(path.read_text(), str(path))
    known = set(sys.stdlib_module_names) | {"anyio"}
    aliases: dict[str, str] = {}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.partition(".")[0] in known:
                    top = a.name.partition(".")[0]
                    aliases[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.partition(".")[0] in known:
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.add(f"{node.module}.{a.name}")
                aliases.setdefault(a.asname or a.name, f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            parts = [node.attr]
            value = node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                found.add(".".join([aliases[value.id], *reversed(parts)]))
    return found


#: Names with a leading underscore that are public, documented API.
PUBLIC_UNDERSCORED = frozenset({"os._exit"})


def test_private_apis_are_used_only_where_compat_names_them() -> None:
    """A private name of the standard library or anyio used anywhere in the package is one the
    compatibility module lists (and so checked above on every Python and anyio release)."""
    listed = set(_compat.PRIVATE_APIS) | set(_compat.PRIVATE_ATTRIBUTES) | PUBLIC_UNDERSCORED
    package = Path(_compat.__file__).parent
    unlisted = {
        f"{p.relative_to(package.parent)}: {use}"
        for p in package.rglob("*.py")
        for use in _private_uses(p)
        if use not in listed and not any(use.startswith(m + ".") for m in _compat.PRIVATE_MODULES)
    }
    assert not unlisted, f"private APIs used but not listed in guideloom/_compat.py: {sorted(unlisted)}"


def test_the_private_use_scan_sees_each_form(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import threading\nimport multiprocessing.util as mu\nfrom multiprocessing import forkserver\n"
        "from sys import _getframe\nthreading._register_atexit(print)\nmu._flush_std_streams()\n"
        "forkserver._forkserver.x\nthreading.Thread.__init__\n"
    )
    assert _private_uses(sample) == {
        "threading._register_atexit",
        "multiprocessing.util._flush_std_streams",
        "multiprocessing.forkserver._forkserver",
        "sys._getframe",
    }
