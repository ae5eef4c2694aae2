"""What an epoch order is, and the one keyed permutation: a random-access bijection of ``[0, n)``
fixed by ``(seed, epoch)``.

A balanced Feistel network over the smallest even number of bits that covers ``n``, with
cycle-walking to stay inside ``[0, n)``. A lookup costs O(1) time and the permutation O(1)
memory, so resuming at any offset of any epoch is instant, and a vectorised lookup serves a whole
read-ahead window with a handful of numpy operations.
"""

from __future__ import annotations

from typing import ClassVar, Final, Protocol

import numpy as np
import numpy.typing as npt

from guideloom._core.keys import ROUNDS, feistel, feistel_walk, hash_words

__all__ = ["LOOKUP_BLOCK", "SCALAR_WALK", "TABLE_BITS", "IndexArray", "Order", "Permutation"]


IndexArray = npt.NDArray[np.int64]

#: Values a vectorised lookup walks one by one in Python (:func:`~guideloom._core.keys.feistel_walk`):
#: a Feistel pass over an array is some sixty numpy calls, about as long as walking this many
#: values whatever the array's length, and a walk's last passes hold only a few stragglers (where
#: n is a quarter of the domain, 1,024 positions take about twenty passes, the last eight on
#: fewer than 16 values).
SCALAR_WALK = 16


#: The widest half of a network whose rounds a vectorised lookup tabulates: a round's function of
#: a half is then one gather from a table of ``2**half_bits`` values, where computing it is ten
#: numpy calls over 64-bit values (the network's passes ~3x faster; a lookup of 16k positions at
#: n=48,828, its cycle-walking included, ~1.6x). A table is made once a lookup holds at least as
#: many positions as it has entries, so it costs no more than that lookup; 6 tables of ``2**16``
#: values are 3 MiB.
TABLE_BITS = 16


#: Positions the loader looks up at a time by default (a permutation lookup is a few dozen numpy
#: operations whatever the array's length, so some 16k positions cost about what 16 do).
LOOKUP_BLOCK: Final = 16384


class Order(Protocol):
    """What the pipeline uses of an epoch order: a random-access bijection of ``[0, len)``.

    Besides the lookups, an order declares what the loader's reads follow: :attr:`span` and
    :meth:`window_end` (where a block shuffle's mixing windows end) and :attr:`lookup_block`.
    An order class subclasses this protocol and overrides the ones it has other values for.
    """

    __slots__ = ()

    lookup_block: ClassVar[int] = LOOKUP_BLOCK
    """Positions the loader looks up at a time (:data:`LOOKUP_BLOCK`); an order whose lookups
    cost more per position (a mixture's tree walk) asks for fewer, so that the first batch after
    a resume is fast."""

    def __len__(self) -> int: ...

    def __getitem__(self, position: int) -> int: ...

    def take(self, positions: npt.ArrayLike) -> IndexArray: ...

    def range(self, start: int, stop: int) -> IndexArray: ...

    @property
    def span(self) -> int:
        """Order positions per mixing window where the order reads whole blocks a window at a
        time (a block shuffle); 0 (the default) for an order without such windows, whose reads
        are then not cut at :meth:`window_end`."""
        return 0

    def window_end(self, position: int) -> int:
        """The end of the mixing window that holds order ``position``: a read that stops there
        fetches that window's blocks and no other's. ``len(self)`` (the default) where
        :attr:`span` is 0."""
        return len(self)

    @property
    def in_order(self) -> bool:
        """Whether position ``i`` is sample ``i`` (no shuffle): a read of a few batches is then
        one long range, coalesced as well as a read of many."""
        return False


def _round_keys(seed: int, epoch: int) -> tuple[int, ...]:
    """Derive the Feistel round keys from ``(seed, epoch)`` with a stable hash."""
    return hash_words(f"guideloom-order:{seed}:{epoch}", ROUNDS)


