"""How process workers start: the start method, and where a new pool's workers are forked from.

Where the pool is made on the process's only thread, its workers are forked from the main process
itself, as torch's ``DataLoader`` forks its own (:class:`~guideloom._runtime.processes.zygote.HereContext`):
they share its pages, torch's included. Elsewhere they come from the standby zygote forked before
the process's first object store, or from multiprocessing's fork server told what to preload.

The environment variable ``GUIDELOOM_WORKER_START`` (:data:`START_ENV`) may name another start
method for the process (:func:`start_method`, read at each choice: when a pool is made, and
before the first object store): a process-wide setting, as the standby zygote is one per
process, forked before any loader exists.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

from guideloom._compat import ANYIO_ASYNCIO_BACKEND, bootstrapping, fork_server_preload
from guideloom._runtime.processes.zygote import (
    HereContext,
    ZygoteContext,
    fork_standby,
    import_each,
    may_fork_here,
    standby_for,
)
from guideloom.storage._remote import _objstore

__all__ = [
    "PRELOAD",
    "START_ENV",
    "START_METHODS",
    "check_not_bootstrapping",
    "preload",
    "start_method",
    "worker_context",
]

#: The environment variable that names how process workers start (:data:`START_METHODS`).
START_ENV = "GUIDELOOM_WORKER_START"
#: How workers may start: ``"here"``, the default (forked from this process where that is safe,
#: else from the standby zygote or multiprocessing's fork server); ``"forkserver"``
#: (multiprocessing's fork server, told what to preload); ``"spawn"`` (a fresh interpreter
#: each); ``"fork"`` (multiprocessing's ``fork`` from this process whatever its threads: a lock
#: another thread holds then stays held in the worker). Where the platform has no fork server,
#: every method but ``"fork"`` is ``"spawn"``.
START_METHODS = ("here", "forkserver", "spawn", "fork")
#: What turns an on/off setting off (``GUIDELOOM_STANDBY_ZYGOTE``); anything else leaves it on.
_OFF = frozenset({"0", "false", "no", "off"})
#: What the fork server imports before it forks a worker (torch too, when the main process has
#: imported it): each worker shares them instead of importing them anew. A zygote, and a worker
#: forked from this process, have what this process imported when they were forked: these are
#: imported here first (:func:`~guideloom._runtime.processes.zygote.import_each`), among them
#: ``numpy.random`` (each worker seeds it) and anyio's asyncio backend (a storage opens on it,
#: here too), which would otherwise cost each worker's start some tens of milliseconds.
PRELOAD = ("guideloom._runtime.processes.worker", "numpy", "numpy.random", ANYIO_ASYNCIO_BACKEND)


def start_method() -> str:
    """The start method :data:`START_ENV` names now (``"here"`` where it is unset or empty);
    a ``ValueError`` naming the allowed values for any other."""
    method = os.environ.get(START_ENV, "").strip() or "here"
    if method not in START_METHODS:
        raise ValueError(
            f"{START_ENV}={method!r} is not a start method guideloom knows: set it to one of "
            f"{', '.join(START_METHODS)} (or leave it unset for 'here')"
        )
    return method


def preload() -> list[str]:
    """The modules the fork server preloads: :data:`PRELOAD`, and torch once this process has it."""
    return [*PRELOAD, *(["torch"] if "torch" in sys.modules else [])]


def _standby() -> None:
    """Before this process's first object store: fork the standby zygote, if workers may start
    from one (:func:`~guideloom._runtime.processes.zygote.fork_standby`); not in a process
    multiprocessing started (a worker that opens its storage starts no workers), nor where
    ``GUIDELOOM_STANDBY_ZYGOTE=0`` (or ``false``, ``no``, ``off``) says the process will not use
    process workers, nor where :data:`START_ENV` names another method (or none it knows: the
    loader that starts workers says so, not the opening of a store)."""
    try:
        here = start_method() == "here"
    except ValueError:
        here = False
    if (
        here
        and os.environ.get("GUIDELOOM_STANDBY_ZYGOTE", "1").strip().lower() not in _OFF
        and multiprocessing.parent_process() is None
        and "forkserver" in multiprocessing.get_all_start_methods()
    ):
        fork_standby(import_each(preload()))


_objstore.BEFORE_FIRST_STORE.append(_standby)


def worker_context(spec: bytes = b"", *, here: bool = True) -> ForkServerContext | SpawnContext | ForkContext:
    """The multiprocessing context a new pool's workers start in, by :func:`start_method`. For
    ``"here"``: forks from this process (each start forks them on the caller's thread), if this
    thread is its only one and ``here``; else the standby zygote, where the workers' ``spec``
    (their pickled dataset and collate) finds in it what it names of ``__main__``; else the fork
    server, told what to preload.

    The fork server is one per process, shared with any other user of ``forkserver``: the
    modules are added to its preload list, and take effect when it starts (with the first
    pool's first worker: never here). The list's default, ``["__main__"]``, is replaced: the
    server does not import the main script (each worker does, when it starts).
    """
    method = start_method()
    if method == "fork":
        return multiprocessing.get_context("fork")
    if method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    wanted = preload()
    if method == "here":
        standby = standby_for(spec)
        if here and may_fork_here(standby):
            import_each(wanted)  # (once here, not in each worker)
            return HereContext()
        if standby is not None:
            return ZygoteContext(standby)
    ctx = multiprocessing.get_context("forkserver")
    current = fork_server_preload()
    if current == ["__main__"]:
        current = []
    missing = [m for m in wanted if m not in current]
    if missing:
        ctx.set_forkserver_preload(current + missing)
    return ctx


def check_not_bootstrapping() -> None:
    """Refuse to start workers from a worker that is still importing the main module.

    Each worker imports the main script, as multiprocessing's ``spawn`` and ``forkserver`` do;
    one without the ``if __name__ == "__main__":`` guard would start the loader again in every
    worker.
    """
    if bootstrapping():
        raise RuntimeError(
            "guideloom: a loader with parallel_method='process' was started while a worker process "
            "was still importing the main module. Each worker process imports your main script "
            "(as multiprocessing's 'spawn' and 'forkserver' start methods do): put the code that "
            'creates and iterates the loader under `if __name__ == "__main__":` (or in a function '
            "called from there)."
        )
