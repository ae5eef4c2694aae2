"""Every private CPython API guideloom relies on, in one place (and anyio's one private module).

Each has no public equivalent for what it is used for here; ``tests/test_compat.py`` fails loudly
on a Python release that changes one of them, naming it, so that a new release means checking
this file and the callers it names, not the whole package.

Two groups: the interpreter's own (threads at exit, the stacks of threads) and multiprocessing's
fork server, which :mod:`guideloom._runtime.processes.zygote` runs in a process forked from the
main one (a *zygote*) and asks for forks: the server's private attributes, its loop, and its
``Popen`` pointed at a server other than the process-wide one.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import os
import sys
import threading
import types
from collections.abc import Callable
from multiprocessing import connection, forkserver, popen_forkserver, reduction, resource_tracker, spawn, util
from multiprocessing.context import ForkServerContext, ForkServerProcess, set_spawning_popen
from typing import Any

__all__ = [
    "ANYIO_ASYNCIO_BACKEND",
    "FORK_SERVER_ATTRS",
    "PRIVATE_APIS",
    "PRIVATE_ATTRIBUTES",
    "PRIVATE_MODULES",
    "ForkServer",
    "ForkServerContext",
    "OwnServerProcess",
    "at_threads_exit",
    "attach_fork_server",
    "bootstrapping",
    "clear_running_loop",
    "current_frames",
    "detach_fork_server",
    "flush_std_streams",
    "fork_server_is_known",
    "fork_server_pid",
    "fork_server_preload",
    "is_abstract_address",
    "new_fork_server",
    "new_unix_address",
    "serve_forks",
]

#: Private modules imported by name, and why: checked by the compatibility test (each must still
#: import). anyio's, not CPython's: its asyncio backend, which anyio imports on first use.
PRIVATE_MODULES: dict[str, str] = {
    "anyio._backends._asyncio": (
        "preload anyio's asyncio backend where workers are forked from, so that a worker's "
        "storage opens without importing it (tens of milliseconds a worker)"
    ),
}
#: The name of anyio's asyncio backend module (see :data:`PRIVATE_MODULES`).
ANYIO_ASYNCIO_BACKEND = "anyio._backends._asyncio"

#: Private attributes read (not called), and why: checked by the compatibility test (each must
#: still be set where it is read).
PRIVATE_ATTRIBUTES: dict[str, str] = {
    "multiprocessing.forkserver.ForkServer._preload_modules": (
        "keep the modules another user of the fork server asked it to preload when adding the workers'"
    ),
    "multiprocessing.process.BaseProcess._inheriting": (
        "tell a worker that is still importing the main script (a script without the __main__ guard)"
    ),
    "multiprocessing.forkserver._forkserver": (
        "the process-wide fork server, whose preload list has no getter (fork_server_preload)"
    ),
    "multiprocessing.popen_forkserver.Popen._fds": (
        "the descriptors a worker launched through a zygote's server is handed (as _launch does)"
    ),
    "multiprocessing.process.BaseProcess._args": (
        "keep open, in a worker forked from this process itself, the connections among its arguments"
    ),
    "concurrent.futures.thread.ThreadPoolExecutor._idle_semaphore": (
        "tell, on an event loop's thread, whether a pool would start a thread for a call (_process._Pool)"
    ),
    "concurrent.futures.thread.ThreadPoolExecutor._threads": "count a pool's threads against its most",
    "concurrent.futures.thread.ThreadPoolExecutor._max_workers": "count a pool's threads against its most",
    "concurrent.futures.thread.ThreadPoolExecutor._shutdown_lock": (
        "start a pool's thread aside under the lock its submit holds for it"
    ),
    "concurrent.futures.thread.ThreadPoolExecutor._work_queue": (
        "refuse the calls no thread will take (a start refused, the interpreter exiting)"
    ),
    "concurrent.futures.thread._global_shutdown_lock": "start a pool's thread aside as its submit would",
    "concurrent.futures.thread._shutdown": "start no pool thread once the interpreter exits",
}

#: What is used, and why: checked by the compatibility test (each name must still be callable).
PRIVATE_APIS: dict[str, str] = {
    "threading._register_atexit": (
        "stop guideloom's background work before the interpreter joins its threads, as "
        "concurrent.futures does (atexit handlers run after that join: too late)"
    ),
    "sys._current_frames": "the stacks of threads, to tell whether a fork would copy a thread's lock",
    "asyncio.events._set_running_loop": (
        "forget, in a zygote forked from a coroutine, the loop it ran; hide the caller's loop from "
        "a collate run on it"
    ),
    "asyncio.events._get_running_loop": "restore the caller's loop after a collate run on it",
    "multiprocessing.forkserver.main": "run multiprocessing's fork-server loop in a zygote",
    "multiprocessing.forkserver.read_signed": "read a forked worker's pid from the zygote's reply",
    "multiprocessing.forkserver.ForkServer.connect_to_new_process": "ask a zygote for a fork",
    "multiprocessing.popen_forkserver.Popen._launch": "launch a worker through a zygote's server",
    "multiprocessing.context.ForkServerProcess._Popen": "make a worker's Popen that asks a zygote",
    "multiprocessing.context.ForkProcess._Popen": "make the Popen of a worker forked from this process",
    "multiprocessing.process.BaseProcess._bootstrap": (
        "run a worker forked from this process itself, as multiprocessing's fork Popen does"
    ),
    "multiprocessing.context.set_spawning_popen": "pickle a worker's process object as _launch does",
    "multiprocessing.spawn.get_preparation_data": "what a worker sets up before unpickling, as _launch",
    "multiprocessing.reduction.dump": "pickle a worker's preparation and process object, as _launch",
    "multiprocessing.resource_tracker.ensure_running": "start the tracker a zygote's children share",
    "multiprocessing.connection.arbitrary_address": "a fresh address for a zygote's socket",
    "multiprocessing.util.is_abstract_socket_namespace": "whether a zygote's socket is a file to remove",
    "multiprocessing.util._flush_std_streams": "flush output before a fork, else each worker writes it",
    "multiprocessing.util.Finalize": "close a worker's pipes when its Popen goes, as _launch does",
    "multiprocessing.util.close_fds": "close a worker's pipes when its Popen goes, as _launch does",
    "concurrent.futures.thread.ThreadPoolExecutor._adjust_thread_count": (
        "hand a pool's thread start, asked for on an event loop's thread, to the aside thread"
    ),
}


def at_threads_exit(fn: Callable[[], Any]) -> None:
    """Run ``fn`` at interpreter exit before non-daemon threads are joined (``atexit`` runs
    after that join, too late to tell a thread to stop)."""
    register: Callable[[Callable[[], Any]], None] = threading._register_atexit  # type: ignore[attr-defined]
    register(fn)


def bootstrapping() -> bool:
    """Whether this process is a worker still importing the main script (``spawn`` and
    ``forkserver`` set it while they do: a script without the ``__main__`` guard would start its
    loader again there)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def current_frames() -> dict[int, types.FrameType]:
    """Each live thread's current frame, by thread id."""
    return sys._current_frames()


