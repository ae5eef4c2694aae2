"""Where process workers are forked from: the main process itself while a fork is safe, else a
zygote forked from it while one was; workers that share the main process's pages either way.

multiprocessing's fork server is a fresh interpreter: it imports numpy and torch again, and the
workers it forks share those pages with it but not with the main process, so a pool of workers
costs a second copy of torch (peak PSS about 1.5x torch's ``DataLoader``, whose workers are forked
from the main process), and seconds of CPU to start. ``fork`` from the main process shares
everything, but is only safe while no other thread of it can hold what the child needs: a lock
another Python thread holds at the moment of the fork stays held in the child forever, and
obstore's runtime, whose (named) threads are gone in the child, hangs.

A fork is safe (:func:`fork_is_safe`) while this is the process's only Python thread, CUDA is not
initialised, and every other thread of the process is an unnamed one of a native library's pool
(``/proc/self/task``: OpenBLAS's, which shuts itself down around a fork; OpenMP's, which the
workers do not use: they run torch on one thread, as torch's own workers do; pyarrow's, which
Arrow's fork handlers start again in the child; and jemalloc's named background thread, which
its own fork handlers stop). A pool started then forks its workers from this process at once,
as torch's ``DataLoader`` does (:class:`ForkedHere`, one fork each on the caller's thread): they
share the main process's pages copy-on-write, modules included, and do not import the main
script again.

A worker forked here starts much as an ``exec`` would leave it: the main process's buffered
output is flushed before the fork (else each worker would write it again), and every descriptor
the main process did not mark inheritable (its sockets, pipes, other workers' pipes, files it
reads) is pointed at ``/dev/null`` in the child, so that closing one in the main process closes
it (a socket's peer sees the end, a port can be bound again, a worker sees the end of its own
pipe when the main process dies). What the main process writes its output through is kept, as
torch's forked workers keep it: ``sys.stdout``, ``sys.stderr``, the streams of its logging
handlers (a ``FileHandler``'s file) and the regular files it appends to, so that what a collate
logs or prints reaches the same file. The number stays taken, so that an object of the main
process's that a worker's collector finalises cannot close a descriptor the worker opened since.

Object stores start obstore's runtime, whose named threads make every later fork unsafe, and a
storage is opened before its loader exists. So the first time this process makes an object
store (:data:`guideloom.storage._remote._objstore.BEFORE_FIRST_STORE`), if a fork is safe then, a
*standby* zygote is forked (:func:`fork_standby`) and kept for the process's life: a process
that runs multiprocessing's own fork-server loop (:func:`multiprocessing.forkserver.main`), started
as a worker forked here is. A pool made later, when a fork is no longer safe, has its workers
forked from it on request, from any thread, safely (the zygote has one thread), instead of
starting multiprocessing's fork server. It is used only where everything the pool's workers
unpickle from ``__main__`` was there, the same object, when it was forked (:func:`standby_for`):
a function the main script defined afterwards would not be found in a worker. Elsewhere the
fork server stands in, as it does for a worker started again (one died) once the main process
has other threads.

A Python whose fork server differs from the one :mod:`guideloom._compat` knows (3.14's
authenticates its clients) gets multiprocessing's fork server where a fork is not safe. A zygote
that a pool's close kills (stopped with SIGSTOP, stuck) is reaped here, or at exit once every
pool is closed (:data:`~guideloom._runtime.processes.pool._POOLS`).
"""

from __future__ import annotations

import fcntl
import gc
import importlib
import os
import pickletools
import signal
import socket
import stat
import sys
import threading
import time
import warnings
from multiprocessing import popen_fork, util
from multiprocessing.connection import Connection
from multiprocessing.context import ForkContext, ForkProcess
from typing import Any

from guideloom._compat import (
    ForkServer,
    ForkServerContext,
    OwnServerProcess,
    attach_fork_server,
    clear_running_loop,
    current_frames,
    detach_fork_server,
    flush_std_streams,
    fork_server_is_known,
    fork_server_pid,
    is_abstract_address,
    new_fork_server,
    new_unix_address,
    serve_forks,
)
from guideloom._process import idle_aside, runs_a_loop

__all__ = [
    "ForkedHere",
    "HereContext",
    "ZygoteContext",
    "fork_is_safe",
    "fork_standby",
    "fork_zygote",
    "may_fork_here",
    "reap_closed",
    "standby_for",
]

