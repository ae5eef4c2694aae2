"""Real English prose for the Parquet benchmarks, assembled offline from what this machine holds.

Sources, in this order, each file or module one document (cut at a paragraph to at most
``MAX_DOC`` characters; exact duplicates dropped): the docstrings of the Python standard
library's modules (module, class and function docstrings, joined), ``pydoc_data``'s help topics,
the installed Python packages' descriptions (their ``METADATA``), Debian's change logs and
copyright notices (``/usr/share/doc``) and the manual pages (``/usr/share/man``, English, roff
markup stripped). The documents are then put in a seeded random order (so that every shard
holds all kinds) and the first ones that make up ``target`` bytes are kept. The figures say
how many documents and bytes were found: another machine finds other files, so the corpus is
described by its sizes, not by its contents.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

MAX_DOC = 100_000
_ROFF_ESCAPES = re.compile(r"\\f[BIRPC]|\\f\(..|\\f\[[^]]*\]|\\s[+-]?\d|\\&|\\\^|\\\||\\c|\\e")
_ROFF_CHARS = {
    r"\-": "-",
    r"\(em": "--",
    r"\(en": "-",
    r"\(bu": "*",
    r"\(aq": "'",
    r"\(dq": '"',
    r"\(lq": '"',
    r"\(rq": '"',
    r"\(co": "(c)",
    r"\ ": " ",
    r"\~": " ",
    r"\(oq": "'",
    r"\(cq": "'",
}


def _cut(text: str) -> str:
    text = text.strip()
    if len(text) <= MAX_DOC:
        return text
    at = text.rfind("\n\n", 0, MAX_DOC)
    return text[: at if at > MAX_DOC // 2 else MAX_DOC]


def _docstrings() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    parts.append(doc)
        if parts:
            yield "\n\n".join(parts)


def _topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def _metadata() -> Iterator[str]:
    roots = {Path(p) for p in sys.path if p.endswith("site-packages")}
    for root in sorted(roots):
        for meta in sorted(root.glob("*.dist-info/METADATA")):
            text = meta.read_text(encoding="utf-8", errors="replace")
            body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
            if len(body) > 200:
                yield body


def _roff(text: str) -> str:
    out = []
    for line in text.splitlines():
        if line.startswith(("'\\\"", '.\\"', "'''")):
            continue
        if line.startswith("."):
            macro, _, rest = line.partition(" ")
            if macro in (".SH", ".SS", ".B", ".I", ".BR", ".IR", ".BI", ".IB", ".RB", ".RI", ".TP", ".IP"):
                line = rest.replace('"', "")
            else:
                continue
        for k, v in _ROFF_CHARS.items():
            line = line.replace(k, v)
        out.append(_ROFF_ESCAPES.sub("", line))
    return "\n".join(out)


def _gz(path: Path) -> str:
    try:
        return gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    except (OSError, EOFError):
        return ""


def _debian_docs() -> Iterator[str]:
    root = Path("/usr/share/doc")
    if root.is_dir():
        for path in sorted(root.glob("*/changelog*.gz")):
            yield _gz(path)
        for path in sorted(root.glob("*/copyright")):
            yield path.read_text(encoding="utf-8", errors="replace")


def _man_pages() -> Iterator[str]:
    root = Path("/usr/share/man")
    if root.is_dir():
        for path in sorted(root.glob("man*/*.gz")):
            yield _roff(_gz(path))


def documents(target: int, seed: int = 0) -> list[str]:
    """Documents of real prose, about ``target`` bytes of UTF-8 in all (fewer where the machine
    holds less), in a seeded random order."""
    seen: set[bytes] = set()
    found: list[str] = []
    for source in (_docstrings, _topics, _metadata, _debian_docs, _man_pages):
        for doc in source():
            doc = _cut(doc)
            if len(doc) < 200:
                continue
            key = hashlib.sha256(doc.encode()).digest()
            if key not in seen:
                seen.add(key)
                found.append(doc)
    order = np.random.default_rng(seed).permutation(len(found))
    out, total = [], 0
    for i in order.tolist():
        if total >= target:
            break
        out.append(found[i])
        total += len(found[i].encode())
    return out


if __name__ == "__main__":
    docs = documents(int(float(sys.argv[1])) if len(sys.argv) > 1 else 75_000_000)
    sizes = np.asarray([len(d.encode()) for d in docs])
    print(
        f"{len(docs)} documents, {sizes.sum() / 1e6:.1f} MB, median {int(np.median(sizes))} B, "
        f"max {sizes.max()} B"
    )