def clear_running_loop() -> None:
    """Forget this thread's running event loop (in a child forked from a coroutine, where no
    loop runs: else ``asyncio.run`` there refuses to start)."""
    asyncio.events._set_running_loop(None)


class NoRunningLoop:
    """This thread's running event loop hidden from what runs within, as on a thread of its own:
    a collate that ``async for`` measured cheap enough to run on the caller's loop finds no
    running loop there, as on its collate thread (else one that runs a loop of its own, with
    ``asyncio.run``, would fail once it moved to the loop). A class: entered at every batch, it
    costs half of a ``contextlib`` generator's enter and exit."""

    __slots__ = ("_loop",)

    def __enter__(self) -> None:
        self._loop = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(None)

    def __exit__(self, *exc: object) -> None:
        asyncio.events._set_running_loop(self._loop)


# ----------------------------------------------------------------------------------------------
# multiprocessing's fork server

#: A fork server: the process-wide one, or one that talks to a zygote.
ForkServer = forkserver.ForkServer

#: The private attributes of :class:`multiprocessing.forkserver.ForkServer` a zygote sets, as
#: ``ensure_running`` does: a Python whose fork server has others (3.14's authentication key)
#: is not one a zygote can run (:func:`fork_server_is_known`).
FORK_SERVER_ATTRS = frozenset(
    {
        "_forkserver_address",
        "_forkserver_alive_fd",
        "_forkserver_pid",
        "_inherited_fds",
        "_lock",
        "_preload_modules",
    }
)


