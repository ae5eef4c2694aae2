"""Shared memory, both sides: the segments (named ``guideloom-...`` in ``/dev/shm``), a
worker's reusable slots, and the views the main process rebuilds arrays and tensors as.

A worker writes a whole group's arrays into one of its slots, one after the other; the main
process maps the slot once and rebuilds each array as a view of it, without a copy. A slot is free
again when the last array built on it is freed: the main process clears its state byte, which the
worker reads (no message). Slots are unlinked as soon as the main process has mapped them, and a
pool's segments are swept when a worker dies and when the pool closes.
"""

from __future__ import annotations

import functools
import importlib
import io
import mmap
import os
import pickle
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Inputs",
    "ALIGN",
    "MAX_SLOTS",
    "MIN_SHARED_BYTES",
    "SHM_PREFIX",
    "SharedArray",
    "SharedArrayFull",
    "StateSegment",
    "Rebuilder",
    "Slots",
    "live_segments",
    "map_segment",
    "posix_shm_available",
    "release",
    "sweep",
    "unlink",
    "view",
]

#: Every shared-memory segment guideloom makes starts with this (``/dev/shm/guideloom-...``).
SHM_PREFIX = "guideloom-"
#: Numpy arrays smaller than this travel inside the pickle: a slot costs more than copying them
#: (a tensor's own pickling costs more than a slot whatever its size: tensors always use one).
MIN_SHARED_BYTES = 4096
#: Slots per worker at most (one state byte each); past that, batches travel pickled.
MAX_SLOTS = 4096
ALIGN = 64

_shm: Any = importlib.import_module("_posixshmem") if os.name == "posix" else None


def live_segments(prefix: str = SHM_PREFIX) -> list[str]:
    """Names of the shared-memory segments in ``/dev/shm`` that start with ``prefix`` (Linux)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


def unlink(name: str) -> None:
    try:
        _shm.shm_unlink("/" + name)
    except (FileNotFoundError, OSError):
        pass


def sweep(prefix: str) -> None:
    for name in live_segments(prefix):
        unlink(name)


def map_segment(name: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _shm.shm_open("/" + name, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class StateSegment:
    """A worker's state bytes (one per slot: the main process frees a slot by clearing its
    byte), made by the main process before the worker starts.

    Where the platform has ``memfd_create`` (Linux) the segment has no name: the worker gets its
    descriptor as it starts (pickled as multiprocessing passes a pipe), so nothing in
    ``/dev/shm`` can outlive the main process, whatever kills it and whenever. Elsewhere it is a
    named segment, unlinked once the worker has mapped it (:meth:`unlink`).
    """

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        memfd = getattr(os, "memfd_create", None)
        self.fd: int | None = None
        if memfd is None:  # pragma: no cover - Linux has memfd_create
            self.mm = map_segment(name, size, create=True)
            return
        fd = memfd(name, getattr(os, "MFD_CLOEXEC", 1))
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.fd is None:  # pragma: no cover - no memfd_create
            return _attach_state, (self.name, self.size, None)
        from multiprocessing.reduction import DupFd

        return _attach_state, (self.name, self.size, DupFd(self.fd))

    def started(self) -> None:
        """The worker has its descriptor (it was sent as it started): close this process's."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def unlink(self) -> None:
        """The worker has mapped the segment (or is gone): remove its name, if it has one."""
        if self.fd is None and not hasattr(os, "memfd_create"):  # pragma: no cover - no memfd
            unlink(self.name)


def _attach_state(name: str, size: int, dup: Any) -> mmap.mmap:
    """In the worker: map the state bytes it was sent (:class:`StateSegment`)."""
    if dup is None:  # pragma: no cover - no memfd_create
        return map_segment(name, size, create=False)
    fd = dup.detach()
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def attach_state(state: StateSegment | mmap.mmap) -> mmap.mmap:
    """In the worker: the mapped state bytes (a fork that pickled nothing has the segment)."""
    return state.mm if isinstance(state, StateSegment) else state


def segment_size(nbytes: int) -> int:
    """The size of a new segment for ``nbytes``: a power of two (64 KiB at least), so that a
    reused segment fits more than what it was made for."""
    return 1 << max(16, (nbytes - 1).bit_length())


class Slots:
    """A worker's slots: shared-memory segments it writes batches into and reuses once free."""

    def __init__(self, prefix: str, state: np.ndarray) -> None:
        self.prefix = prefix
        self.state = state  # 0 free, 1 in use (the main process frees)
        self.slots: list[tuple[str, int, mmap.mmap]] = []
        self.gen = 0

    def take(self, nbytes: int) -> tuple[int, str, int, mmap.mmap] | None:
        n = len(self.slots)
        free = np.flatnonzero(self.state[:n] == 0).tolist()
        fits = [i for i in free if self.slots[i][1] >= nbytes]
        if fits:
            i = min(fits, key=lambda k: self.slots[k][1])
        elif free:
            i = free[0]
            self.slots[i][2].close()
            self.slots[i] = self._new(i, nbytes)
        elif n < MAX_SLOTS:
            i = n
            self.slots.append(self._new(i, nbytes))
        else:
            return None
        self.state[i] = 1
        name, size, mm = self.slots[i]
        return i, name, size, mm

    def _new(self, i: int, nbytes: int) -> tuple[str, int, mmap.mmap]:
        size = segment_size(nbytes)
        self.gen += 1
        name = f"{self.prefix}{i}.{self.gen}"
        return name, size, map_segment(name, size, create=True)

    def close(self) -> None:
        for name, _, mm in self.slots:
            mm.close()
            unlink(name)  # the main process unlinks what it mapped; the rest goes here
        self.slots.clear()


