"""The benchmarks reach guideloom's internals through ``benchmarks/_internals.py`` only.

A rename inside guideloom then fails here, in CI, rather than in a benchmark run later; and a
benchmark that imports a private module directly fails the scan below.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np

import guideloom as gl
from tests.support import ROOT


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
