"""Pure epoch orders: the identity, a global row shuffle, or a chunk-aware (block) shuffle.

Nothing here does I/O, starts threads or imports torch. A chunk-aware order lets a remote reader
fetch a few large contiguous blocks instead of one small range per sample, while staying what
:class:`~guideloom._core.plan.Permutation` is: a random-access bijection of ``[0, N)`` fixed by
``(seed, epoch, N, block_size, window)``, so resume at any offset, another batch size and another
world size work exactly as with the global shuffle.

The order of :class:`BlockPermutation` is built in two steps:

1. Samples are grouped in contiguous *blocks* of ``block_size`` (the last one is short when
   ``block_size`` does not divide ``N``). The blocks are laid out in a seeded random order of
   *slots*: the full blocks by a keyed :class:`Permutation`, the one short block at a seeded slot.
2. Consecutive slots are grouped in *windows* of ``window`` blocks, and the samples of each window
   are shuffled among themselves by a keyed Feistel permutation of the window's own size, its keys
   derived from ``(seed, epoch, window index)``.

Only one block can be short, so the sample layout is uniform except for one known gap of
``block_size - len(short block)`` samples: position -> (window, offset) and layout -> (slot,
offset) are closed forms, and a lookup costs O(1) time and memory at any position.
"""

from __future__ import annotations

from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from guideloom._core.keys import (
    GOLDEN,
    MIX1,
    MIX2,
    ROUNDS,
    feistel,
    feistel_walk,
    hash_words,
    splitmix,
    splitmix_scalar,
)
from guideloom._core.permutation import LOOKUP_BLOCK, IndexArray, Order, Permutation

__all__ = [
    "DEFAULT_WINDOW",
    "LOCAL_BLOCK_SIZE",
    "LOOKUP_BLOCK",
    "REMOTE_BLOCK_BYTES",
    "BlockPermutation",
    "Order",
    "default_block_size",
    "make_order",
    "resolve_block_size",
]

REMOTE_BLOCK_BYTES: Final = 4 * 1024 * 1024
"""Default bytes per shuffle block on object storage: large enough that a GET's round trip is
amortised over megabytes, small enough that a window of blocks fits in a read-ahead buffer."""

LOCAL_BLOCK_SIZE: Final = 1
"""Default samples per shuffle block for memory and local files: a global row shuffle (reads
there cost the same wherever they land, so nothing is gained by giving up mixing)."""

DEFAULT_WINDOW: Final = 16
"""Default blocks per mixing window (see ``benchmarks/shuffle_quality.py`` for the measurement
it was chosen from)."""

#: Positions a lookup takes one by one (a scalar lookup is two cycle-walks, some ten microseconds;
#: a vectorised one is over a hundred numpy calls whatever the count).
SCALAR_LOOKUPS: Final = 8

_ROUNDS: Final = ROUNDS
_GOLDEN: Final = GOLDEN
_MIX1: Final = np.uint64(MIX1)
_MIX2: Final = np.uint64(MIX2)
_S29, _S30, _S31, _S27 = np.uint64(29), np.uint64(30), np.uint64(31), np.uint64(27)
_ONE: Final = np.uint64(1)

_U64 = npt.NDArray[np.uint64]
_Width = npt.NDArray[np.uint64] | np.uint64  # per position, or one for a whole call


def _block_keys(seed: int, epoch: int, n: int, block_size: int) -> tuple[int, tuple[int, ...], int]:
    """The short block's slot seed, the window round keys and the window-key salt.

    A stable hash (blake2b), like :func:`guideloom._core.permutation._round_keys`, under another prefix so
    that the keys are independent of the block permutation's.
    """
    words = hash_words(f"guideloom-blocks:{seed}:{epoch}:{n}:{block_size}", _ROUNDS + 2)
    return words[0], tuple(words[1 : _ROUNDS + 1]), words[_ROUNDS + 1]


