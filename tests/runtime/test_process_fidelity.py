"""Process workers hand back the batch the collate made, as inline: tensors of 4 KiB or more keep
``requires_grad``, their class (``torch.nn.Parameter``, a plain subclass) and a dense layout's
strides (transposed, channels_last; numpy's Fortran order, transposed and reversed axes too),
through shared memory; a layout with gaps or overlaps arrives contiguous, with the same values."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from tests.support.loader import take

# What crosses from a worker: the workers are up before the first batch, which comes from them.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_thread_leak", "workers_up_first")]

SEQ = 64


class Tagged(torch.Tensor):
    """A tensor subclass of no behaviour of its own (importable by name: it crosses by it)."""


def wide(samples: Sequence[np.ndarray]) -> np.ndarray:
    """(4, 1024) float32, 16 KiB: well above the 4 KiB under which tensors travel pickled."""
    return np.tile(np.stack([np.asarray(s) for s in samples]).astype(np.float32), (1, 16))


def dense(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    """Every dense layout and autograd state that crosses as it is."""
    w = wide(samples)
    t = torch.from_numpy(w)
    tagged = t.t().as_subclass(Tagged)
    return {
        "transposed": t.t(),
        "channels_last": t.reshape(4, 4, 16, 16).to(memory_format=torch.channels_last),
        "channels_last_1": t.reshape(4, 1, 32, 32).to(memory_format=torch.channels_last),
        "permuted": t.reshape(4, 16, 64).permute(2, 0, 1),
        "bfloat16_t": t.to(torch.bfloat16).t(),
        "grad": t.clone().requires_grad_(),
        "grad_transposed": t.clone().t().requires_grad_(),
        "grad_small": t[:, :4].clone().requires_grad_(),  # 64 bytes: in the pickle
        "parameter": torch.nn.Parameter(t.clone()),
        "parameter_frozen": torch.nn.Parameter(t.t(), requires_grad=False),
        "parameter_small": torch.nn.Parameter(t[:, :4].clone()),
        "tagged": tagged,
        "fortran": np.asfortranarray(w),
        "array_t": w.T,
        "array_3d": w.reshape(4, 16, 64).transpose(1, 2, 0),
        "reversed": w[::-1],
        "reversed_t": w[:, ::-1].T,
        "nested": [{"t": t.t(), "p": (torch.nn.Parameter(t.clone()), np.asfortranarray(w))}],
        "plain": t,
        "array": w,
    }


def gapped(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    """Layouts that are not dense: they arrive as contiguous copies, with the same values."""
    w = wide(samples)
    t = torch.from_numpy(w)
    return {
        "stepped": t[:, ::2],
        "columns": t[:, 100:900],
        "expanded": t[:1].expand(4, 1024),
        "stepped_grad": t[:, ::2].clone()[:, ::2].requires_grad_(),
        "array_stepped": w[:, ::2],
        "array_broadcast": np.broadcast_to(w[:1], (4, 1024)),
    }


class Only:
    """The collate of one entry of :func:`dense` alone: a batch that is a tensor or array itself."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, samples: Sequence[np.ndarray]) -> Any:
        return dense(samples)[self.key]


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fidelity") / "stream"
    gl.write_stream(folder, np.arange(24 * SEQ, dtype=np.int32))
    return folder


def batches(path: Path, collate: Any, num_workers: int) -> list[Any]:
    with gl.StatefulDataLoader.from_storage(
        gl.open_stream(path),
        collate,
        sequence_length=SEQ,
        local_batch_size=4,
        num_workers=num_workers,
        parallel_method="process",
        device=torch.device("cpu"),
    ) as loader:
        return take(loader)


def leaves(obj: Any, where: str = "batch") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{where}[{k!r}]")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{where}[{i}]")
    else:
        yield where, obj


def assert_same_batch(got: Any, want: Any) -> None:
    """The same structure, and each tensor and array the same: class, dtype, shape, strides,
    ``requires_grad`` (a leaf either way), writability and values."""
    got_leaves, want_leaves = list(leaves(got)), list(leaves(want))
    assert [w for w, _ in got_leaves] == [w for w, _ in want_leaves]
    for (where, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        assert type(a) is type(b), where
        if isinstance(b, torch.Tensor):
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), where
            assert (a.requires_grad, a.is_leaf) == (b.requires_grad, b.is_leaf), where
            assert torch.equal(a.detach(), b.detach()), where
        elif isinstance(b, np.ndarray):
            assert (a.dtype, a.shape, a.strides) == (b.dtype, b.shape, b.strides), where
            assert a.flags.writeable == b.flags.writeable, where
            assert np.array_equal(a, b), where
        else:
            assert a == b, where