class Inputs:
    """The segments the main process sends one worker's samples in, each reused once the worker
    has answered for its group: a group costs a copy into memory already mapped on both sides,
    not a new segment. Their names stay in ``/dev/shm`` while the worker may map them, until
    :meth:`close` (or a sweep of the worker's prefix)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.free: list[tuple[str, int, mmap.mmap]] = []
        self.made: list[tuple[str, int, mmap.mmap]] = []
        self.gen = 0

    def take(self, nbytes: int) -> tuple[str, int, mmap.mmap]:
        fits = [seg for seg in self.free if seg[1] >= nbytes]
        if fits:
            seg = min(fits, key=lambda s: s[1])
            self.free.remove(seg)
            return seg
        self.gen += 1
        size = segment_size(nbytes)
        name = f"{self.prefix}in{self.gen}"
        seg = name, size, map_segment(name, size, create=True)
        self.made.append(seg)
        return seg

    def give_back(self, seg: tuple[str, int, mmap.mmap]) -> None:
        self.free.append(seg)

    def close(self) -> None:
        for name, _, mm in self.made:
            unlink(name)
            mm.close()
        self.made.clear()
        self.free.clear()


class SharedArray(NamedTuple):
    """Where a C-contiguous array (``kind`` ``"n"``) or plain tensor (``"t"``) lies in a slot:
    the common case, whose description is kept short (each costs its unpickling)."""

    kind: str
    dtype: Any  # a dtype's name (numpy's ``dtype.str``), or a numpy dtype with named fields
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SharedArrayFull(NamedTuple):
    """A :class:`SharedArray` with what else it is rebuilt with. ``strides``: None for a
    C-contiguous layout; otherwise the strides to rebuild it with over its ``nbytes`` (the dense
    span, in memory order): numpy's in bytes (negative ones too), torch's in elements. ``grad``:
    the tensor requires grad. ``cls``: the tensor's class when it is a subclass of
    ``torch.Tensor`` (``torch.nn.Parameter``), None for a plain tensor."""

    kind: str
    dtype: Any
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    strides: tuple[int, ...] | None
    grad: bool
    cls: type | None


def posix_shm_available() -> bool:
    """Whether this platform has POSIX shared memory (process workers need it)."""
    return _shm is not None


def release(state: np.ndarray, i: int) -> None:
    state[i] = 0


class Rebuilder(pickle.Unpickler):
    """Unpickles a batch, its arrays and tensors views of the slot's ``holder``."""

    def __init__(self, data: bytes, holder: Any) -> None:
        super().__init__(io.BytesIO(data))
        self.holder = holder
        self._made: dict[Any, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        made = self._made.get(pid)
        if made is None:  # an object the batch holds twice comes back as one object
            made = self._made[pid] = self._make(*pid)
        return made

    def _make(self, *pid: Any) -> Any:
        return view(self.holder, *pid)


def view(
    holder: Any,
    kind: str,
    dtype: Any,
    shape: tuple[int, ...],
    offset: int,
    nbytes: int,
    strides: tuple[int, ...] | None = None,
    grad: bool = False,
    cls: type | None = None,
) -> Any:
    """The array (``kind`` ``"n"``) or tensor (``"t"``) at ``offset`` in a slot, a view of it, with
    the strides, ``requires_grad`` and class it was sent with (see :class:`SharedArrayFull`)."""
    if kind == "n":
        nd = np.dtype(dtype)
        if strides is None:
            return np.frombuffer(holder, nd, nbytes // nd.itemsize, offset).reshape(shape)
        # the first element: past the span of each axis that runs backwards
        first = sum((1 - n) * s for n, s in zip(shape, strides, strict=True) if s < 0 and n > 0)
        return np.ndarray(shape, nd, holder, offset + first, strides)
    import torch

    dt = _numpy_of(dtype)
    if dt is not None:  # one view fewer: measured at half the cost a batch
        flat = np.frombuffer(holder, dt, nbytes // dt.itemsize, offset)
        if strides is None and not grad and cls is None:
            return torch.from_numpy(flat.reshape(shape))
        t = torch.from_numpy(flat)
    else:
        t = torch.from_numpy(np.frombuffer(holder, np.uint8, nbytes, offset)).view(getattr(torch, dtype))
    t = t.reshape(shape) if strides is None else t.as_strided(shape, strides)
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=grad)
    if cls is not None:
        t = t.as_subclass(cls)
    return t.requires_grad_() if grad else t


@functools.cache
def _numpy_of(dtype: str) -> Any:
    """The numpy dtype of the torch dtype named ``dtype`` (``"float32"``); None where numpy has
    none (``bfloat16`` and others)."""
    import torch

    try:
        return torch.empty(0, dtype=getattr(torch, dtype)).numpy().dtype
    except TypeError:
        return None
