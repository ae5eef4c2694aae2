"""Arrays and tensors laid into a shared-memory segment, and the pickle that names them: how a
worker's batches reach the main process and how the main process's samples reach a worker,
each array copied once and rebuilt as a view of the segment on the other side.
"""

from __future__ import annotations

import functools
import io
import mmap
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from guideloom._core.rows import Rows
from guideloom._runtime.processes.shm import ALIGN, MIN_SHARED_BYTES, Rebuilder, SharedArray, SharedArrayFull
from guideloom._runtime.processes.wire import (
    ArrayEntry,
    Entry,
    ErrorEntry,
    FlatLayout,
    PickleEntry,
    Samples,
    TupleEntry,
    exception_message,
)

__all__ = ["SAMPLE_SHARED_BYTES", "GroupPack", "Segment", "pack_samples", "unpack_samples"]

#: Samples sent to a worker travel in its task's pickle below this size, in a segment above it:
#: a task's message stays small, so that sending it never waits on a worker's full pipe.
SAMPLE_SHARED_BYTES = 256

#: A shared-memory segment as the main process holds it: its name, size and mapping.
Segment = tuple[str, int, mmap.mmap]


def pack_samples(batches: list[Any], take: Callable[[int], Segment]) -> tuple[Samples, Segment | None]:
    """A group's samples (each batch's list of them) laid into a segment from ``take``, and how
    the worker finds them there: one copy of the data, no pickle of it. Samples that are 1-D
    arrays of one dtype (a token stream's, documents'), or each batch the :class:`Rows` of a
    block (a stream's read, rebuilt as ``Rows`` for ``collate_fn``), are laid flat with a single
    copy; anything else is pickled with its arrays left out, laid one after the other."""
    flat = _rows(batches) or _flat(batches)
    if flat is not None:
        arrays, layout = flat
        total = sum(a.size for a in arrays)
        if total == 0:
            return Samples(None, 0, None, layout), None
        seg = take(total * arrays[0].itemsize)
        out = np.frombuffer(seg[2], arrays[0].dtype, total)
        if layout.rows:  # the blocks, each 2-D, one after the other
            out = out.reshape(-1, arrays[0].shape[1])
        np.concatenate(arrays, out=out)
        return Samples(seg[0], seg[1], None, layout), seg
    pack = GroupPack(SAMPLE_SHARED_BYTES)
    data = pack.dumps(batches)
    if not pack.arrays:
        return Samples(None, 0, data, None), None
    seg = take(pack.size)
    pack.write(seg[2])
    return Samples(seg[0], seg[1], data, None), seg


def _rows(batches: list[Any]) -> tuple[list[np.ndarray], FlatLayout] | None:
    """The blocks and their layout when every batch is the :class:`Rows` of a block of one plain
    dtype and row length (a stream's reads): a block is copied whole, not row by row."""
    if not batches or any(type(b) is not Rows or type(b.block) is not np.ndarray for b in batches):
        return None
    blocks: list[np.ndarray] = [b.block for b in batches]
    first = blocks[0]
    if first.ndim != 2 or not _plain_dtype(first.dtype):
        return None
    if any(b.ndim != 2 or b.dtype != first.dtype or b.shape[1] != first.shape[1] for b in blocks):
        return None
    return blocks, FlatLayout(first.dtype.str, first.shape[1], tuple(len(b) for b in blocks), rows=True)


def _plain_dtype(dtype: np.dtype[Any]) -> bool:
    """Whether arrays of ``dtype`` travel as their bytes alone (no objects, no named fields)."""
    return not dtype.hasobject and dtype.names is None