def test_dense_layouts_grad_and_parameters_cross_as_inline(
    stream: Path, own_segments: Callable[[], list[str]]
) -> None:
    want = batches(stream, dense, 0)
    got = batches(stream, dense, 2)
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        assert_same_batch(a, b)
    first = got[0]
    holder: Any = first["array"]
    while isinstance(holder, np.ndarray):
        holder = holder.base
    assert isinstance(holder, ctypes.Array)  # the group's slot
    start = ctypes.addressof(holder)
    for key in ("transposed", "channels_last", "grad", "parameter", "fortran", "reversed"):
        x = first[key]  # through shared memory: a view of the slot, not a copy
        address = x.data_ptr() if isinstance(x, torch.Tensor) else x.__array_interface__["data"][0]
        assert start <= address < start + ctypes.sizeof(holder), key
    assert first["channels_last"].is_contiguous(memory_format=torch.channels_last)
    assert first["fortran"].flags.f_contiguous
    # a leaf that requires grad: gradients reach it, as inline
    (first["grad_transposed"] * 2).sum().backward()
    assert first["grad_transposed"].grad is not None and torch.equal(
        first["grad_transposed"].grad, torch.full((1024, 4), 2.0)
    )
    first["array_t"][0, 0] = -1  # writable, as the collate's own array is
    del got, first, holder, x
    gc.collect()
    assert own_segments() == []  # strided views and parameters free their slot too


@pytest.mark.parametrize("key", ["transposed", "grad_transposed", "parameter", "reversed"])
def test_a_batch_that_is_one_tensor_or_array_crosses_as_inline(stream: Path, key: str) -> None:
    want = batches(stream, Only(key), 0)
    got = batches(stream, Only(key), 2)
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        assert_same_batch(a, b)


def test_layouts_with_gaps_or_overlaps_arrive_as_contiguous_copies(stream: Path) -> None:
    want = batches(stream, gapped, 0)
    got = batches(stream, gapped, 2)
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for k in b:
            x, y = a[k], b[k]
            assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape, k
            if isinstance(y, torch.Tensor):
                assert x.is_contiguous() and not y.is_contiguous(), k
                assert x.requires_grad == y.requires_grad and x.is_leaf, k
                assert torch.equal(x.detach(), y.detach()), k
            else:
                assert x.flags.c_contiguous and not y.flags.c_contiguous, k
                assert np.array_equal(x, y), k


class Noted(torch.Tensor):
    """A tensor subclass whose instances carry an attribute."""


def noted(samples: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
    sub = torch.from_numpy(wide(samples)).as_subclass(Noted)
    sub.note = "kept"  # type: ignore[attr-defined]
    plain = torch.from_numpy(wide(samples)).t()
    plain.note = "kept"  # type: ignore[attr-defined]
    return {"sub": sub, "plain": plain}


def test_tensors_with_attributes_cross_by_their_own_pickling(stream: Path) -> None:
    got = batches(stream, noted, 2)
    want = batches(stream, noted, 0)
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        for k in ("sub", "plain"):
            assert type(a[k]) is type(b[k]) and a[k].note == "kept", k
            assert a[k].stride() == b[k].stride(), k
            assert torch.equal(a[k].as_subclass(torch.Tensor), b[k].as_subclass(torch.Tensor)), k


def numpy_kinds(samples: Sequence[np.ndarray]) -> dict[str, Any]:
    w = wide(samples)
    records = np.zeros(len(w) * 256, dtype=[("id", "<i8"), ("score", "<f4")])  # 3 KiB+ a batch
    records["id"] = w[:, :256].reshape(-1)
    return {
        "records": np.concatenate([records, records]),
        "masked": np.ma.masked_less(w, 100.0),
        "recarray": records.view(np.recarray),
    }


def test_structured_arrays_keep_their_fields_and_ndarray_subclasses_their_class(stream: Path) -> None:
    """A structured dtype went by ``dtype.str`` (``|V12``: its fields lost); a masked array
    through a slot as a plain array (its mask lost)."""
    got = batches(stream, numpy_kinds, 2)
    want = batches(stream, numpy_kinds, 0)
    for a, b in zip(got, want, strict=True):
        assert a["records"].dtype == b["records"].dtype and a["records"].dtype.names == ("id", "score")
        assert np.array_equal(a["records"], b["records"])
        assert type(a["masked"]) is np.ma.MaskedArray and np.array_equal(
            np.ma.getmaskarray(a["masked"]), np.ma.getmaskarray(b["masked"])
        )
        assert np.ma.allequal(a["masked"], b["masked"])
        assert type(a["recarray"]) is np.recarray and np.array_equal(a["recarray"].id, b["recarray"].id)
