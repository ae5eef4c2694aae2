"""Samples sent to a process worker: laid into a segment by the main process and rebuilt as views
of it in the worker, equal to what was sent whatever their shape."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._runtime.processes.pack import Segment, pack_samples, unpack_samples


def _round_trip(batches: list[Any]) -> tuple[list[Any], Any]:
    made: list[Segment] = []

    def take(nbytes: int) -> Segment:
        seg = ("test", max(nbytes, 1), mmap.mmap(-1, max(nbytes, 1)))
        made.append(seg)
        return seg

    sent, seg = pack_samples(batches, take)
    assert seg is (made[0] if made else None)
    holder = None if seg is None else (ctypes.c_char * seg[1]).from_buffer(seg[2])
    return unpack_samples(sent, holder), sent


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 300), max_size=6), min_size=1, max_size=4),
    st.sampled_from(["<u2", "<i4", "<f8", "|u1"]),
    st.booleans(),
)
def test_token_samples_come_back_equal(lengths: list[list[int]], dtype: str, uniform: bool) -> None:
    rng = np.random.default_rng(len(lengths))
    if uniform:
        lengths = [[lengths[0][0] if lengths[0] else 5] * len(b) for b in lengths]
    source = rng.integers(0, 200, 4096).astype(dtype)
    batches = [[source[7 : 7 + n] for n in b] for b in lengths]  # views of a larger read, as read
    got, sent = _round_trip(batches)
    assert _same(batches, got)
    if any(lengths):
        assert sent.flat is not None and sent.data is None  # one copy, nothing pickled


def test_samples_of_any_other_shape_come_back_equal() -> None:
    big = np.arange(1000, dtype=np.int64)
    batches: list[Any] = [
        [
            {"tokens": big[:300], "mask": np.ones(300, bool), "id": 3},
            {"tokens": big[300:], "mask": None, "id": 4},
        ],
        [np.arange(12, dtype=np.float32).reshape(3, 4).T],  # 2-D, not contiguous
        [big[:10], big[:10].astype(np.int32)],  # two dtypes
        ("a", "tuple"),
    ]
    got, sent = _round_trip(batches)
    assert sent.flat is None
    assert _same(batches, got)


@pytest.mark.parametrize("batches", [[[]], [[], []], [[np.zeros(0, np.uint16)]]])
def test_empty_batches_come_back_empty(batches: list[Any]) -> None:
    got, _ = _round_trip(batches)
    assert _same(batches, got)


def test_small_tensors_of_a_batch_travel_in_the_slot_and_come_back_equal() -> None:
    """A batch's small tensors (labels, lengths, a scalar, an empty one) come back equal, of
    their dtype and shape, rebuilt from the slot rather than by torch's own pickling (which
    costs some 90 microseconds a tensor)."""
    import torch

    from guideloom._runtime.processes.pack import GroupPack
    from guideloom._runtime.processes.shm import Rebuilder
    from guideloom._runtime.processes.wire import PickleEntry

    batch = (
        torch.arange(4096, dtype=torch.int64).reshape(8, 512),
        torch.tensor([3, 1, 4], dtype=torch.int32),
        torch.tensor(2.5),
        torch.zeros(0, dtype=torch.float16),
        torch.tensor([True, False]),
        torch.arange(6, dtype=torch.int16).reshape(2, 3).t(),  # a small transposed view
    )
    pack = GroupPack()
    entry = pack.entry(0, batch)
    assert isinstance(entry, PickleEntry)
    assert b"torch._utils" not in entry.data and b"_rebuild_tensor" not in entry.data
    buffer = bytearray(max(1, pack.size))
    pack.write(buffer)
    back = Rebuilder(entry.data, buffer).load()
    assert len(back) == len(batch)
    for got, sent in zip(back, batch, strict=True):
        assert type(got) is torch.Tensor and got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