def _flat(batches: list[Any]) -> tuple[list[np.ndarray], FlatLayout] | None:
    """The arrays and their layout when every batch is a list of 1-D arrays of one plain dtype."""
    arrays: list[np.ndarray] = []
    counts: list[int] = []
    dtype = None
    for batch in batches:
        if type(batch) is not list:
            return None
        counts.append(len(batch))
        for a in batch:
            if type(a) is not np.ndarray or a.ndim != 1:
                return None
            if dtype is None:
                dtype = a.dtype
                if not _plain_dtype(dtype):
                    return None
            elif a.dtype != dtype:
                return None
            arrays.append(a)
    if dtype is None:
        return None
    lengths = [a.size for a in arrays]
    same = all(n == lengths[0] for n in lengths)
    return arrays, FlatLayout(dtype.str, lengths[0] if same else tuple(lengths), tuple(counts))


def unpack_samples(samples: Samples, holder: Any) -> list[Any]:
    """The batches' samples, their arrays views of the segment's ``holder`` (None: no segment)."""
    if samples.flat is not None:
        dtype, lengths, counts, as_rows = samples.flat
        n = sum(counts)
        total = n * lengths if isinstance(lengths, int) else sum(lengths)
        flat = np.frombuffer(holder, np.dtype(dtype), total) if total else np.empty(0, np.dtype(dtype))
        if as_rows:
            assert isinstance(lengths, int)
            block = flat.reshape(n, lengths)
            ends = np.cumsum(counts).tolist()
            return [Rows(block[end - c : end]) for c, end in zip(counts, ends, strict=True)]
        rows: list[Any]
        if isinstance(lengths, int):
            rows = list(flat.reshape(n, lengths))
        else:
            rows = np.split(flat, np.cumsum(lengths)[:-1].tolist()) if n else []
        out: list[Any] = []
        start = 0
        for c in counts:
            out.append(rows[start : start + c])
            start += c
        return out
    assert samples.data is not None
    if holder is None:
        return list(pickle.loads(samples.data))
    return list(Rebuilder(samples.data, holder).load())


@functools.cache
def _pickles(dtype: Any) -> bool:
    """Whether a tensor of ``dtype`` survives a pickle round trip (torch 2.13 cannot load back the
    uint16, uint32 and uint64 tensors it pickles): small tensors of the others travel in the
    pickle, these through a slot whatever their size."""
    import torch

    try:
        pickle.loads(pickle.dumps(torch.zeros(1, dtype=dtype)))
    except Exception:
        return False
    return True


#: What :meth:`GroupPack.add` takes: ``(kind, dtype, shape, bytes, strides, grad, cls)``, the
#: fields of a :class:`SharedArrayFull` with the bytes in place of where they will lie.
Shareable = tuple[str, Any, tuple[int, ...], np.ndarray, tuple[int, ...] | None, bool, type | None]


def _shareable(obj: Any, torch: Any, min_bytes: int = MIN_SHARED_BYTES) -> Shareable | None:
    """What :meth:`GroupPack.add` takes for an array or tensor that travels through a slot; None
    for anything else (it is pickled).

    A dense layout (C order, or any permutation of it: transposed, Fortran order, channels_last;
    numpy's reversed axes too) travels as the bytes of its span in memory order with its strides,
    and comes back with them; any other (overlapping, broadcast, a view of a larger
    buffer with gaps) as a contiguous copy. A tensor keeps ``requires_grad`` and its class (the
    ``torch.nn.Parameter`` of a module, a plain subclass); a tensor with attributes set on it or
    a subclass with a ``__torch_dispatch__`` of its own, and an ndarray subclass other than
    ``np.memmap`` (a masked array, a recarray), is left to its own pickling, which keeps them."""
    if type(obj) is np.ndarray or type(obj) is np.memmap:
        return _array(obj, min_bytes)
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor(obj, torch)
    return None


