"""Argument checks shared by the loader and the datasets: one place that says what a valid
option is, so every option is checked the same way (and the error says how to fix it)."""

from __future__ import annotations

import numbers
from typing import Any, Literal, cast

import numpy as np

__all__ = [
    "check_block_size",
    "check_bool",
    "check_int",
    "check_optional_int",
]


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an ``int`` of at least ``minimum``.

    Any integral number is accepted (``int``, numpy integers: ``numbers.Integral``), a ``bool``
    is not (``True`` as a batch size is a bug, not a request for one sample).
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    number = int(value)
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def check_optional_int(name: str, value: Any) -> int | None:
    """``None``, or ``value`` as an ``int`` (any sign; see :func:`check_int`)."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    return int(value)


def check_block_size(value: Any) -> int | Literal["auto"] | None:
    """``shuffle_block_size``: ``None`` (global row shuffle), ``"auto"`` (the storage's
    default) or an ``int`` of at least 1 samples per block."""
    if value is None or value == "auto":
        return cast('Literal["auto"] | None', value)
    if isinstance(value, str):
        raise ValueError(
            f"shuffle_block_size must be an int >= 1 (samples per block), 'auto' (the storage's "
            f"default: ~4 MiB blocks on object storage, a global shuffle elsewhere) or None (a "
            f"global row shuffle), got {value!r}"
        )
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"shuffle_block_size must be an int, 'auto' or None, got {type(value).__name__} {value!r}"
        )
    return check_int("shuffle_block_size", value, 1)


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a ``bool``: ``True``/``False`` (or numpy's), nothing merely truthy.

    ``shuffle="no"`` is truthy; taking it as ``True`` would shuffle a run that asked not to.
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)