def fork_server_is_known() -> bool:
    """Whether this Python's fork server is the one the helpers below know."""
    return set(vars(forkserver.ForkServer())) == FORK_SERVER_ATTRS


def new_fork_server(preload: list[str]) -> ForkServer:
    """A fork server not yet attached to a process; should the process it is attached to die,
    it starts multiprocessing's usual fork server in its place, with ``preload``. multiprocessing's
    resource tracker is started now, so that the children of a zygote forked next share it."""
    server = forkserver.ForkServer()
    server._preload_modules = list(preload)  # type: ignore[attr-defined]
    resource_tracker.ensure_running()
    return server


def new_unix_address() -> str:
    """A fresh address for a fork server's AF_UNIX socket (abstract where Linux allows)."""
    address: str = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    return address


def is_abstract_address(address: str) -> bool:
    """Whether a socket address is in Linux's abstract namespace (no file to remove)."""
    return bool(util.is_abstract_socket_namespace(address))


def flush_std_streams() -> None:
    """Flush ``sys.stdout`` and ``sys.stderr``, as multiprocessing does before a fork."""
    util._flush_std_streams()  # type: ignore[attr-defined]


def serve_forks(listener_fd: int, alive_r: int) -> None:
    """Run multiprocessing's fork-server loop on a listening AF_UNIX socket until the read end
    ``alive_r`` of the parent's alive pipe sees its end (raises ``SystemExit`` then)."""
    forkserver.main(listener_fd, alive_r, [])


def attach_fork_server(server: ForkServer, address: str, alive_fd: int, pid: int) -> None:
    """Point ``server`` at a running fork-server loop: its socket, the write end of its alive
    pipe, its pid (what ``ensure_running`` sets for the process-wide one)."""
    server._forkserver_address = address  # type: ignore[attr-defined]
    server._forkserver_alive_fd = alive_fd  # type: ignore[attr-defined]
    server._forkserver_pid = pid  # type: ignore[attr-defined]


def fork_server_preload() -> list[str]:
    """The modules the process-wide fork server is set to preload (``set_forkserver_preload``
    has no getter)."""
    return list(getattr(forkserver._forkserver, "_preload_modules", ()))


def fork_server_pid(server: ForkServer) -> int | None:
    """The pid of the process ``server`` talks to; None if none (or detached)."""
    pid: int | None = getattr(server, "_forkserver_pid", None)
    return pid


def detach_fork_server(server: ForkServer) -> tuple[int | None, str | None, int | None]:
    """Detach ``server`` from its process, once: the write end of its alive pipe (for the
    caller to close), its socket's address and its pid; None for each already detached."""
    alive_fd: int | None = getattr(server, "_forkserver_alive_fd", None)
    address: str | None = getattr(server, "_forkserver_address", None)
    pid = fork_server_pid(server)
    server._forkserver_alive_fd = None  # type: ignore[attr-defined]
    server._forkserver_pid = None  # type: ignore[attr-defined]
    return alive_fd, address, pid


class _OwnServerPopen(popen_forkserver.Popen):
    """multiprocessing's fork-server ``Popen``, asking the process's own server for the fork."""

    def _launch(self, process_obj: OwnServerProcess) -> None:
        # multiprocessing.popen_forkserver.Popen._launch, with the process's server in place of
        # the process-wide one.
        prep_data = spawn.get_preparation_data(process_obj.name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        server = process_obj.fork_server
        assert server is not None
        self.sentinel, w = server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        parent_w = os.dup(w)  # the child's sentinel of this process, as multiprocessing keeps it
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class OwnServerProcess(ForkServerProcess):
    """A process forked by :attr:`fork_server` (set before ``start``), not by the process-wide
    fork server; that server is not sent to the child."""

    fork_server: ForkServer | None = None

    @staticmethod
    def _Popen(process_obj: Any) -> _OwnServerPopen:  # noqa: N802 - multiprocessing's name
        return _OwnServerPopen(process_obj)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("fork_server", None)
        return state
