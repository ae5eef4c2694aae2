"""``open_parquet``'s options: the keys it takes (:class:`ParquetOptions`) and their defaults,
kept in one place (:class:`ParquetSettings`'s fields)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from guideloom.storage._parquet._decode import OnNull
from guideloom.storage._text import TokenizerLike
from guideloom.types import StoreOptions

#: Default bytes of decoded row groups kept (what the row-group shuffle's window should fit).
DEFAULT_DECODED_BYTES = 512 * 2**20
#: Row groups fetched ahead at once over an object store (``open_parquet``'s ``fetch_ahead``):
#: each is one ranged GET and a decode, on its own thread.
DEFAULT_FETCH_AHEAD = 8


class ParquetOptions(StoreOptions, total=False):
    """What :func:`~guideloom.open_parquet` takes beside ``source`` and ``column``: how to read
    the rows, and (the keys of :class:`~guideloom.types.StoreOptions`) how to reach an object
    store. The defaults are :class:`ParquetSettings`'s."""

    tokenizer: TokenizerLike | None
    """A ``tokenizers.Tokenizer``, the path of a ``tokenizer.json``, or a callable from a text to
    token ids: a text column is read as token arrays."""
    bos: int | str | None
    """An id (or a token, by name) added before each document."""
    eos: int | str | None
    """An id (or a token, by name) added after each document."""
    dtype: Any
    """The dtype of the tokens a tokenizer makes (default ``uint32``; ``int64`` over ``2**32`` ids)."""
    on_null: OnNull
    """``"error"``: a null row is refused, named; ``"empty"``: read as an empty document, counted."""
    max_decoded_bytes: int
    """Decoded row groups kept in memory per process."""
    cache_dir: str | os.PathLike[str] | None
    """Where the footer index and the length index are kept between runs."""
    threads: int
    """Footers read at once when opening."""
    fetch_ahead: int
    """Over an object store, row groups fetched and decoded ahead at once (0: none; a text
    column tokenized as it is read: one to two, as over local files one)."""
    tokenizer_key: str | None
    """A name for exactly this tokenizer (and its version): what identifies a tokenizer callable
    in the length index's key."""


@dataclass(frozen=True, slots=True)
class ParquetSettings:
    """``open_parquet``'s options with their defaults (the one place they are set); ``store``:
    the rest, how to reach an object store."""

    tokenizer: TokenizerLike | None = None
    bos: int | str | None = None
    eos: int | str | None = None
    dtype: Any = None
    on_null: OnNull = "error"
    max_decoded_bytes: int = DEFAULT_DECODED_BYTES
    cache_dir: str | os.PathLike[str] | None = None
    threads: int = 32
    fetch_ahead: int = DEFAULT_FETCH_AHEAD
    tokenizer_key: str | None = None
    store: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> ParquetSettings:
        """The settings ``options`` names, the defaults for the others; keys that are not the
        reader's own are the store's."""
        own = {f.name for f in fields(cls)} - {"store"}
        mine = {k: v for k, v in options.items() if k in own}
        return cls(**mine, store={k: v for k, v in options.items() if k not in own})


def reader_keys() -> frozenset[str]:
    """The keys of :class:`ParquetOptions` that are the reader's (not the store's)."""
    return frozenset(f.name for f in fields(ParquetSettings)) - {"store"}
