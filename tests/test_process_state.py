"""Process-wide state kept in one place (``guideloom/_process.py``): no other module registers an
exit hook or keeps a registry of live objects, and what is stopped at interpreter exit is stopped
in the documented order."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import guideloom as gl
from tests.support.processes import run_script

PACKAGE = Path(__file__).resolve().parents[1] / "guideloom"
#: The modules that may: the one that keeps the process's state, and the one that wraps the
#: private CPython API it registers its threads' exit hook with.
ALLOWED = {PACKAGE / "_process.py", PACKAGE / "_compat.py"}
#: Names that register an exit hook, wherever they are referred to.
EXIT_HOOKS = {"at_threads_exit", "_register_atexit"}


def _shared_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run once per process: at module level and in class bodies (blocks
    under ``if``, ``try``, ``with`` included), not in functions."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield stmt
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list):
                yield from _shared_statements([s for s in inner if isinstance(s, ast.stmt)])
            if field == "handlers" and isinstance(inner, list):
                for handler in inner:
                    yield from _shared_statements(handler.body)


def offences(source: str) -> list[tuple[int, str]]:
    """Where ``source`` registers an exit hook or makes a process-wide ``WeakSet``."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (node.value.id, node.attr) == ("atexit", "register")
        ):
            found.append((node.lineno, "atexit.register"))
        if isinstance(node, ast.ImportFrom) and node.module == "atexit":
            found.append((node.lineno, "from atexit import"))
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if isinstance(node, ast.alias):
            name = node.name
        if name in EXIT_HOOKS:
            found.append((getattr(node, "lineno", 0), str(name)))
    for stmt in _shared_statements(tree.body):
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)):
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call):
                    func = node.func
                    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if called == "WeakSet":
                        found.append((node.lineno, "a process-wide WeakSet"))
    return sorted(set(found))


def test_the_check_finds_each_kind_of_exit_hook_and_process_wide_weakset() -> None:
    source = textwrap.dedent(
        """
        import atexit, threading, weakref
        from atexit import register
        from guideloom._compat import at_threads_exit
        LIVE = weakref.WeakSet()
        class Registry:
            seen = WeakSet()
        if True:
            try:
                atexit.register(print)
            except ImportError:
                threading._register_atexit(print)
        @atexit.register
        def bye(): at_threads_exit(print)
        def per_call():
            return weakref.WeakSet()  # a local one: not process-wide
        """
    )
    assert offences(source) == [
        (3, "from atexit import"), (4, "at_threads_exit"),
        (5, "a process-wide WeakSet"), (7, "a process-wide WeakSet"), (10, "atexit.register"),
        (12, "_register_atexit"), (13, "atexit.register"), (14, "at_threads_exit"),
    ]  # fmt: skip


def test_no_module_but_the_process_module_registers_exit_hooks_or_keeps_a_weakset() -> None:
    """Exit hooks and registries of live objects belong to ``guideloom/_process.py`` (a
    :class:`~guideloom._process.Live` registry), where their order at exit is written down."""
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}": None
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in ALLOWED
        for line, what in offences(path.read_text())
    }
    assert list(found) == []


def test_process_workers_open_at_exit_are_stopped_by_their_pool_not_terminated(tmp_path: Path) -> None:
    """A script that exits with its loader's workers up: each pool is closed once the threads are
    joined and before ``multiprocessing``'s exit function, which would terminate the workers
    (SIGTERM, exit code -15) instead of the pool's stop (the worker ends its loop: exit code 0)."""
    stream = tmp_path / "stream"
    gl.write_stream(stream, np.arange(4096, dtype=np.uint16))
    script = tmp_path / "leave.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import atexit

            procs = []

            def report():  # registered first: runs after every other exit hook
                print("exit codes", *sorted({{p.proc.exitcode for p in procs}}), flush=True)

            atexit.register(report)

            import threading
            import torch
            import guideloom as gl

            def rows(samples):
                return torch.from_numpy(samples[0].astype("int64"))

            if __name__ == "__main__":
                loader = gl.StatefulDataLoader.from_storage(
                    gl.open_stream({str(stream)!r}), rows, sequence_length=16, num_workers=2,
                    parallel_method="process", device=torch.device("cpu"),
                )
                loader.open()
                it = iter(loader)
                next(it)
                pool = it._driver.procs.pool
                pool.start()  # the workers are up
                procs.extend(pool.procs)
                next(it)
                # a thread of the script's that still iterates when the main thread ends
                threading.Thread(target=lambda: print("thread", len([next(it) for _ in range(3)]))).start()
            """
        )
    )
    out = run_script(script).stdout.split("\n")
    assert out[:2] == ["thread 3", "exit codes 0"], out