#: Named threads of pools that prepare for a fork themselves: jemalloc's background threads
#: (pyarrow's allocator), which its own fork handlers stop and start again in the child.
_FORK_SAFE_NAMES = ("jemalloc_bg_thd\n",)

#: How long :func:`fork_is_safe` waits for threads that stand in the way to end.
_ENDING_S = 0.05


def _comm(task: str) -> str | None:
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read()
    except OSError:  # gone meanwhile
        return None


def _threads_allow_fork() -> bool:
    """Whether this is the process's only Python thread, but for guideloom's aside thread while
    it waits for work (:func:`~guideloom._process.idle_aside`: it holds no lock then), and every
    other thread is an unnamed one of a native library's pool (a named one, such as obstore's
    runtime's, is not)."""
    idle = idle_aside()
    alone = 1 if idle is None else 2
    # threading's count misses threads started with _thread.start_new_thread; the frames do not
    if threading.active_count() != alone or len(current_frames()) != alone:
        return False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no /proc: not Linux; the threads cannot be told apart
        return False
    me = str(threading.get_native_id())
    name = _comm(me)
    left = {me} if idle is None else {me, str(idle.native_id)}
    return all(_comm(t) in (name, None, *_FORK_SAFE_NAMES) for t in tasks if t not in left)


def fork_is_safe(ending_s: float = _ENDING_S) -> bool:
    """Whether this process may fork now: see the module's docstring. A thread that is ending
    (an idle AnyIO worker thread whose loop has just stopped) is given ``ending_s`` to end."""
    deadline = time.monotonic() + ending_s
    while not _threads_allow_fork():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return False
        except Exception:  # pragma: no cover - a torch without a cuda module
            return False
    # a Python whose fork server differs (3.14's authenticates) gets multiprocessing's own
    return fork_server_is_known()


def may_fork_here(standby: ForkServer | None) -> bool:
    """:func:`fork_is_safe` for starting workers: a thread that is ending is waited for briefly,
    unless ``standby`` (the standby zygote, if any) can start them at once instead, or this
    thread runs an event loop (an ``async for``'s start: the loop is never put to sleep, and
    the threads beside it there are its own pipeline's, which do not end)."""
    if standby is not None or runs_a_loop():
        return fork_is_safe(0.0)
    return fork_is_safe()


def import_each(modules: list[str]) -> list[str]:
    """``modules``, imported in this process; one that is not installed is left to the worker,
    which fails where it needs it."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    return modules


def fork_zygote(preload: list[str]) -> ForkServer:
    """Fork a zygote from this process (:func:`fork_is_safe` must hold) and return the
    :class:`~multiprocessing.forkserver.ForkServer` that talks to it. Should the zygote die, the
    server starts multiprocessing's usual fork server in its place, with ``preload``."""
    server = new_fork_server(preload)
    with socket.socket(socket.AF_UNIX) as listener:
        address = new_unix_address()
        listener.bind(address)
        if not is_abstract_address(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        output = _output_fds()
        reap_closed()
        flush_std_streams()  # else each worker writes it again
        with warnings.catch_warnings():
            # Python 3.12+ warns of any fork with threads; those left are fork-safe (above).
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the zygote (coverage does not follow a fork that _exits)
            code = 0
            try:
                os.close(alive_w)
                _close_fds_but(listener.fileno(), alive_r, *output)
                # A fork from a coroutine: no loop runs on this thread here.
                clear_running_loop()
                # What the zygote holds is the workers' to share: their collections skip it
                # (a collection writes to every object it visits, copying each page it touches).
                gc.freeze()
                serve_forks(listener.fileno(), alive_r)
            except SystemExit:  # every client gone: the loop's normal end
                pass
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(alive_r)
    attach_fork_server(server, address, alive_w, pid)
    return server


#: The zygotes of closed pools not yet reaped (each ends once its workers have).
_CLOSED: list[int] = []


def reap_closed() -> None:
    """Reap the zygotes of closed pools that have exited since."""
    for pid in list(_CLOSED):
        try:
            done = os.waitpid(pid, os.WNOHANG)[0]
        except ChildProcessError:
            done = True
        if done:
            _CLOSED.remove(pid)


def _output_fds() -> set[int]:
    """The descriptors this process writes its output through, which the workers keep, as
    torch's forked workers do: ``sys.stdout`` and ``sys.stderr`` (wherever they point) and the
    streams of its logging handlers (a ``FileHandler``'s file)."""
    streams: list[Any] = [sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__]
    logging = sys.modules.get("logging")
    if logging is not None:
        loggers = [logging.getLogger(), *list(logging.Logger.manager.loggerDict.values())]
        for logger in loggers:
            for handler in getattr(logger, "handlers", ()):
                streams.append(getattr(handler, "stream", None))
    fds = set()
    for stream in streams:
        try:
            fds.add(stream.fileno())
        except (AttributeError, OSError, ValueError):  # None, closed, or no descriptor (StringIO)
            pass
    return fds


def _appends_to_a_file(fd: int) -> bool:
    """Whether ``fd`` is a regular file open for appending (a log a collate may write to)."""
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)
    except OSError:
        return False


