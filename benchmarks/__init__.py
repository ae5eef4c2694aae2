"""guideloom's benchmarks: scripts that print figures (never timed unit tests)."""

from __future__ import annotations


def summary(doc: str | None) -> str | None:
    """The first paragraph of a module docstring, on one line: a ``--help`` description that ends
    where its sentence ends (a docstring's first line may stop mid-sentence)."""
    if not doc:
        return None
    return " ".join(doc.strip().split("\n\n", 1)[0].split())
