"""The benchmarks reach guideloom's internals through ``benchmarks/_internals.py`` only.

A rename inside guideloom then fails here, in CI, rather than in a benchmark run later; and a
benchmark that imports a private module directly fails the scan below.
"""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import guideloom as gl
from tests.support import ROOT
from tests.support.remote import collate


def _private_imports(path: Path) -> list[str]:
    """The private guideloom modules ``path`` imports (``guideloom._x``, ``guideloom.storage._y``,
    ``from guideloom import _x``), at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [
            n
            for n in names
            if n.startswith("guideloom.")
            and any(p.startswith("_") and not p.startswith("__") for p in n.split(".")[1:])
        ]
    return found


def test_every_internal_the_benchmarks_name_exists() -> None:
    import benchmarks._internals as internals  # an ImportError here: a name moved in guideloom

    missing = [name for name in internals.__all__ if getattr(internals, name, None) is None]
    assert not missing, f"benchmarks/_internals.py names what guideloom no longer has: {missing}"


def test_benchmarks_import_guideloom_internals_through_one_module() -> None:
    scanned = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(scanned) > 20  # the scan sees the benchmarks
    offenders = {
        str(p.relative_to(ROOT)): imports
        for p in scanned
        if p.name != "_internals.py"
        if (imports := _private_imports(p))
    }
    assert not offenders, f"import these from benchmarks._internals (or the public API): {offenders}"


def test_the_scan_sees_a_private_import(tmp_path: Path) -> None:
    f = tmp_path / "bench.py"
    f.write_text(
        "import guideloom as gl\nfrom guideloom import StatefulDataLoader\n"
        "def f():\n    from guideloom.storage._write import _writer\n    import guideloom._core.plan\n"
        "    from guideloom import __version__\n"
        "    from guideloom import _process\n"
    )
    assert _private_imports(f) == [
        "guideloom.storage._write._writer",
        "guideloom._core.plan",
        "guideloom._process",
    ]


def test_written_block_bytes_sets_the_block_size_of_what_is_written(tmp_path: Path) -> None:
    from benchmarks._internals import DEFAULT_BLOCK_BYTES, written_block_bytes

    tokens = np.arange(10_000, dtype=np.uint16)
    with written_block_bytes(4096):
        gl.write_stream(tmp_path / "small", [tokens])
    gl.write_stream(tmp_path / "default", [tokens])

    def block_size(name: str) -> int:
        doc = json.loads((tmp_path / name / "manifest.json").read_text())
        return int(doc["fields"]["tokens"]["files"][0]["blocks"]["size"])

    assert block_size("small") == 4096
    assert block_size("default") == DEFAULT_BLOCK_BYTES != 4096


def _guideloom_private_members() -> set[str]:
    """The private attribute names guideloom's own objects carry: ``self._x = ...`` and the
    ``_x`` entries of a ``__slots__``, anywhere in the package."""
    names: set[str] = set()
    for path in (ROOT / "guideloom").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                names |= {
                    c.value
                    for c in ast.walk(node.value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_members_reached(path: Path, members: set[str]) -> list[str]:
    """``x._name`` in ``path`` where ``_name`` is one of guideloom's private members and ``x`` is
    not ``self``/``cls`` (a benchmark's own class may use its own private names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in members
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif (  # getattr(x, "_name"[, default]): the same reach, by name
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in members
        ):
            found.append(f"{path.name}:{node.lineno}: {node.func.id} {node.args[1].value}")
    return found


def test_benchmarks_reach_guideloom_private_members_through_one_module() -> None:
    """The rule: no benchmark but ``_internals.py`` reads an attribute, on anything but its own
    ``self``, named as one of guideloom's private members (``._state``, ``._remote``, ...)."""
    members = _guideloom_private_members()
    assert {"_state", "_remote"} <= members  # the scan sees guideloom's private members
    offenders = [
        hit
        for p in sorted((ROOT / "benchmarks").rglob("*.py"))
        if p.name != "_internals.py"
        for hit in _private_members_reached(p, members)
    ]
    assert not offenders, f"reach these through a function in benchmarks/_internals.py: {offenders}"


def test_the_scan_sees_a_private_member_chain(tmp_path: Path) -> None:
    f = tmp_path / "bench.py"
    f.write_text(
        "def f(loader, storage):\n    pool = loader._state.life.pool\n"
        "    held = storage._remote.fetcher.held\n    return loader.stats(), self._state\n"
        "def g(storage):\n    return getattr(storage, '_remote', None)\n"
    )
    assert sorted(_private_members_reached(f, {"_state", "_remote"})) == [
        "bench.py:2: ._state",
        "bench.py:3: ._remote",
        "bench.py:6: getattr _remote",
    ]


def test_worker_pool_is_the_process_workers_pool(tmp_path: Path) -> None:
    from benchmarks._internals import worker_pool

    gl.write_stream(tmp_path / "s", [np.arange(40_000, dtype=np.uint16)])
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(tmp_path / "s"),
        collate,
        sequence_length=64,
        local_batch_size=4,
        num_workers=2,
        parallel_method="process",
    )
    assert worker_pool(loader) is None  # not started before open()
    try:
        loader.open()
        next(iter(loader))
        pool = worker_pool(loader)
        assert pool is not None
        while pool.starting():
            time.sleep(0.01)
        pids = [p.proc.pid for p in pool.procs if p is not None]
        assert len(pids) == 2 and os.getpid() not in pids
    finally:
        loader.close()
    assert worker_pool(loader) is None  # closed: no pool left running


def test_held_blocks_of_a_remote_storage_stay_within_its_window(tmp_path: Path) -> None:
    from benchmarks._internals import HeldBlocks, held_blocks
    from guideloom_dev.servers import Nginx, nginx_binary

    if nginx_binary() is None:
        pytest.skip("nginx is not installed here (CI installs it with .ci/install-servers.sh)")
    gl.write_stream(tmp_path / "www" / "s", [np.arange(200_000, dtype=np.uint16)], shard_bytes=100_000)
    server = Nginx(tmp_path / "www")
    try:
        storage = gl.open_stream(f"{server.url}/s")
        loader = gl.StatefulDataLoader.from_storage(
            storage, collate, sequence_length=64, local_batch_size=16, shuffle=True, shuffle_block_size="auto"
        )
        with loader:
            assert sum(1 for _ in loader) > 0
        held = held_blocks(storage)
        assert isinstance(held, HeldBlocks)
        assert 0 < held.peak_nbytes <= storage.read_window_bytes
    finally:
        server.stop()
