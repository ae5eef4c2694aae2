"""The package's imports point down its layers, and no module imports itself through others.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING`` alike, since
each is a dependency a reader has to follow. The layers, from the bottom:

0. ``_errors``, ``types``, ``_loop``, ``_compat``, ``_process``: exceptions, public types, the
   event-loop thread, the private CPython APIs used, what is kept per process
1. ``_core``: pure planning (no I/O)
2. ``storage``: where samples come from, how datasets are written
3. ``_datasets``: observation to sample
4. ``_runtime``: the ways of running an epoch
5. ``_loader``: the loader's parts behind the facade
6. ``pytorch``: the facade
7. ``_cli``, ``__init__``, ``__main__``: the command line and the public names
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "guideloom"

LAYERS: list[tuple[str, ...]] = [
    ("guideloom._errors", "guideloom.types", "guideloom._loop", "guideloom._compat", "guideloom._process"),
    ("guideloom._core",),
    ("guideloom.storage",),
    ("guideloom._datasets",),
    ("guideloom._runtime",),
    ("guideloom._loader",),
    ("guideloom.pytorch",),
    ("guideloom._cli", "guideloom.__main__", "guideloom"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """The package's modules that ``name`` imports, with the line of each import."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _resolve(alias.name, known, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if candidate in known:  # ``from package import module``
                    yield candidate, node.lineno
                else:
                    yield from _resolve(base, known, node.lineno)


def _resolve(dotted: str, known: set[str], line: int) -> Iterator[tuple[str, int]]:
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    if dotted.startswith("guideloom"):
        yield dotted, line


def graph() -> dict[str, dict[str, int]]:
    mods = modules()
    known = set(mods)
    out: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges = out.setdefault(name, {})
        for target, line in _imports(name, path, known):
            if target != name and not name.startswith(target + "."):  # a package's own __init__
                edges.setdefault(target, line)
    return out


def layer(name: str) -> int:
    best, depth = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    assert best >= 0, f"{name} belongs to no layer: add it to LAYERS"
    return best


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    for name in modules():
        layer(name)


def test_imports_point_down() -> None:
    mods = modules()
    upward = [
        f"{mods[src].relative_to(PACKAGE.parent)}:{line} imports {dst} "
        f"(layer {layer(dst)} above {layer(src)})"
        for src, targets in graph().items()
        for dst, line in targets.items()
        if layer(dst) > layer(src)
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    cycles = _cycles(graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("layer_index", range(len(LAYERS)))
def test_layers_are_not_empty(layer_index: int) -> None:
    assert any(layer(name) == layer_index for name in modules())


def _third_party(path: Path) -> set[str]:
    """The top-level names of what ``path`` imports from outside the standard library and guideloom."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.partition(".")[0])
    return roots - set(sys.stdlib_module_names) - {"guideloom", "__future__"}


#: What ``_core`` may not import from the standard library: files, processes, threads, sockets,
#: event loops (its work is arithmetic; the layers above it do the I/O and the waiting).
IO_MODULES = frozenset(
    {"_thread", "asyncio", "concurrent", "ctypes", "fcntl", "glob", "gzip", "http", "importlib", "io",
     "mmap", "multiprocessing", "os", "pathlib", "queue", "selectors", "shutil", "signal", "socket",
     "sqlite3", "ssl", "subprocess", "tempfile", "threading", "time", "urllib", "zipfile"}
)  # fmt: skip


#: numpy's functions that read or write files.
NUMPY_IO = frozenset(
    {"fromfile", "genfromtxt", "load", "loadtxt", "memmap", "save", "savetxt", "savez", "tofile"}
)


def _impurities(path: Path) -> set[str]:
    """What in ``path`` is not pure arithmetic: imports beyond numpy and the standard library's
    non-I/O modules, calls of the builtin ``open`` and numpy's file I/O."""
    tree = ast.parse(path.read_text(), str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.partition(".")[0])
    found = (_third_party(path) - {"numpy"}) | (roots & IO_MODULES)
    calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
    if any(isinstance(f, ast.Name) and f.id == "open" for f in calls):
        found.add("open()")
    found.update(  # numpy's own file I/O
        f"np.{f.attr}()" for f in calls if isinstance(f, ast.Attribute) and f.attr in NUMPY_IO
    )
    return found


def test_the_core_is_pure_arithmetic() -> None:
    """``_core`` (plans, orders, schedules, layouts) needs numpy alone: no torch, no event loop,
    no files, threads or processes."""
    impure = {
        f"{path.relative_to(PACKAGE.parent)} uses {sorted(extra)}"
        for name, path in modules().items()
        if layer(name) == 1 and (extra := _impurities(path))
    }
    assert not impure, "the core does more than arithmetic:\n" + "\n".join(sorted(impure))


def test_the_purity_check_sees_io(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import asyncio, socket\nfrom threading import Lock\nimport numpy\n\n"
        "def f():\n    import torch, time\n    np.load('y')\n    return open('x')\n"
    )
    assert _impurities(sample) == {"asyncio", "socket", "threading", "torch", "time", "open()", "np.load()"}


#: The most lines a module of the package has, and the most modules a folder of ``storage``
#: holds (its backends are many): past them a module is split along its concerns, a folder into
#: subfolders a newcomer can name.
MAX_MODULE_LINES = 600
MAX_FOLDER_MODULES = 10


def test_every_module_is_short_enough_to_read() -> None:
    long = {
        f"{p.relative_to(PACKAGE.parent)}: {n} lines"
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, (
        f"modules over {MAX_MODULE_LINES} lines (split them along their concerns): {sorted(long)}"
    )


def test_storage_is_no_long_flat_list() -> None:
    storage = PACKAGE / "storage"
    crowded = {
        f"{d.relative_to(PACKAGE.parent)}: {n} modules"
        for d in [storage, *(p for p in storage.rglob("*") if p.is_dir() and p.name != "__pycache__")]
        if (n := len(list(d.glob("*.py")))) > MAX_FOLDER_MODULES
    }
    assert not crowded, f"folders of more than {MAX_FOLDER_MODULES} modules: {sorted(crowded)}"