class Permutation(Order):
    """A random-access permutation of ``[0, n)`` fixed by ``(seed, epoch)``.

    ``perm[i]`` and ``perm.take(positions)`` map order positions to observation indexes. The
    identity is used when ``shuffle`` is false.
    """

    __slots__ = ("_half_bits", "_half_mask", "_keys", "_keys_np", "_masks", "_shuffle", "_tables", "n")

    def __init__(self, n: int, *, shuffle: bool, seed: int, epoch: int) -> None:
        if n < 0:
            raise ValueError(f"a permutation needs n >= 0, got {n}")
        self.n = n
        self._shuffle = shuffle and n > 1
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1  # balanced halves: an even number of bits
        self._half_bits = bits // 2
        self._half_mask = (1 << self._half_bits) - 1
        self._masks = (self._half_mask, self._half_mask)
        self._keys = _round_keys(seed, epoch)
        self._keys_np = tuple(np.uint64(k) for k in self._keys)
        #: Each round's function tabulated over a half's values (:meth:`_round_tables`).
        self._tables: tuple[IndexArray, ...] | None = None

    def __len__(self) -> int:
        return self.n

    @property
    def in_order(self) -> bool:
        return not self._shuffle

    def __getstate__(self) -> dict[str, object]:
        """Pickled without its round tables (up to 3 MiB; an epoch sent to process workers
        carries its order): whoever unpickles it makes them again where it needs them."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "_tables"}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._tables = None

    # -- scalar path -------------------------------------------------------------------------
    def _walk(self, x: int) -> int:
        """The network applied to ``x`` until it lands in ``[0, n)`` (cycle-walking: a few steps
        on average, the domain is < 4n)."""
        return feistel_walk(x, self.n, self._half_bits, self._masks, self._keys)

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
        if not self._shuffle:
            return position
        return self._walk(position)

    # -- vectorised path ---------------------------------------------------------------------
    def _feistel(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        tables = self._round_tables(len(x))
        if tables is not None:
            return _feistel_tabulated(x, self._half_bits, tables)
        mask = np.uint64(self._half_mask)
        return feistel(x, np.uint64(self._half_bits), (mask, mask), self._keys_np)

    def _round_tables(self, size: int) -> tuple[IndexArray, ...] | None:
        """Each round's function (:func:`~guideloom._core.keys.feistel_round` of a half, masked)
        for every value of a half, where a half is at most :data:`TABLE_BITS` wide and a lookup
        of ``size`` positions would compute as many values as a table has (None otherwise)."""
        tables = self._tables
        if tables is None and self._half_bits <= TABLE_BITS and size >= 1 << self._half_bits:
            # one round of the network over (0, right) for every right: its right half out is
            # the round's masked function of right
            half = np.arange(1 << self._half_bits, dtype=np.uint64)
            bits, mask = np.uint64(self._half_bits), np.uint64(self._half_mask)
            self._tables = tables = tuple(
                (feistel(half, bits, (mask, mask), (key,)) & mask).astype(np.intp) for key in self._keys_np
            )
        return tables

    def take(self, positions: npt.ArrayLike) -> IndexArray:
        """Map an array of order positions to observation indexes (vectorised)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        if not self._shuffle:
            return pos.copy()
        if pos.size <= SCALAR_WALK:  # a few positions: cheaper one by one than by numpy calls
            walk = self._walk
            return np.array([walk(p) for p in pos.ravel().tolist()], dtype=np.int64).reshape(pos.shape)
        x = self._feistel(pos.ravel().astype(np.uint64))
        n = np.uint64(self.n)
        out_of_range = np.flatnonzero(x >= n)
        while out_of_range.size > SCALAR_WALK:
            walked = self._feistel(x[out_of_range])
            x[out_of_range] = walked
            out_of_range = out_of_range[walked >= n]
        if out_of_range.size:  # the walk's stragglers, one by one
            walk = self._walk
            x[out_of_range] = [walk(v) for v in x[out_of_range].tolist()]
        return x.astype(np.int64).reshape(pos.shape)

    def range(self, start: int, stop: int) -> IndexArray:
        """Observation indexes at order positions ``[start, stop)``."""
        if not self._shuffle:
            return np.arange(start, stop, dtype=np.int64)
        return self.take(np.arange(start, stop, dtype=np.int64))


def _feistel_tabulated(
    x: npt.NDArray[np.uint64], half_bits: int, tables: tuple[IndexArray, ...]
) -> npt.NDArray[np.uint64]:
    """:func:`~guideloom._core.keys.feistel` of a balanced network whose rounds are ``tables``
    (each round's masked function of a half, by the half's value): the same values, each round
    a gather and an xor."""
    v = x.view(np.int64)  # values below 2**(2 * TABLE_BITS): the same bits as signed
    left = v >> half_bits
    right = v & ((1 << half_bits) - 1)
    z = np.empty_like(left)
    for table in tables:
        table.take(right, out=z, mode="clip")  # (every half is in the table's range)
        np.bitwise_xor(z, left, out=z)
        left, right, z = right, z, left
    np.left_shift(left, half_bits, out=left)
    np.bitwise_or(left, right, out=left)
    return left.view(np.uint64)
