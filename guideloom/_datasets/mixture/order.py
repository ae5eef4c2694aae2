"""A mixture's order: each position's source (the schedule), then the source's own seeded
order of the sample that position reads. See :mod:`guideloom._datasets.mixture`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from guideloom._core.keys import GOLDEN, MIX1, MIX2, ROUNDS, feistel, hash64, splitmix
from guideloom._core.mixture import Layout
from guideloom._core.permutation import IndexArray, Order, Permutation
from guideloom._core.weight_schedule import ScheduledLayout
from guideloom._datasets.base import DatasetAbstract

__all__ = ["KeyedPermutation", "MixtureOrder", "SourceKeys"]

_MIX1: Final = np.uint64(MIX1)
_MIX2: Final = np.uint64(MIX2)
_GOLDEN: Final = np.uint64(GOLDEN)
_S31, _S29 = np.uint64(31), np.uint64(29)
_ROUND_OFFSETS: Final = np.asarray(
    [((r + 1) * GOLDEN) & ((1 << 64) - 1) for r in range(ROUNDS)], dtype=np.uint64
)
_ORDER_CACHE: Final = 4096  # (source, source epoch) orders a MixtureOrder keeps


def _epoch_keys(
    source_keys: npt.NDArray[np.uint64], epochs: npt.NDArray[np.uint64]
) -> npt.NDArray[np.uint64]:
    """The Feistel round keys of source epochs, shape ``(rounds, len)``: splitmix64 of the
    source's key and the epoch, then of that and the round (independent keys per source epoch
    without a hash call each: a thousand sources' epochs cost a few numpy operations)."""
    base = splitmix(source_keys ^ splitmix(epochs * _GOLDEN + _GOLDEN, inplace=True), inplace=True)
    return splitmix(base[None, :] + _ROUND_OFFSETS[:, None], inplace=True)


class KeyedPermutation(Permutation):
    """:class:`~guideloom._core.plan.Permutation` with given round keys: one source epoch's order, as
    :class:`MixtureOrder` computes it vectorised (the scalar reference of the tests)."""

    def __init__(self, n: int, keys: Sequence[int]) -> None:
        super().__init__(n, shuffle=True, seed=0, epoch=0)
        self._keys = tuple(int(k) for k in keys)
        self._keys_np = tuple(np.uint64(k) for k in self._keys)


class SourceKeys:
    """Each source's permutation key for a seed, from hashes of the sources' names.

    Part of the order, not of the dataset: it depends on the names and the seed alone, so it is
    kept apart from :class:`Mixture`'s sources and caches (a mixture made with another sequence
    length shares it). The name hashes are made once, the keys of the last seed kept.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names
        self._name_keys: npt.NDArray[np.uint64] | None = None
        self._seed_cache: tuple[int, npt.NDArray[np.uint64]] | None = None

    def name_keys(self) -> npt.NDArray[np.uint64]:
        """A stable 64-bit hash of each source's name, made once."""
        if self._name_keys is None:
            hashes = [hash64(f"guideloom-mix-source:{name}") for name in self._names]
            self._name_keys = np.asarray(hashes, dtype=np.uint64)
        return self._name_keys

    def for_seed(self, seed: int) -> npt.NDArray[np.uint64]:
        """Each source's permutation key for ``seed``: splitmix64 of a hash of its name (made once)
        and a hash of the seed, so a new seed costs one hash, not one per source."""
        if self._seed_cache is None or self._seed_cache[0] != seed:
            seed_key = splitmix(
                np.asarray([hash64(f"guideloom-mix-seed:{seed}")], dtype=np.uint64), inplace=True
            )
            self._seed_cache = (seed, splitmix(self.name_keys() ^ seed_key, inplace=True))
        return self._seed_cache[1]


