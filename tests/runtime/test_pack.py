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

from guideloom._core.rows import Rows
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


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=5),
    st.integers(0, 40),
    st.sampled_from(["<u2", "<i4", "<f8"]),
    st.booleans(),
)
def test_a_streams_rows_come_back_as_rows_of_the_same_samples(
    counts: list[int], length: int, dtype: str, strided: bool
) -> None:
    rng = np.random.default_rng(sum(counts) + length)
    source = rng.integers(0, 200, (sum(counts) + 3, 2 * length)).astype(dtype)
    block = source[:, ::2] if strided else source[:, :length]  # views of a larger read, as read
    ends = np.cumsum(counts).tolist()
    batches = [Rows(block[end - c : end]) for c, end in zip(counts, ends, strict=True)]
    got, sent = _round_trip(batches)
    assert [type(b) for b in got] == [Rows] * len(batches)
    for want, back in zip(batches, got, strict=True):
        assert back.block.dtype == want.block.dtype and back.block.shape == want.block.shape
        assert np.array_equal(back.block, want.block)
    assert sent.flat is not None and sent.flat.rows and sent.data is None  # one copy, nothing pickled


def test_rows_of_another_dtype_or_length_in_the_group_are_pickled_and_come_back_equal() -> None:
    a = np.arange(24, dtype=np.uint16).reshape(3, 8)
    for other in (a.astype(np.int32), a[:, :4].copy()):
        got, sent = _round_trip([Rows(a), Rows(other)])
        assert sent.flat is None
        assert [type(b) for b in got] == [Rows, Rows]
        assert np.array_equal(got[0].block, a) and np.array_equal(got[1].block, other)
        assert got[1].block.dtype == other.dtype


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
    from guideloom._runtime.processes.wire import PickleEntry, TupleEntry

    batch = (
        torch.arange(4096, dtype=torch.int64).reshape(8, 512),
        torch.tensor([3, 1, 4], dtype=torch.int32),
        torch.tensor(2.5),
        torch.zeros(0, dtype=torch.float16),
        torch.tensor([True, False]),
        torch.arange(6, dtype=torch.int16).reshape(2, 3).t(),  # a small transposed view
    )
    for value in (batch, {"batch": batch}):  # a tuple of tensors is no pickle at all
        pack = GroupPack()
        entry = pack.entry(0, value)
        if isinstance(entry, PickleEntry):
            assert b"torch._utils" not in entry.data and b"_rebuild_tensor" not in entry.data
        else:
            assert isinstance(entry, TupleEntry) and value is batch
        buffer = bytearray(max(1, pack.size))
        pack.write(buffer)
        got_value = entry.delivery(None, buffer).value  # type: ignore[arg-type]
        back = got_value if value is batch else got_value["batch"]
        assert type(back) is tuple and len(back) == len(batch)
        for got, sent in zip(back, batch, strict=True):
            assert type(got) is torch.Tensor and got.dtype == sent.dtype and got.shape == sent.shape
            assert torch.equal(got, sent) and got.stride() == sent.stride()


@pytest.mark.parametrize("kind", [tuple, list])
def test_a_tuple_or_list_of_arrays_and_tensors_comes_back_as_views_without_a_pickle(kind: type) -> None:
    """A collate's ``(tokens, lengths)``: each part a view of the slot, the container's type
    kept; an item held twice, a small array, or anything else makes the batch a pickle, which
    keeps them as they were (one object held twice)."""
    import torch

    from guideloom._runtime.processes.pack import GroupPack
    from guideloom._runtime.processes.wire import PickleEntry, TupleEntry

    tokens = torch.arange(35_000, dtype=torch.int64)
    batch = kind([tokens, torch.tensor([3, 1, 4]), np.arange(4096, dtype=np.float32).reshape(64, 64).T])
    pack = GroupPack()
    entry = pack.entry(5, batch)
    assert isinstance(entry, TupleEntry) and entry.step == 5
    buffer = bytearray(pack.size)
    pack.write(buffer)
    back = entry.delivery(None, buffer).value  # type: ignore[arg-type]
    assert type(back) is kind and _same_parts(back, batch)
    assert back[0].numpy().base is not None  # a view of the slot, not a copy
    for odd in (kind([tokens, tokens]), kind([tokens, np.arange(3)]), kind([tokens, 7]), kind([])):
        pack = GroupPack()
        entry = pack.entry(0, odd)
        assert isinstance(entry, PickleEntry)
        buffer = bytearray(max(1, pack.size))
        pack.write(buffer)
        back = entry.delivery(None, buffer).value  # type: ignore[arg-type]
        assert type(back) is kind and _same_parts(back, odd)
        if len(odd) == 2 and odd[1] is tokens:
            assert back[0] is back[1]


def _same_parts(a: Any, b: Any) -> bool:
    import torch

    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(y, torch.Tensor):
            if not (type(x) is torch.Tensor and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(y, np.ndarray):
            if not (_same(y, x) and x.strides == y.strides):
                return False
        elif x != y:
            return False
    return True


def _odd_tensors() -> dict[str, Any]:
    import torch

    wide = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "plain": torch.arange(5000, dtype=torch.int64),
        "slice of a larger one": torch.arange(9000, dtype=torch.int32)[1000:6000],
        "grad": torch.ones(3000, requires_grad=True),
        "negative bit": torch._neg_view(torch.arange(3000, dtype=torch.float32)),
        "conjugate bit": (torch.ones(2000, dtype=torch.complex64) * (1 + 2j)).conj(),
        "bfloat16": torch.ones(3000, dtype=torch.bfloat16),
        "uint16": torch.arange(3000, dtype=torch.int32).to(torch.uint16),
        "axis of length 1 with its own stride": torch.arange(4.0).as_strided((1, 4), (7, 1)),
        "transposed": wide.t(),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


@pytest.mark.parametrize("name", list(_odd_tensors()))
def test_a_tensor_comes_back_with_its_dtype_shape_strides_values_and_grad(name: str) -> None:
    """Whichever way a tensor is laid into the slot (its numpy view for a plain one in C order,
    attribute by attribute otherwise), it comes back as it was sent."""
    import torch

    from guideloom._runtime.processes.pack import GroupPack
    from guideloom._runtime.processes.wire import TupleEntry

    sent = _odd_tensors()[name]
    pack = GroupPack()
    entry = pack.entry(0, (sent, torch.arange(3)))
    assert isinstance(entry, TupleEntry)
    buffer = bytearray(max(1, pack.size))
    pack.write(buffer)
    got = entry.delivery(None, buffer).value[0]  # type: ignore[arg-type]
    assert type(got) is torch.Tensor and got.dtype == sent.dtype and got.shape == sent.shape
    assert got.stride() == sent.stride() and got.requires_grad == sent.requires_grad
    assert torch.equal(got.detach().resolve_conj().resolve_neg(), sent.detach().resolve_conj().resolve_neg())