def _array(a: np.ndarray, min_bytes: int) -> Shareable | None:
    dt = a.dtype
    if dt.hasobject or a.nbytes < min_bytes:
        return None
    name = dt.str if dt.names is None else dt  # dtype.str drops a structured dtype's fields
    shape = a.shape
    strides = None
    if a.flags.c_contiguous:
        if 1 in shape and a.strides != _c_strides(shape, dt.itemsize):
            strides = a.strides  # the strides of its axes of length 1, which C order ignores
        raw = a.reshape(-1)
    elif _dense(shape, a.strides, dt.itemsize):
        strides = a.strides
        if min(strides) < 0:  # the same span with every axis forwards: its bytes in memory order
            a = a[tuple(slice(None, None, -1) if s < 0 else slice(None) for s in strides)]
        raw = a.ravel(order="K")  # a view: the elements in memory order
    else:
        raw = np.ascontiguousarray(a).reshape(-1)
    return "n", name, shape, raw.view(np.uint8), strides, False, None


def _tensor(t: Any, torch: Any) -> Shareable | None:
    """A plain tensor travels through the slot whatever its size: torch's own pickling of even a
    small one (a batch's labels or lengths) costs some 50 microseconds to write and 40 to read,
    a slot's entry a few."""
    cls: Any = type(t)
    if cls is torch.Tensor and not t.__dict__:
        fast = _plain(t)
        if fast is not None:
            return fast
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return None
    plain = cls is torch.Tensor
    own = t.__dict__ or (not plain and cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__)
    if own and _pickles(t.dtype):
        return None  # its own pickling keeps what it is: its attributes, its dispatch
    if plain:
        cls = None
    else:
        t = t.as_subclass(torch.Tensor)  # the same tensor, plain
    grad = t.requires_grad
    if grad or t.is_conj() or t.is_neg():  # each op costs: only when needed
        t = t.detach().resolve_conj().resolve_neg()
    shape = tuple(t.shape)
    strides = None
    if t.is_contiguous():
        if 1 in shape and t.stride() != _c_strides(shape, 1):
            strides = t.stride()  # the strides of its axes of length 1, which C order ignores
        raw = t.reshape(-1)
    elif _dense(shape, t.stride(), 1):
        strides = t.stride()
        raw = t.as_strided((t.numel(),), (1,))  # its span, in memory order (strides are >= 0)
    else:
        raw = t.contiguous().view(-1)  # a copy: reshape(-1) may be a view with a step
    dtype = _torch_name(t.dtype)
    return "t", dtype, shape, raw.view(torch.uint8).numpy(), strides, grad, cls


def _plain(t: Any) -> Shareable | None:
    """A plain tensor in C order, taken through its numpy view (a collate's usual output): what
    :func:`_tensor` checks one attribute at a time (its device, layout, grad, conjugate and
    negative bits, a dtype numpy holds), ``numpy()`` refuses at once, for a third of the cost.
    None where it refuses, or where an axis of length 1 may carry a stride of its own (the
    general path keeps it)."""
    try:
        a = t.numpy()
    except (RuntimeError, TypeError, ValueError):
        return None
    shape = a.shape
    if not a.flags.c_contiguous or 1 in shape:
        return None
    dtype = _torch_name(t.dtype)
    return "t", dtype, shape, a.reshape(-1).view(np.uint8), None, False, None


@functools.cache
def _torch_name(dtype: Any) -> str:
    """The name of torch ``dtype`` (``"float32"``), as the main process looks it up (``torch.float32``)
    to rebuild the tensor (a memo: a dtype's ``str`` costs a few times the lookup, per tensor)."""
    return str(dtype).removeprefix("torch.")


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The strides of a C-contiguous array of ``shape`` (in units of ``itemsize``)."""
    out = []
    step = itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _dense(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether ``strides`` lay the elements of ``shape`` out without gaps or overlaps: a
    permutation of C order, each axis forwards or backwards (axes of length 1 ignored)."""
    step = itemsize
    for stride, n in sorted((abs(s), n) for n, s in zip(shape, strides, strict=True) if n != 1):
        if n == 0:
            return True  # no elements
        if stride != step:
            return False
        step *= n
    return True


