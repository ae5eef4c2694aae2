"""mkdocs hook: serve the benchmark chart from where the benchmark suite writes it.

``docs/benchmarks.md`` is written by ``python -m benchmarks report`` (and ``suite``) and links the chart as
``../benchmarks/results/results.png`` (right on GitHub, outside ``docs_dir`` for mkdocs). The
hook adds every file of ``benchmarks/results/`` that a page links to the site under
``assets/benchmarks/`` and points the page's links there, so the site always shows the latest
chart without a copy in ``docs/`` going stale.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SITE_DIR = "assets/benchmarks"
LINK = re.compile(r"\((?:\.\./)+benchmarks/results/([A-Za-z0-9_.-]+\.(?:png|svg))\)")


def on_files(files: Files, config: Any) -> Files:
    for path in sorted(RESULTS.glob("*.png")) + sorted(RESULTS.glob("*.svg")):
        files.append(File.generated(config, f"{SITE_DIR}/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    depth = page.file.src_uri.count("/")
    prefix = "../" * depth
    return LINK.sub(lambda m: f"({prefix}{SITE_DIR}/{m.group(1)})", markdown)