def _close_fds_but(*keep: int) -> None:
    """In the zygote: close what an exec would have closed (every non-inheritable fd: the main
    process's sockets, pipes, other zygotes' alive pipes, files it reads), keeping 0-2, ``keep``
    and the files it appends to (logs)."""
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in fds:
        if fd > 2 and fd != null and fd not in keep:
            try:
                if not os.get_inheritable(fd) and not _appends_to_a_file(fd):
                    # dup2, not close: the file/pipe/socket is released, but the number stays
                    # taken, so a stale object of the main process's that closes it later (a
                    # cycle the GC collects in a worker) cannot close a worker's own fd
                    os.dup2(null, fd, inheritable=False)
            except OSError:
                pass
    os.close(null)


#: How long :func:`kill_zygote` waits to reap the zygote it killed before leaving that to the
#: next zygote's fork or to the exit.
ZYGOTE_END_S = 1.0


def kill_zygote(server: ForkServer) -> None:
    """Close this process's end of the zygote's alive pipe, remove its socket and kill it (it
    does not answer: stopped with SIGSTOP, or stuck); it is reaped here within
    :data:`ZYGOTE_END_S`, or by the next zygote's fork or at exit if that takes longer."""
    fd, address, pid = detach_fork_server(server)
    if fd is not None:
        os.close(fd)
    if address is not None and not is_abstract_address(address):
        try:
            os.unlink(address)
        except OSError:
            pass
    if pid is None:
        return
    _CLOSED.append(pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    _reaped(pid, ZYGOTE_END_S)


def _reaped(pid: int, seconds: float) -> bool:
    """Reap closed zygotes until ``pid`` is reaped, ``seconds`` at most; whether it was."""
    deadline = time.monotonic() + seconds
    while True:
        reap_closed()
        if pid not in _CLOSED:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


class _Standby:
    """The standby zygote: its server and what ``__main__`` held when it was forked."""

    __slots__ = ("main", "server")

    def __init__(self, server: ForkServer, main: dict[str, Any]) -> None:
        self.server, self.main = server, main


#: The standby zygote, if one was forked (and is not known to be gone).
_STANDBY: list[_Standby] = []


def fork_standby(preload: list[str]) -> None:
    """Fork the standby zygote now if a fork is safe and there is none (see the module's
    docstring); nothing otherwise."""
    if _STANDBY or not fork_is_safe():
        return
    main = sys.modules.get("__main__")
    snapshot = dict(vars(main)) if main is not None else {}
    _STANDBY.append(_Standby(fork_zygote(preload), snapshot))


def standby_for(spec: bytes) -> ForkServer | None:
    """The standby zygote's server, if there is one alive and the workers of a pool whose
    pickled dataset and collate are ``spec`` would find in its ``__main__`` every object they
    name there (the same objects); else None."""
    if not _STANDBY:
        return None
    standby = _STANDBY[0]
    pid = fork_server_pid(standby.server)
    alive = pid is not None
    if pid is not None:
        try:
            alive = os.waitpid(pid, os.WNOHANG)[0] == 0
        except ChildProcessError:
            alive = False
    if not alive:  # killed, or ended: dropped (a pool that still uses it sees its end)
        _STANDBY.clear()
        return None
    main = sys.modules.get("__main__")
    missing = object()
    names = main_names(spec)
    if names is None:
        return None
    for name in names:
        head = name.split(".", 1)[0]
        if standby.main.get(head, missing) is not getattr(main, head, missing):
            return None
    return standby.server


def drop_standby(server: ForkServer) -> None:
    """Forget the standby zygote if ``server`` is its (it was killed: stopped, or stuck)."""
    if _STANDBY and _STANDBY[0].server is server:
        _STANDBY.clear()


def main_names(data: bytes) -> set[str] | None:
    """The names of the ``__main__`` globals a pickle refers to (functions, classes); None for
    data this cannot read as a pickle (it may name anything)."""
    names: set[str] = set()
    if b"__main__" not in data and b"__mp_main__" not in data:  # (the common case, at once)
        return names
    recent: list[Any] = []  # what the last opcodes pushed (strings, else None)
    memo: dict[int, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name == "GLOBAL":
                module, _, qual = str(arg).partition(" ")
                if module in ("__main__", "__mp_main__"):
                    names.add(qual)
                recent.append(None)
            elif name == "STACK_GLOBAL":
                pushed = recent[-2:] if len(recent) >= 2 else [None, None]
                if pushed[0] in ("__main__", "__mp_main__") and isinstance(pushed[1], str):
                    names.add(pushed[1])
                recent.append(None)
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(str(arg))] = recent[-1] if recent else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(int(str(arg))))
            elif "UNICODE" in name or "STRING" in name:
                recent.append(arg)
            elif name not in ("FRAME", "PROTO", "STOP"):
                recent.append(None)
            del recent[:-2]
    except Exception:  # not a pickle this can read
        return None
    return names


