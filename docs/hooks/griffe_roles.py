"""Griffe extension: Sphinx roles in docstrings (``:class:`~a.B```) rendered as inline code.

guideloom's docstrings cross-reference with Sphinx roles, which Markdown shows literally; this
turns each into a code span of the name it shows (``B`` for ``~a.B``, ``a.B`` otherwise) before
mkdocstrings renders the docstring. Registered in mkdocs.yml under the python handler's
``extensions``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _shown(match: re.Match[str]) -> str:
    tilde, target = match.group(1), match.group(2).strip()
    if target.endswith(">") and "<" in target:  # :class:`text <target>`
        return f"`{target.split('<', 1)[0].strip()}`"
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def plain_roles(text: str) -> str:
    """``text`` with every Sphinx role replaced by a code span."""
    return ROLE.sub(_shown, text)


class SphinxRolesAsCode(griffe.Extension):
    """Rewrite the docstring of every object griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
