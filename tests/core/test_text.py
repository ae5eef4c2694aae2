"""Counts in messages: the noun in the right number."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from guideloom._core.text import plural


@given(st.integers(-(10**6), 10**6))
def test_one_is_singular_every_other_count_plural(n: int) -> None:
    assert plural(n, "row group") == f"{n} row group" + ("" if abs(n) == 1 else "s")
    word = "index" if abs(n) == 1 else "indexes"
    assert plural(n, "index", "indexes", shown=f"{n:,}") == f"{n:,} {word}"
