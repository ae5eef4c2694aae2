"""Read windows aligned to a block shuffle's mixing windows (``windows(..., span=S)``)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._core.plan import EpochPlan
from guideloom._core.schedule import windows


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 2000),
    batch=st.integers(1, 16),
    world=st.integers(1, 4),
    offset=st.integers(0, 2000),
    span=st.integers(1, 300),
    largest=st.integers(1, 80),
    first=st.integers(0, 5),
)
def test_span_windows_cover_the_plan_in_order_and_end_at_span_ends(
    n: int, batch: int, world: int, offset: int, span: int, largest: int, first: int
) -> None:
    offset = min(offset, n)
    plan = EpochPlan(n, batch, world, 0, drop_last=False, start_offset=offset)
    got = list(windows(plan, first, largest, span))
    steps = [spec.step for w in got for spec in w]
    assert steps == list(range(first, len(plan)))
    if not got:
        return
    assert len(got[0]) == 1, "the first batch is read alone (a fast first batch)"
    g = plan.global_batch_size
    for w, after in itertools.pairwise(got[1:]):
        assert 1 <= len(w) <= largest
        if len(w) < largest:  # not cut by the cap: the window ends where its span ends
            start = offset + w[0].step * g
            span_end = (start // span + 1) * span
            assert offset + w[-1].step * g < span_end <= offset + after[0].step * g


def test_without_a_span_windows_double_up_to_the_largest() -> None:
    plan = EpochPlan(1000, 1, 1, 0, drop_last=False)
    sizes = [len(w) for w in windows(plan, 0, 16)]
    assert sizes[:6] == [1, 2, 4, 8, 16, 16]


def test_one_window_per_span_when_batches_tile_it() -> None:
    plan = EpochPlan(4096, 16, 1, 0, drop_last=False)
    sizes = [len(w) for w in windows(plan, 0, 4096, span=1024)]
    assert sizes == [1, 63, 64, 64, 64], "batch 0 alone, then the rest of span 0, then a span each"
