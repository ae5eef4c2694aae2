"""The python code blocks of a docs page, as the page-runs-as-is tests run them.

A page's blocks run top to bottom as one program (later blocks use what earlier ones defined). A
block that is not meant to run on its own (a fragment, an object-store URL, a multi-rank
program) is marked by the line ``<!-- fragment -->`` right before its opening fence.
"""

from __future__ import annotations

import re
from pathlib import Path

FRAGMENT = "<!-- fragment -->"
_FENCE = re.compile(r"^(?P<marker>[^\n]*)\n```python\n(?P<code>.*?)^```$", re.M | re.S)


def python_blocks(page: Path) -> tuple[list[str], int]:
    """(the runnable blocks, how many fragments were skipped)."""
    text = "\n" + page.read_text()
    runnable, fragments = [], 0
    for m in _FENCE.finditer(text):
        if m.group("marker").strip() == FRAGMENT:
            fragments += 1
        else:
            runnable.append(m.group("code"))
    return runnable, fragments