class ZygoteContext(ForkServerContext):
    """A multiprocessing context whose processes the standby zygote forks (pipes as any
    context's)."""

    #: The standby outlives the pools that use it: closing a pool leaves it up.
    shared = True

    def __init__(self, server: ForkServer) -> None:
        super().__init__()
        self.server = server

    def Process(self, *args: Any, **kwargs: Any) -> OwnServerProcess:  # type: ignore[override]  # noqa: N802
        proc = OwnServerProcess(*args, **kwargs)
        proc.fork_server = self.server
        return proc

    def kill(self) -> None:
        """End the zygote now (it does not answer: stopped, or stuck); its workers go on."""
        drop_standby(self.server)
        kill_zygote(self.server)


class _HerePopen(popen_fork.Popen):
    """multiprocessing's ``fork`` Popen (which flushes the buffered output first), the child
    started as :class:`ForkedHere` says."""

    def _launch(self, process_obj: ForkedHere) -> None:
        keep = (*process_obj.keep_fds(), *_output_fds())
        reap_closed()
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns of any fork with threads; those left are fork-safe (above).
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the worker (coverage does not follow a fork that _exits)
            code = 1
            try:
                os.close(parent_r)
                os.close(parent_w)
                _close_fds_but(child_r, child_w, *keep)
                clear_running_loop()
                gc.freeze()  # (as a zygote's workers inherit it: their collections skip its objects)
                code = process_obj._bootstrap(parent_sentinel=child_r)  # type: ignore[attr-defined]
            finally:
                os._exit(code)
        os.close(child_w)
        os.close(child_r)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_r, parent_w))  # type: ignore[attr-defined]
        self.sentinel = parent_r


class ForkedHere(ForkProcess):
    """A worker forked from this process itself, on its only thread (:func:`fork_is_safe`): every
    descriptor this process did not mark inheritable points at ``/dev/null`` in the child but its
    own connections (its arguments) and what this process writes its output through (see the
    module's docstring); no loop runs in it; what it inherits is frozen out of its collections
    (a collection writes to every object it visits, copying each page it touches)."""

    @staticmethod
    def _Popen(process_obj: Any) -> _HerePopen:  # noqa: N802 - multiprocessing's name
        return _HerePopen(process_obj)

    def keep_fds(self) -> list[int]:
        """The descriptors of the connections among the process's arguments."""
        args: tuple[Any, ...] = self._args  # type: ignore[attr-defined]  # (see _compat.PRIVATE_ATTRIBUTES)
        return [a.fileno() for a in args if isinstance(a, Connection)]


class HereContext(ForkContext):
    """The context of a pool whose workers are forked from this process itself
    (:class:`ForkedHere`): it had one thread when the pool was made, and each start checks
    that it still has (:meth:`~guideloom._runtime.processes.pool.WorkerPool.begin`)."""

    Process = ForkedHere
