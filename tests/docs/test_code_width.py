"""Code on the docs pages fits the page: no line of a code block is wider than 88 characters.

The site wraps a longer line at the block's left edge (docs/assets/extra.css), which keeps every
character on screen but breaks the indentation a reader follows; a line written to fit needs no
wrapping.
"""

from __future__ import annotations

import re

import pytest

from tests.support.docs import DOCS

WIDTH = 88
_FENCE = re.compile(r"^\s*(```|~~~)")


def wide_code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line inside a fenced code block wider than :data:`WIDTH`."""
    wide, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
        elif inside and len(line) > WIDTH:
            wide.append((number, line))
    return wide


PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", PAGES)
def test_code_lines_fit_the_page(page: str) -> None:
    wide = wide_code_lines((DOCS / page).read_text())
    assert not wide, f"{page}: code lines wider than {WIDTH} characters:\n" + "\n".join(
        f"{page}:{number}: {line}" for number, line in wide
    )


def test_the_check_finds_a_wide_code_line_only() -> None:
    long = "x = 1  # " + "y" * WIDTH
    text = f"prose {long}\n\n```python\nz = 2\n{long}\n```\n\n    ~~~\n    {long}\n    ~~~\n{long}\n"
    assert wide_code_lines(text) == [(5, long), (9, "    " + long)]
