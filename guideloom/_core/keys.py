"""The keyed mixing every seeded order shares: splitmix64's constants and finaliser, the Feistel
round function, and stable hashes of text (blake2b), so that an order is a pure function of its
seed and epoch on every machine and Python version.

:class:`~guideloom._core.permutation.Permutation`, the block shuffle of
:mod:`guideloom._core.order` and a mixture's per-source orders all draw their keys and rounds
from here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = [
    "GOLDEN",
    "MASK64",
    "MIX1",
    "MIX2",
    "ROUNDS",
    "feistel",
    "feistel_round",
    "feistel_scalar",
    "feistel_walk",
    "hash64",
    "hash_words",
    "splitmix",
    "splitmix_scalar",
]

#: Feistel rounds of every keyed permutation.
ROUNDS: Final = 6
MASK64: Final = (1 << 64) - 1
#: The golden-ratio increment of splitmix64.
GOLDEN: Final = 0x9E3779B97F4A7C15
#: splitmix64's multipliers.
MIX1: Final = 0xBF58476D1CE4E5B9
MIX2: Final = 0x94D049BB133111EB

_MIX1_U: Final = np.uint64(MIX1)
_MIX2_U: Final = np.uint64(MIX2)
_S27, _S29, _S30, _S31 = np.uint64(27), np.uint64(29), np.uint64(30), np.uint64(31)

U64: TypeAlias = npt.NDArray[np.uint64]
#: A width, mask or key: one for every element, or one per element.
U64s: TypeAlias = "np.uint64 | npt.NDArray[np.uint64]"


def hash_words(text: str, count: int) -> tuple[int, ...]:
    """``count`` 64-bit words of a stable hash of ``text`` (blake2b of ``8 * count`` bytes)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8 * count).digest()
    return tuple(int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(count))


def hash64(text: str) -> int:
    """A stable 64-bit hash of ``text``."""
    return hash_words(text, 1)[0]


def splitmix_scalar(x: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit mixer."""
    z = x & MASK64
    z ^= z >> 30
    z = (z * MIX1) & MASK64
    z ^= z >> 27
    z = (z * MIX2) & MASK64
    return z ^ (z >> 31)


def splitmix(x: npt.NDArray[np.uint64], *, inplace: bool = False) -> npt.NDArray[np.uint64]:
    """:func:`splitmix_scalar` element-wise; ``inplace`` overwrites ``x`` (a temporary)."""
    if not inplace:
        x = x.copy()
    t = x >> _S30
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _MIX1_U, out=x)
    np.right_shift(x, _S27, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _MIX2_U, out=x)
    np.right_shift(x, _S31, out=t)
    np.bitwise_xor(x, t, out=x)
    return x


def feistel_round(right: int, key: int) -> int:
    """The round function of every Feistel network here (before masking to a half's width)."""
    z = ((right ^ key) * MIX1) & MASK64
    z ^= z >> 31
    z = (z * MIX2) & MASK64
    return z ^ (z >> 29)


def feistel_scalar(
    x: int, right_bits: int, masks: tuple[int, int], keys: Iterable[int], wkey: int = 0
) -> int:
    """The Feistel network of every keyed order here, on one value: ``x``'s low ``right_bits``
    bits are the right half; round ``i`` keys :func:`feistel_round` with ``key ^ wkey`` and masks
    its output to ``masks[i & 1]`` (the width of the half it lands in: halves of unequal width
    alternate)."""
    left, right = x >> right_bits, x & masks[1]
    for i, key in enumerate(keys):
        left, right = right, left ^ (feistel_round(right, wkey ^ key) & masks[i & 1])
    return (left << right_bits) | right


def feistel_walk(
    x: int, n: int, right_bits: int, masks: tuple[int, int], keys: Iterable[int], wkey: int = 0
) -> int:
    """:func:`feistel_scalar` applied to ``x`` until the result is below ``n`` (cycle-walking
    back into ``[0, n)``), the rounds written out: a lookup of one value, or the few values a
    vectorised walk has left, costs a few microseconds where a numpy call costs about one."""
    rounds = [(wkey ^ key, masks[i & 1]) for i, key in enumerate(keys)]
    mask_r = masks[1]
    mix1, mix2, mask64 = MIX1, MIX2, MASK64  # locals: read in every round
    while True:
        left, right = x >> right_bits, x & mask_r
        for key, mask in rounds:
            z = ((right ^ key) * mix1) & mask64
            z ^= z >> 31
            z = (z * mix2) & mask64
            left, right = right, left ^ ((z ^ (z >> 29)) & mask)
        x = (left << right_bits) | right
        if x < n:
            return x


def feistel(
    x: U64, right_bits: U64s, masks: tuple[U64s, U64s], keys: Iterable[U64s], wkey: U64s | None = None
) -> U64:
    """:func:`feistel_scalar` over an array, in place in two scratch buffers (no temporary per
    operation); each width, mask and key is a scalar or one per element of ``x``."""
    left = x >> right_bits
    right = x & masks[1]
    z, t = np.empty_like(left), np.empty_like(left)
    for i, key in enumerate(keys):
        np.bitwise_xor(right, key, out=z)
        if wkey is not None:
            np.bitwise_xor(z, wkey, out=z)
        np.multiply(z, _MIX1_U, out=z)
        np.right_shift(z, _S31, out=t)
        np.bitwise_xor(z, t, out=z)
        np.multiply(z, _MIX2_U, out=z)
        np.right_shift(z, _S29, out=t)
        np.bitwise_xor(z, t, out=z)
        np.bitwise_and(z, masks[i & 1], out=z)
        np.bitwise_xor(z, left, out=z)
        left, right, z = right, z, left  # the old left's buffer is the next round's scratch
    np.left_shift(left, right_bits, out=left)
    np.bitwise_or(left, right, out=left)
    return left
