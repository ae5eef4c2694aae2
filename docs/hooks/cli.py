"""mkdocs hook: the command-line page is generated from the ``guideloom`` argparse parser.

``docs/cli.md`` holds the marker ``<!-- guideloom-cli -->``; at build time it is replaced by the
usage and help of ``guideloom`` and of each subcommand, as ``guideloom COMMAND --help`` prints
them, so the page cannot drift from the parser.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

MARKER = "<!-- guideloom-cli -->"
#: Help is wrapped at this width whatever the terminal building the docs is.
WIDTH = "100"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    """Markdown for the top-level help and one section per subcommand."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's parser, whatever else is installed
    from guideloom._cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        parts = ["## `guideloom`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in _subcommands(parser).items():
            parts += [f"## `guideloom {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
