"""The checkpoint's ``history`` (``guideloom._core.provenance``) checked as arithmetic: every
history a run saves is accepted as it is, and an entry that does not add up is refused by name
rather than let ``explain()`` name other samples than a step read."""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from guideloom._core import provenance
from guideloom._core.provenance import History, Segment, check_history, parse_history

Saved = tuple[str, int, int]  # (history, epoch, observation_offset) of a checkpoint


@st.composite
def saved_checkpoints(draw: st.DrawFn, max_segments: int = 256) -> list[Saved]:
    """The checkpoints of a run that resumes again and again: from its last checkpoint, from an
    earlier one (a rollback), or from a hand-made one without a history, each time with a batch
    size and world size of its own, over epochs of ``n`` observations (``drop_last=False``)."""
    n = draw(st.integers(1, 60))
    history = History()
    saved: list[Saved] = []
    with mock.patch.object(provenance, "MAX_SEGMENTS", max_segments):
        _run(draw, n, history, saved)
    return saved


def _run(draw: st.DrawFn, n: int, history: History, saved: list[Saved]) -> None:
    epoch, offset = 0, 0
    for _ in range(draw(st.integers(1, 10))):
        how = draw(st.sampled_from(["last", "last", "earlier", "bare"]))
        if how == "earlier" and saved:
            text, epoch, offset = draw(st.sampled_from(saved))
            history = check_history(parse_history(text), epoch, offset)
        elif how == "bare":  # the page's five keys: a position, no history
            history = History()
            offset = draw(st.integers(0, n - 1))
        b, w = draw(st.integers(1, 5)), draw(st.integers(1, 4))
        history.begin(epoch, offset, b, w)
        for _ in range(draw(st.integers(0, 12))):
            offset += b * w
            if offset >= n:
                epoch, offset = epoch + 1, 0
                break
        saved.append((history.encode(), epoch, offset))


def _mapping(history: History, epochs: range, steps: int) -> dict[tuple[int, int], tuple[int, int] | None]:
    """Where each step's global batch starts and how many observations it holds."""
    out: dict[tuple[int, int], tuple[int, int] | None] = {}
    for e in epochs:
        for s in range(steps):
            seg = history.segment(e, s)
            out[e, s] = (
                None
                if seg is None
                else (seg.offset + (s - seg.step) * seg.global_batch_size, seg.global_batch_size)
            )
    return out


@settings(max_examples=150, deadline=None)
@given(data=st.data(), max_segments=st.sampled_from([3, 256]))
def test_every_history_a_run_saves_is_accepted_and_round_trips(data: Any, max_segments: int) -> None:
    # a history of at most 3 entries: the oldest are dropped, as in a run of many resumes
    runs = data.draw(saved_checkpoints(max_segments))
    with mock.patch.object(provenance, "MAX_SEGMENTS", max_segments):
        for text, epoch, offset in runs:
            loaded = check_history(parse_history(text), epoch, offset)
            kept = [s for s in parse_history(text).segments if s.epoch >= epoch - 1]
            assert loaded.segments == kept
            assert check_history(parse_history(loaded.encode()), epoch, offset).segments == kept


