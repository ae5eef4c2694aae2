"""A block shuffle over blocks of uneven size: a source's own groups (Parquet row groups).

Nothing here does I/O. :class:`GroupPermutation` is what :class:`~guideloom._core.order.BlockPermutation`
is for uniform blocks, over groups whose sizes the source names: the groups are laid out in a
seeded random order, consecutive groups of that order form *windows* of ``window`` groups, and the
samples of each window are shuffled among themselves by a keyed permutation of the window's size.
A window holds exactly the samples of its groups, so a reader that decodes a group whole decodes
each group once per visit while it keeps a window's groups (``window`` of them) at hand.

The order is a bijection of ``[0, N)`` fixed by ``(sizes, seed, epoch, window)``: it never
depends on batch size, world size or the position resumed at. Building it costs O(G) time and
memory for G groups (one permutation of the groups, the windows' starts and a bucket index over
them); a lookup costs O(1) expected at any position: the bucket index maps ``position // b``
(``b`` the mean window's samples) to the window that holds the bucket's first position, and
the lookup steps forward from it over the windows that start inside the bucket (about one).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from guideloom._core.keys import hash64
from guideloom._core.permutation import IndexArray, Order, Permutation

__all__ = ["GroupPermutation", "LazyGroupPermutation"]

#: Windows whose within-window permutation is kept (each is a few integers).
_KEEP_WINDOWS = 64


class GroupPermutation(Order):
    """A random-access permutation of ``[0, sum(sizes))`` that keeps groups together by windows.

    ``sizes[g]`` is the number of samples in group ``g``; group ``g`` holds samples
    ``[starts[g], starts[g] + sizes[g])`` (the groups are consecutive, in index order).
    """

    __slots__ = (
        "_bucket",
        "_epoch",
        "_first",
        "_group_of_slot",
        "_perms",
        "_seed",
        "_sizes",
        "_starts",
        "_w",
        "_wstarts",
        "n",
    )

    def __init__(self, sizes: npt.ArrayLike, *, seed: int, epoch: int, window: int) -> None:
        sizes_a = np.asarray(sizes, dtype=np.int64)
        if sizes_a.ndim != 1 or (sizes_a < 0).any():
            raise ValueError("group sizes must be a 1-D array of counts >= 0")
        if window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {window}")
        self._sizes = sizes_a
        self._starts = np.concatenate([[0], np.cumsum(sizes_a)]).astype(np.int64)
        self.n = int(self._starts[-1])
        self._w = window
        self._seed, self._epoch = seed, epoch
        groups = len(sizes_a)
        self._group_of_slot = Permutation(groups, shuffle=True, seed=seed, epoch=epoch).range(0, groups)
        in_order = sizes_a[self._group_of_slot]
        nwin = -(-groups // window)
        per_window = (
            np.add.reduceat(in_order, np.arange(0, groups, window)) if groups else np.zeros(0, np.int64)
        )
        self._wstarts = np.concatenate([[0], np.cumsum(per_window)]).astype(np.int64)
        assert len(self._wstarts) == nwin + 1
        # The bucket index: _first[j] is the window holding position j * _bucket (the last window
        # that starts at or before it), counted from how many windows start in each bucket.
        self._bucket = max(1, -(-self.n // max(1, nwin)))
        buckets = -(-self.n // self._bucket)
        starts_in = -(-self._wstarts[:-1] // self._bucket)  # the first bucket at or after each start
        counts = np.bincount(starts_in, minlength=buckets + 1)[: buckets + 1]
        self._first = (np.cumsum(counts) - 1).astype(np.int64)
        self._perms: OrderedDict[int, tuple[Permutation, IndexArray, IndexArray]] = OrderedDict()

    def __len__(self) -> int:
        return self.n

    @property
    def span(self) -> int:
        """Order positions of the largest window (a read of one window's positions decodes its
        groups and no other)."""
        return int(np.diff(self._wstarts).max()) if len(self._wstarts) > 1 else 0

    def window_end(self, position: int) -> int:
        """The end of the window that holds order ``position`` (windows differ in size: a read
        that stops at a window's end decodes its groups and no other's)."""
        k = int(np.searchsorted(self._wstarts, position, side="right")) - 1
        return int(self._wstarts[min(k + 1, len(self._wstarts) - 1)])

    def _window(self, k: int) -> tuple[Permutation, IndexArray, IndexArray]:
        """Window ``k``'s permutation of its samples, its groups' first samples and their
        cumulative sizes inside the window."""
        got = self._perms.get(k)
        if got is not None:
            self._perms.move_to_end(k)
            return got
        groups = self._group_of_slot[k * self._w : (k + 1) * self._w]
        inner = np.concatenate([[0], np.cumsum(self._sizes[groups])]).astype(np.int64)
        key = hash64(f"guideloom-groups:{self._seed}:{self._epoch}:{k}")
        perm = Permutation(int(inner[-1]), shuffle=True, seed=key, epoch=self._epoch)
        got = (perm, self._starts[groups], inner)
        self._perms[k] = got
        if len(self._perms) > _KEEP_WINDOWS:
            self._perms.popitem(last=False)
        return got

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
        return int(self.take(np.asarray([position], dtype=np.int64))[0])

    def take(self, positions: npt.ArrayLike) -> IndexArray:
        """Map an array of order positions to sample indexes (vectorised per window)."""
        given = np.asarray(positions, dtype=np.int64)
        if not given.size:
            return np.zeros(given.shape, dtype=np.int64)
        if given.min() < 0 or given.max() >= self.n:
            raise IndexError(f"positions outside [0, {self.n})")
        flat = given.ravel()
        k = self._first[flat // self._bucket]
        ahead = self._wstarts[k + 1] <= flat
        while ahead.any():  # the windows that start inside a bucket: about one step, expected
            k += ahead
            ahead = self._wstarts[k + 1] <= flat
        out = np.empty(len(flat), dtype=np.int64)
        for win in np.unique(k).tolist():
            at = np.flatnonzero(k == win) if len(flat) > 1 else np.zeros(1, np.int64)
            perm, first, inner = self._window(win)
            q = perm.take(flat[at] - self._wstarts[win])
            g = np.searchsorted(inner, q, side="right") - 1
            out[at] = first[g] + (q - inner[g])
        return out.reshape(given.shape)

    def range(self, start: int, stop: int) -> IndexArray:
        """Sample indexes at order positions ``[start, stop)``."""
        return self.take(np.arange(start, stop, dtype=np.int64))


class LazyGroupPermutation:
    """:class:`GroupPermutation` over groups whose sizes are learned as the epoch goes.

    The groups' order and the windows depend only on the number of groups, ``seed``, ``epoch``
    and ``window``; window ``k``'s positions need the sizes of the groups of windows ``<= k``
    only. Sizes are told by :meth:`learn` (a reader counts the groups of :meth:`next_groups`,
    the first window not counted yet); positions ``[0, known)`` can be looked up meanwhile, and
    once every size is known the order is exactly ``GroupPermutation(sizes, seed, epoch,
    window)``. With ``last``, the last group is left out of the shuffle of groups and comes after
    every window, as a window of its own (its samples shuffled among themselves). Without
    ``shuffle``, the groups come in index order and each window's samples in order.

    A lookup gives each position's group and its place in the group (:meth:`take_keyed`): a
    group's first sample index needs the sizes of every group before it, which a lazily
    counted reader does not know.
    """

    __slots__ = (
        "_counted",
        "_epoch",
        "_groups",
        "_last",
        "_nwin",
        "_perms",
        "_seed",
        "_shuffle",
        "_sizes",
        "_slots",
        "_w",
        "_wstarts",
    )

    def __init__(
        self, groups: int, *, seed: int, epoch: int, window: int, last: bool = False, shuffle: bool = True
    ) -> None:
        if groups < 0 or (last and groups < 1):
            raise ValueError(f"groups must be >= {int(last)}, got {groups}")
        if window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {window}")
        shuffled = groups - 1 if last else groups
        self._groups, self._w, self._last = groups, window, last
        self._seed, self._epoch = seed, epoch
        self._shuffle = shuffle
        self._slots = Permutation(shuffled, shuffle=shuffle, seed=seed, epoch=epoch).range(0, shuffled)
        self._nwin = -(-shuffled // window) + int(last)
        self._sizes = np.full(groups, -1, dtype=np.int64)
        self._wstarts: list[int] = [0]  # the starts of windows 0..counted (the last: its end)
        self._counted = 0  # windows whose sizes are all known, from the first on
        self._perms: OrderedDict[int, tuple[Permutation, IndexArray, IndexArray]] = OrderedDict()

    @property
    def groups(self) -> int:
        return self._groups

    @property
    def windows(self) -> int:
        """Windows of the epoch (the last group's own counted, with ``last``)."""
        return self._nwin

    def window_groups(self, k: int) -> IndexArray:
        """The groups of window ``k``, in the order of the epoch."""
        if not 0 <= k < self._nwin:
            raise IndexError(f"window {k} outside [0, {self._nwin})")
        if self._last and k == self._nwin - 1:
            return np.asarray([self._groups - 1], dtype=np.int64)
        return self._slots[k * self._w : (k + 1) * self._w]

    def learn(self, group: int, size: int) -> None:
        """Group ``group`` holds ``size`` samples (told again, it must be the same)."""
        if size < 0:
            raise ValueError(f"a group's size must be >= 0, got {size}")
        had = int(self._sizes[group])
        if had >= 0:
            if had != size:
                raise ValueError(f"group {group} was told {had} samples, now {size}")
            return
        self._sizes[group] = size
        while self._counted < self._nwin:
            sizes = self._sizes[self.window_groups(self._counted)]
            if (sizes < 0).any():
                break
            self._wstarts.append(self._wstarts[-1] + int(sizes.sum()))
            self._counted += 1

    def learn_many(self, sizes: npt.ArrayLike) -> None:
        """Every group's size at once (``-1``: not known)."""
        for g, s in enumerate(np.asarray(sizes, dtype=np.int64).tolist()):
            if s >= 0:
                self.learn(g, s)

    def next_groups(self) -> IndexArray:
        """The groups whose sizes the first window not counted yet needs (empty once all are)."""
        if self._counted == self._nwin:
            return np.zeros(0, dtype=np.int64)
        groups = self.window_groups(self._counted)
        return groups[self._sizes[groups] < 0]

    @property
    def counted_windows(self) -> int:
        """Windows whose groups' sizes are all known, from the first on."""
        return self._counted

    @property
    def known(self) -> int:
        """Positions ``[0, known)`` can be looked up: those of the windows counted."""
        return self._wstarts[-1]

    @property
    def complete(self) -> bool:
        return self._counted == self._nwin

    @property
    def sizes(self) -> IndexArray:
        """Each group's size, ``-1`` where not known yet (a copy)."""
        return self._sizes.copy()

    def __len__(self) -> int:
        if not self.complete:
            raise RuntimeError(
                f"the order's length is known once every group is counted ({self._counted} of "
                f"{self._nwin} windows are)"
            )
        return self.known

    def window_end(self, position: int) -> int:
        """The end of the window holding ``position`` (a counted one)."""
        if not 0 <= position < self.known:
            raise IndexError(f"position {position} outside the counted [0, {self.known})")
        k = bisect.bisect_right(self._wstarts, position) - 1
        return self._wstarts[k + 1]

    def _window(self, k: int) -> tuple[Permutation, IndexArray, IndexArray]:
        got = self._perms.get(k)
        if got is not None:
            self._perms.move_to_end(k)
            return got
        groups = self.window_groups(k)
        inner = np.concatenate([[0], np.cumsum(self._sizes[groups])]).astype(np.int64)
        key = hash64(f"guideloom-groups:{self._seed}:{self._epoch}:{k}")
        perm = Permutation(int(inner[-1]), shuffle=self._shuffle, seed=key, epoch=self._epoch)
        got = (perm, groups, inner)
        self._perms[k] = got
        if len(self._perms) > _KEEP_WINDOWS:
            self._perms.popitem(last=False)
        return got

    def take_keyed(self, positions: npt.ArrayLike) -> tuple[IndexArray, IndexArray]:
        """Each position's group and place in that group (positions in ``[0, known)``)."""
        flat = np.asarray(positions, dtype=np.int64).ravel()
        if not flat.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if flat.min() < 0 or flat.max() >= self.known:
            raise IndexError(f"positions outside the counted [0, {self.known})")
        wstarts = np.asarray(self._wstarts, dtype=np.int64)
        k = np.searchsorted(wstarts, flat, side="right") - 1
        groups = np.empty(len(flat), dtype=np.int64)
        places = np.empty(len(flat), dtype=np.int64)
        for win in np.unique(k).tolist():
            at = np.flatnonzero(k == win)
            perm, members, inner = self._window(win)
            q = perm.take(flat[at] - wstarts[win])
            g = np.searchsorted(inner, q, side="right") - 1
            groups[at] = members[g]
            places[at] = q - inner[g]
        return groups, places