class MixtureOrder(Order):
    """One epoch of a mixture's order: position ``[0, num_samples)`` to a key of the mixture
    (a source's offset + an index in that source), see :mod:`guideloom._datasets.mixture`."""

    def __init__(
        self,
        datasets: Sequence[DatasetAbstract[Any]],
        layout: Layout,
        keys: SourceKeys,
        own_order: npt.NDArray[np.bool_],
        *,
        shuffle: bool,
        seed: int,
        epoch: int,
        scheduled: ScheduledLayout | None = None,
    ) -> None:
        self._datasets = datasets
        self._layout = layout
        self._scheduled = scheduled
        self._shuffle = shuffle
        self._seed = seed
        self.epoch = epoch
        self._source_keys = keys.for_seed(seed)
        # a source's own order (a nested mixture, a packed dataset) is seeded by its key
        self._seeds = [int(k) >> 1 for k in self._source_keys.tolist()]
        self._own_order = own_order
        self._orders: dict[tuple[int, int], Order] = {}
        n = layout.lengths
        bits = np.maximum(2, _bit_length(n - 1))
        bits += bits & 1
        self._half = (bits // 2).astype(np.uint64)  # Permutation's half width, per source
        self._mask = (np.uint64(1) << self._half) - np.uint64(1)

    lookup_block = 2048
    """Positions the loader looks up at a time (its default is 16k, for plain permutations): a
    mixture position costs a tree walk, so a smaller block keeps the first batch after a resume
    fast, and costs nothing per batch."""

    def __len__(self) -> int:
        return self._layout.num_samples

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} outside [0, {len(self)})")
        return int(self.take(np.asarray([position], dtype=np.int64))[0])

    def range(self, start: int, stop: int) -> IndexArray:
        """Keys at positions ``[start, stop)``."""
        return self.take(np.arange(start, stop, dtype=np.int64))

    def sources(self, positions: npt.ArrayLike) -> tuple[IndexArray, IndexArray, IndexArray]:
        """For each position: its source, the source's epoch and the index in the source."""
        lay = self._layout
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= lay.num_samples):
            raise IndexError(f"positions outside [0, {lay.num_samples})")
        if self._scheduled is not None:  # weights that change with progress: global positions
            src, cum = self._scheduled.locate(self.epoch * lay.num_samples + pos)
        else:
            src, local = lay.locate(pos)
            cum = self.epoch * lay.per_epoch[src] + local
        length = lay.lengths[src]
        source_epoch, within = np.divmod(cum, length)
        return src, source_epoch, self._permute(src, source_epoch, within)

    def take(self, positions: npt.ArrayLike) -> IndexArray:
        """Keys at ``positions`` (vectorised)."""
        src, _, index = self.sources(positions)
        return self._layout.offsets[src] + index

    def _permute(self, src: IndexArray, source_epoch: IndexArray, within: IndexArray) -> IndexArray:
        """``within`` through each source's order of its own epoch."""
        own = self._own_order[src]
        out = within.copy()
        if self._shuffle and not own.all():
            sel = np.flatnonzero(~own & (self._layout.lengths[src] > 1))
            if sel.size:
                out[sel] = self._feistel_take(src[sel], source_epoch[sel], within[sel])
        if own.any():
            sel = np.flatnonzero(own)
            group = src[sel] * (int(source_epoch[sel].max()) + 1) + source_epoch[sel]
            for g in np.unique(group):
                idx = sel[group == g]
                out[idx] = self._own(int(src[idx[0]]), int(source_epoch[idx[0]])).take(within[idx])
        return out

    def _own(self, s: int, source_epoch: int) -> Order:
        key = (s, source_epoch)
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) >= _ORDER_CACHE:
                self._orders.clear()
            order = self._datasets[s].order(shuffle=self._shuffle, seed=self._seeds[s], epoch=source_epoch)
            assert order is not None  # checked when the order was made
            self._orders[key] = order
        return order

    def source_permutation(self, s: int, source_epoch: int) -> Permutation:
        """Source ``s``'s order in its epoch ``source_epoch`` (a scalar reference of what
        :meth:`take` computes vectorised; shuffled mixtures only)."""
        keys = _epoch_keys(self._source_keys[[s]], np.asarray([source_epoch], dtype=np.uint64))
        return KeyedPermutation(int(self._layout.lengths[s]), keys[:, 0].tolist())

    def _feistel_take(self, src: IndexArray, source_epoch: IndexArray, within: IndexArray) -> IndexArray:
        """Every element through its own source epoch's keyed permutation, in one pass."""
        keys = _epoch_keys(self._source_keys[src], source_epoch.astype(np.uint64))
        n = self._layout.lengths[src].astype(np.uint64)
        h, mask = self._half[src], self._mask[src]
        x = feistel(within.astype(np.uint64), h, (mask, mask), keys)
        out = np.flatnonzero(x >= n)
        while out.size:  # cycle-walking, as Permutation does
            walked = feistel(x[out], h[out], (mask[out], mask[out]), keys[:, out])
            x[out] = walked
            out = out[walked >= n[out]]
        return x.astype(np.int64)


def _bit_length(v: IndexArray) -> IndexArray:
    """``int.bit_length`` element-wise for ``0 <= v < 2^62`` (exact: by comparison, not log2)."""
    bits = np.zeros(v.shape, dtype=np.int64)
    x = v.copy()
    for step in (32, 16, 8, 4, 2, 1):
        big = x >= (1 << step)
        bits[big] += step
        x[big] >>= step
    return bits + (x > 0)