@settings(max_examples=300, deadline=None)
@given(runs=saved_checkpoints(), data=st.data())
def test_an_entry_changed_so_that_steps_map_elsewhere_is_refused_by_name(
    runs: list[Saved], data: Any
) -> None:
    text, epoch, offset = data.draw(st.sampled_from(runs))
    segments = parse_history(text).segments
    if not segments:
        return
    i = data.draw(st.integers(0, len(segments) - 1))
    field = data.draw(st.sampled_from(["epoch", "offset", "step"]))
    old = getattr(segments[i], field)
    new = data.draw(st.integers(0, old + 30).filter(lambda v: v != old))
    mutated = list(segments)
    mutated[i] = segments[i]._replace(**{field: new})
    first = i == 0 or segments[i - 1].epoch != segments[i].epoch
    g = segments[i].global_batch_size
    # the first entry of an epoch at another offset of the same batch: what a resume from a
    # checkpoint without a history saves at either offset, nothing to tell them apart
    assume(not (first and field == "offset" and -(-new // g) == segments[i].step))
    steps = max(s.step for s in segments) + 70
    before = _mapping(check_history(History(segments), epoch, offset), range(epoch - 1, epoch + 1), steps)
    try:
        loaded = check_history(parse_history(History(mutated).encode()), epoch, offset)
    except ValueError as exc:
        assert (
            f"history[{i}" in str(exc) or f"history[{i + 1}]" in str(exc) or "observation_offset" in str(exc)
        )
        return
    after = _mapping(loaded, range(epoch - 1, epoch + 1), steps)

    # accepted: no step taken before the position (later ones are the loader's own) that the
    # history mapped maps to other observations now (at most, a step has no history left)
    taken = [k for k, m in before.items() if m is not None and (k[0] < epoch or m[0] < offset)]
    assert all(after[k] is None or after[k] == before[k] for k in taken), (segments, mutated)


@pytest.mark.parametrize(
    ("history", "epoch", "offset", "match"),
    [
        ("0:0:0:2:1;0:10:3:4:1", 0, 14, r"history\[1\]\.step is 3, expected 5"),  # a step going 5 -> 3
        ("0:0:0:4:1;0:10:2:2:1", 0, 14, r"history\[1\]\.offset is 10, not on a batch boundary"),
        ("0:0:0:2:1000000000000000000", 0, 0, r"history\[0\]\.world_size is 10+, expected an int in \[1, "),
        ("0:0:0:0:1", 0, 0, r"history\[0\]\.local_batch_size is 0"),
        ("0:8:1:2:1", 0, 8, r"history\[0\]\.step is 1, expected 4: the first entry of epoch 0"),
        ("0:0:0:2:2", 0, 6, r"observation_offset 6 is not on a batch boundary of history\[0\]"),
        ("0:0:0:2:1;1:4:2:2:1", 1, 2, r"history\[1\]\.offset is 4: .* lies past the checkpoint's position"),
        ("0:0:0:2:1;2:0:0:2:1", 1, 2, r"history\[1\]\.epoch is 2"),
        ("0:4:2:2:1;0:0:0:2:1", 0, 8, r"history\[1\] .* does not come after history\[0\]"),
        ("0:0:0:2:1;;", 0, 0, r"history\[1\] is ''"),
        ("0:0:0:+2:1", 0, 0, r"history\[0\] is '0:0:0:\+2:1'"),
        (["0:0:0:2:1"], 0, 0, "'history' must be a str"),
    ],
)
def test_a_history_that_does_not_add_up_is_refused_by_name(
    history: Any, epoch: int, offset: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_history(parse_history(history), epoch, offset)


def test_entries_of_epochs_no_step_maps_through_are_dropped() -> None:
    kept = check_history(parse_history("0:0:0:2:1;1:0:0:2:1;2:0:0:3:1"), 3, 0).segments
    assert kept == [Segment(2, 0, 0, 3, 1)]


@pytest.mark.parametrize("entries", [10**6, 10**7])
def test_an_oversized_history_is_refused_before_it_is_read(entries: int) -> None:
    text = ";".join(["0:0:0:1:1"] * entries)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"characters long, more than the 256 entries a loader saves"):
        parse_history(text)
    assert time.perf_counter() - start < 0.05
    # the most a run saves: MAX_SEGMENTS entries of the largest values, accepted
    big = ";".join(f"{e}:{o}:{o}:1:1" for e, o in [(10**18, 10**18 + k) for k in range(256)])
    assert len(parse_history(big).segments) == 256


@settings(max_examples=200, deadline=None)
@given(runs=saved_checkpoints(), data=st.data())
def test_another_batch_geometry_before_a_later_entry_is_refused(runs: list[Saved], data: Any) -> None:
    text, epoch, offset = data.draw(st.sampled_from(runs))
    segments = parse_history(text).segments
    followed = [i for i in range(len(segments) - 1) if segments[i].epoch == segments[i + 1].epoch]
    if not followed:
        return
    i = data.draw(st.sampled_from(followed))
    field = data.draw(st.sampled_from(["local_batch_size", "world_size"]))
    new = data.draw(st.integers(1, 40).filter(lambda v: v != getattr(segments[i], field)))
    mutated = list(segments)
    mutated[i] = segments[i]._replace(**{field: new})
    # refused at the entry after it, or at the entry itself where it is the first of its epoch
    with pytest.raises(ValueError, match=rf"history\[({i}|{i + 1})\]\.(step|offset) is"):
        check_history(parse_history(History(mutated).encode()), epoch, offset)
