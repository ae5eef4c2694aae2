"""The keyed mixing every seeded order shares: splitmix64's constants and finaliser, the Feistel
round function, and stable hashes of text (blake2b), so that an order is a pure function of its
seed and epoch on every machine and Python version.

:class:`~guideloom._core.permutation.Permutation`, the block shuffle of
:mod:`guideloom._core.order` and a mixture's per-source orders all draw their keys and rounds
from here.
"""

from __future__ import annotations

import hashlib
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "GOLDEN",
    "MASK64",
    "MIX1",
    "MIX2",
    "ROUNDS",
    "feistel_round",
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