def _domain_bits(size: int) -> int:
    """Bits of the smallest Feistel domain covering ``[0, size)`` (at least one).

    The window permutation is an unbalanced Feistel network (halves of ``bits - bits // 2`` and
    ``bits // 2`` bits, alternating), so any width works and the domain is below ``2 * size``:
    cycle-walking back into ``[0, size)`` takes two steps on average.
    """
    return max(1, (size - 1).bit_length())


class BlockPermutation(Order):
    """A chunk-aware permutation of ``[0, n)``: seeded blocks, shuffled within windows of blocks.

    ``perm[i]``, ``perm.take(positions)`` and ``perm.range(start, stop)`` map order positions to
    sample indexes, as :class:`~guideloom._core.plan.Permutation` does. Each window of ``window``
    consecutive blocks in the order holds exactly the samples of its blocks, in a random order;
    ``block_size=1, window=1`` is exactly the global row shuffle ``Permutation(n, seed, epoch)``.
    """

    __slots__ = (
        "_b",
        "_bits_full",
        "_bits_last",
        "_bits_short",
        "_blocks",
        "_keys",
        "_keys_np",
        "_last_window",
        "_m_full",
        "_m_last",
        "_m_short",
        "_nb",
        "_pad",
        "_salt",
        "_short_slot",
        "_short_window",
        "_split",
        "_w",
        "_window_samples",
        "n",
    )

    def __init__(self, n: int, *, seed: int, epoch: int, block_size: int, window: int) -> None:
        if n < 0:
            raise ValueError(f"a permutation needs n >= 0, got {n}")
        if block_size < 1:
            raise ValueError(f"shuffle_block_size must be >= 1, got {block_size}")
        if window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {window}")
        self.n = n
        b, w = block_size, window
        self._b, self._w = b, w
        nb = -(-n // b)  # blocks, the last one short when b does not divide n
        self._nb = nb
        short = n - (nb - 1) * b if nb else b  # samples in the last block
        full_blocks = nb if short == b else nb - 1
        self._blocks = Permutation(full_blocks, shuffle=True, seed=seed, epoch=epoch)
        slot_seed, self._keys, self._salt = _block_keys(seed, epoch, n, b)
        self._keys_np = tuple(np.uint64(k) for k in self._keys)
        # The layout: slot s starts at sample s*b, except that the slots after the short block's
        # start `pad` samples earlier. Without a short block its slot is past the end (no gap).
        self._pad = b - short
        self._short_slot = slot_seed % nb if self._pad else nb
        self._split = self._short_slot * b + short if self._pad else n  # end of the short block
        # Window sizes in samples: all w*b, except the window holding the short block and the
        # last window (fewer slots); they may be the same window.
        self._window_samples = w * b
        self._short_window = self._short_slot // w if self._pad else -1
        self._last_window = max(0, -(-nb // w) - 1)
        self._m_full = w * b
        self._m_short = w * b - self._pad
        self._m_last = (nb - self._last_window * w) * b - (
            self._pad if self._short_window == self._last_window else 0
        )
        self._bits_full = _domain_bits(self._m_full)
        self._bits_short = _domain_bits(self._m_short)
        self._bits_last = _domain_bits(self._m_last)

    def __len__(self) -> int:
        return self.n

    @property
    def span(self) -> int:
        """Order positions per mixing window (``window * block_size``): a read of one span's
        positions fetches whole blocks (only the window holding the short block is shorter)."""
        return self._window_samples

    def window_end(self, position: int) -> int:
        """The end of the mixing window that holds order ``position``: a read that stops there
        fetches that window's blocks and no other's. Windows after the short block's start
        ``block_size - len(short block)`` positions before a multiple of :attr:`span`."""
        m, pad, t = self._m_full, self._pad, self._short_window
        k = position // m
        if t < 0 or k < t:
            return min(self.n, (k + 1) * m)
        if position >= (t + 1) * m - pad:  # past the short window: its successors start pad earlier
            k = (position + pad) // m
        return min(self.n, (k + 1) * m - pad)

    # -- scalar path -------------------------------------------------------------------------
    def _window_size(self, k: int) -> tuple[int, int]:
        """Samples in window ``k`` and the bits of its Feistel domain."""
        if k == self._last_window:
            return self._m_last, self._bits_last
        if k == self._short_window:
            return self._m_short, self._bits_short
        return self._m_full, self._bits_full

    def _walk(self, x: int, size: int, bits: int, wkey: int) -> int:
        """The window's network applied to ``x`` until it lands in ``[0, size)`` (cycle-walking:
        the domain is < 2 * size)."""
        right_bits = bits // 2
        masks = ((1 << (bits - right_bits)) - 1, (1 << right_bits) - 1)
        return feistel_walk(x, size, right_bits, masks, self._keys, wkey)

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
        b, pad, split, t = self._b, self._pad, self._split, self._short_slot
        k = (position + pad if position >= split else position) // self._window_samples
        start = k * self._window_samples - (pad if k * self._w > t else 0)
        size, bits = self._window_size(k)
        wkey = splitmix_scalar(k * _GOLDEN + self._salt)
        q = start + self._walk(position - start, size, bits, wkey)
        slot, offset = divmod(q + pad if q >= split else q, b)
        block = self._nb - 1 if slot == t else self._blocks[slot - 1 if slot > t else slot]
        return block * b + offset

    # -- vectorised path ---------------------------------------------------------------------
    def _feistel(self, x: _U64, bits: _Width, wkey: _U64) -> _U64:
        """The scalar rounds over an array; ``bits`` per element or one for all."""
        right_bits = bits >> _ONE
        masks = ((_ONE << (bits - right_bits)) - _ONE, (_ONE << right_bits) - _ONE)
        return feistel(x, right_bits, masks, self._keys_np, wkey)

    def _windows(self, k: IndexArray) -> tuple[_Width, _Width, _U64]:
        """Size, Feistel bits and key of the window of each position (``k``: window indexes).

        Only the last window and the short block's differ in size: when neither is among ``k``
        (the usual read-ahead range) size and bits are scalars, and each key is computed once
        per window of the range rather than once per position.
        """
        lo, hi = int(k.min()), int(k.max())
        salt, golden = np.uint64(self._salt), np.uint64(_GOLDEN)
        if hi - lo < k.size // 2:
            wkey = splitmix(np.arange(lo, hi + 1, dtype=np.uint64) * golden + salt, inplace=True)[k - lo]
        else:
            wkey = splitmix(k.astype(np.uint64) * golden + salt, inplace=True)
        if not (lo <= self._last_window <= hi or lo <= self._short_window <= hi):
            return np.uint64(self._m_full), np.uint64(self._bits_full), wkey
        is_last = k == self._last_window
        size = np.where(is_last, self._m_last, self._m_full).astype(np.uint64)
        bits = np.where(is_last, self._bits_last, self._bits_full).astype(np.uint64)
        if self._short_window != self._last_window:
            is_short = k == self._short_window
            size[is_short] = self._m_short
            bits[is_short] = self._bits_short
        return size, bits, wkey

    def _block_ids(self, full: IndexArray) -> IndexArray:
        """Full-block slot -> block id; one lookup per distinct slot of a compact range."""
        lo, hi = int(full.min()), int(full.max())
        if hi - lo < full.size // 2:  # positions of a range revisit each slot block_size times
            return self._blocks.range(lo, hi + 1)[full - lo]
        return self._blocks.take(full)

    def take(self, positions: npt.ArrayLike) -> IndexArray:
        """Map an array of order positions to sample indexes (vectorised)."""
        given = np.asarray(positions, dtype=np.int64)
        if not given.size:
            return np.zeros(given.shape, dtype=np.int64)
        if given.min() < 0 or given.max() >= self.n:
            raise IndexError(f"positions outside [0, {self.n})")
        if given.size <= SCALAR_LOOKUPS:  # a few positions: cheaper one by one than by numpy calls
            return np.array([self[p] for p in given.ravel().tolist()], dtype=np.int64).reshape(given.shape)
        return self._take(given.ravel()).reshape(given.shape)

    def _take(self, pos: IndexArray) -> IndexArray:
        b, pad, split, t = self._b, self._pad, self._split, self._short_slot
        # position -> window k and offset in it (closed form around the one gap)
        k = (pos + pad * (pos >= split)) // self._window_samples if pad else pos // self._window_samples
        start = k * self._window_samples
        if pad:
            start -= pad * (k * self._w > t)
        size, bits, wkey = self._windows(k)
        # offset in the window -> layout offset, by the window's own keyed Feistel permutation
        u = self._feistel((pos - start).astype(np.uint64), bits, wkey)
        walk = np.flatnonzero(u >= size)
        while walk.size:  # cycle-walking: the domain is < 2 * size
            sub_size = size[walk] if isinstance(size, np.ndarray) else size
            sub_bits = bits[walk] if isinstance(bits, np.ndarray) else bits
            stepped = self._feistel(u[walk], sub_bits, wkey[walk])
            u[walk] = stepped
            walk = walk[stepped >= sub_size]
        # layout position -> (slot, offset) -> sample
        q = start + u.astype(np.int64)
        if pad:
            q += pad * (q >= split)
        slot = q // b
        offset = q - slot * b
        if not pad:
            return self._block_ids(slot) * b + offset
        in_short = slot == t
        full = slot - (slot > t)
        full[in_short] = 0
        block = self._block_ids(full) if len(self._blocks) else np.zeros_like(full)
        block[in_short] = self._nb - 1
        return block * b + offset

    def range(self, start: int, stop: int) -> IndexArray:
        """Sample indexes at order positions ``[start, stop)``."""
        return self.take(np.arange(start, stop, dtype=np.int64))


def make_order(
    n: int, *, shuffle: bool, seed: int, epoch: int, block_size: int = 1, window: int = DEFAULT_WINDOW
) -> Order:
    """The epoch order for these settings.

    No shuffle: the identity (``block_size`` and ``window`` do not matter). ``block_size=1``: the
    global row shuffle :class:`Permutation`, the order earlier versions saved checkpoints against
    (``window`` does not matter: single-sample blocks are already fully mixed). Otherwise a
    :class:`BlockPermutation`.
    """
    if block_size < 1:
        raise ValueError(f"shuffle_block_size must be >= 1, got {block_size}")
    if window < 1:
        raise ValueError(f"shuffle_window must be >= 1, got {window}")
    if not shuffle or block_size == 1:
        return Permutation(n, shuffle=shuffle, seed=seed, epoch=epoch)
    return BlockPermutation(n, seed=seed, epoch=epoch, block_size=block_size, window=window)


def default_block_size(sample_nbytes: int, target_bytes: int = REMOTE_BLOCK_BYTES) -> int:
    """Samples per shuffle block so that a block holds about ``target_bytes`` (at least one).

    For object storage pass the (mean) stored bytes of one sample; memory and local files use
    :data:`LOCAL_BLOCK_SIZE` instead.
    """
    if sample_nbytes < 1:
        raise ValueError(f"sample_nbytes must be >= 1, got {sample_nbytes}")
    if target_bytes < 1:
        raise ValueError(f"target_bytes must be >= 1, got {target_bytes}")
    return max(1, target_bytes // sample_nbytes)


def resolve_block_size(
    requested: int | Literal["auto"] | None, *, block_bytes: int | None, sample_nbytes: int
) -> int:
    """Samples per shuffle block for a loader's ``shuffle_block_size``.

    ``None`` (the default): ``1``, the global row shuffle, whatever the storage, so the order is
    the same over memory, local files and object storage. ``"auto"``: the storage's choice,
    blocks of about ``block_bytes`` (a storage's ``shuffle_block_bytes``; object stores say
    :data:`REMOTE_BLOCK_BYTES`) of ``sample_nbytes`` each, or :data:`LOCAL_BLOCK_SIZE` where
    the storage names no block size (memory, local files) or the sample size is unknown. An int
    is used as given.
    """
    if requested is None:
        return 1
    if requested == "auto":
        if block_bytes is None or sample_nbytes < 1:
            return LOCAL_BLOCK_SIZE
        return default_block_size(sample_nbytes, block_bytes)
    return requested