class GroupPack:
    """A group's batches as they go into one slot: their arrays' bytes, laid out one after the
    other, and each batch's entry (a description of its arrays, or a pickle that names them)."""

    def __init__(self, min_bytes: int = MIN_SHARED_BYTES) -> None:
        self.arrays: list[np.ndarray] = []  # byte views of what goes into the slot, in order
        self.size = 0
        self.min_bytes = min_bytes  # smaller numpy arrays travel in the pickle
        self.torch = sys.modules.get("torch")

    def add(
        self,
        kind: str,
        dtype: Any,
        shape: tuple[int, ...],
        raw: np.ndarray,
        strides: tuple[int, ...] | None,
        grad: bool,
        cls: type | None,
    ) -> SharedArray | SharedArrayFull:
        offset = self.size
        self.size = offset + (raw.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.arrays.append(raw)
        if strides is None and not grad and cls is None:
            return SharedArray(kind, dtype, shape, offset, raw.nbytes)
        return SharedArrayFull(kind, dtype, shape, offset, raw.nbytes, strides, grad, cls)

    def entry(self, step: int, value: Any) -> Entry:
        """One batch's entry: an :class:`ArrayEntry` for a batch that is one array or tensor (no
        pickle either way), a :class:`PickleEntry` that names its arrays in the slot otherwise."""
        torch = self.torch
        if type(value) is np.ndarray or (torch is not None and type(value) is torch.Tensor):
            shared = _shareable(value, torch, self.min_bytes)
            if shared is not None:
                return ArrayEntry(step, self.add(*shared))
        mark = len(self.arrays), self.size
        if (type(value) is tuple or type(value) is list) and 0 < len(value) <= 8:
            parts = self._parts(value)
            if parts is not None:
                return TupleEntry(step, tuple(self.add(*p) for p in parts), type(value) is list)
        try:
            data = self.dumps(value)
        except Exception as exc:
            del self.arrays[mark[0] :]
            self.size = mark[1]
            return ErrorEntry(step, *exception_message(exc))
        return PickleEntry(step, data, in_slot=True)

    def _parts(self, value: tuple[Any, ...] | list[Any]) -> list[Shareable] | None:
        """What :meth:`add` takes for each item of ``value``, where every item is a distinct
        array or tensor that travels through the slot; None otherwise (the batch is pickled,
        which keeps whatever else it holds, and an object held twice as one)."""
        parts = []
        for item in value:
            shared = _shareable(item, self.torch, self.min_bytes)
            if shared is None:
                return None
            parts.append(shared)
        if len({id(item) for item in value}) != len(value):
            return None
        return parts

    def dumps(self, value: Any) -> bytes:
        """``value`` pickled with its large arrays and tensors left out, laid out in the pack
        (:class:`~guideloom._runtime.processes.shm.Rebuilder` rebuilds it from the slot)."""
        buf = io.BytesIO()
        _SharedPickler(buf, self).dump(value)
        return buf.getvalue()

    def write(self, buffer: Any) -> None:
        """Lay the pack's arrays into ``buffer`` (at least :attr:`size` bytes), where their
        descriptions say they lie."""
        view = np.frombuffer(buffer, np.uint8, self.size)
        offset = 0
        for raw in self.arrays:
            view[offset : offset + raw.nbytes] = raw
            offset += (raw.nbytes + ALIGN - 1) // ALIGN * ALIGN


class _SharedPickler(pickle.Pickler):
    """Pickles a batch with its large arrays and tensors left out, recorded in the group's pack."""

    def __init__(self, file: io.BytesIO, pack: GroupPack) -> None:
        super().__init__(file, protocol=5)
        self.pack = pack
        self._seen: dict[int, SharedArray | SharedArrayFull] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _PLAIN:  # the pids' own parts, and most of what a batch holds
            return None
        pid = self._seen.get(id(obj))
        if pid is not None:
            return pid
        shared = _shareable(obj, self.pack.torch, self.pack.min_bytes)
        if shared is None:
            return None
        pid = self._seen[id(obj)] = self.pack.add(*shared)
        return pid


_PLAIN = frozenset({int, float, str, bytes, bool, tuple, list, dict, type(None)})
