"""Words for messages: a count with its noun in the right number."""

from __future__ import annotations

__all__ = ["plural"]


def plural(n: int, noun: str, many: str | None = None, *, shown: str | None = None) -> str:
    """``n`` (or ``shown``, its text: ``f"{n:,}"``, say) and ``noun``, in the plural (``many``,
    else ``noun + "s"``) unless ``n`` is 1 or -1: ``plural(1, "token")`` is ``"1 token"``,
    ``plural(3, "row group")`` is ``"3 row groups"``."""
    word = noun if abs(n) == 1 else (many if many is not None else noun + "s")
    return f"{n if shown is None else shown} {word}"
