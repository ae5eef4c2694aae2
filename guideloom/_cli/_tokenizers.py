"""Tokenizers for ``guideloom prepare``: the built-in byte tokenizer and ``tokenizer.json`` files.

A tokenizer is described by a small picklable :class:`TokenizerSpec`, so worker processes can
build their own copy once, and turns a batch of texts into one concatenated token array plus the
length of each document (its end-of-document token included).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from guideloom._cli._common import UsageError, require

__all__ = ["BYTE_EOS", "TokenizerSpec", "Tokenizer", "build_tokenizer", "resolve_tokenizer", "smallest_dtype"]

BYTE_EOS = 256
BYTE_VOCAB = 257
Array = npt.NDArray[Any]


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What to build in each process: ``name`` is ``"bytes"`` or a path to a ``tokenizer.json``."""

    name: str
    eos_id: int | None
    vocab_size: int
    dtype: str

    def info(self) -> dict[str, Any]:
        """What the manifest records, so ``inspect`` can decode."""
        tokenizer = "bytes" if self.name == "bytes" else os.path.abspath(self.name)
        return {"tokenizer": tokenizer, "eos_id": self.eos_id, "vocab_size": self.vocab_size}


class Tokenizer(Protocol):
    def encode_many(self, texts: list[str]) -> tuple[Array, npt.NDArray[np.int64]]: ...
    def decode(self, ids: Array) -> str: ...


def smallest_dtype(vocab_size: int) -> str:
    """The narrowest unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    for name in ("uint8", "uint16", "uint32"):
        if vocab_size - 1 <= np.iinfo(name).max:
            return name
    return "int64"


def _with_eos(
    flat: Array, lengths: npt.NDArray[np.int64], eos_id: int | None
) -> tuple[Array, npt.NDArray[np.int64]]:
    """Put ``eos_id`` after each document of ``flat`` (documents of ``lengths`` tokens)."""
    if eos_id is None:
        return flat, lengths
    out = np.empty(len(flat) + len(lengths), dtype=flat.dtype)
    eos_at = np.cumsum(lengths + 1) - 1
    keep = np.ones(len(out), dtype=bool)
    keep[eos_at] = False
    out[keep] = flat
    out[eos_at] = eos_id
    return out, lengths + 1


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255); end-of-document id 256. No vocabulary file."""

    def __init__(self, dtype: str, eos_id: int | None) -> None:
        self.dtype = np.dtype(dtype)
        self.eos_id = eos_id

    def encode_many(self, texts: list[str]) -> tuple[Array, npt.NDArray[np.int64]]:
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        if self.eos_id is None:
            return np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(self.dtype), lengths
        # One byte between documents (and after the last) marks where each end-of-document goes.
        encoded.append(b"")
        out = np.frombuffer(b"\0".join(encoded), dtype=np.uint8).astype(self.dtype)
        lengths += 1
        out[np.cumsum(lengths) - 1] = self.eos_id
        return out, lengths

    def decode(self, ids: Array) -> str:
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")


class JSONTokenizer:
    """A ``tokenizer.json`` of the Hugging Face ``tokenizers`` library."""

    def __init__(self, path: str, dtype: str, eos_id: int | None) -> None:
        tokenizers = require("tokenizers", "--tokenizer path/to/tokenizer.json")
        self._tok = tokenizers.Tokenizer.from_file(path)
        self.dtype = np.dtype(dtype)
        self.eos_id = eos_id
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def encode_many(self, texts: list[str]) -> tuple[Array, npt.NDArray[np.int64]]:
        encodings = self._encode(texts, add_special_tokens=False)
        ids = [e.ids for e in encodings]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter((i for doc in ids for i in doc), dtype=self.dtype, count=int(lengths.sum()))
        return _with_eos(flat, lengths, self.eos_id)

    def decode(self, ids: Array) -> str:
        text: str = self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
        return text


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    if spec.name == "bytes":
        return ByteTokenizer(spec.dtype, spec.eos_id)
    return JSONTokenizer(spec.name, spec.dtype, spec.eos_id)


def _eos_for_json(tok: Any, eos: str) -> int:
    if eos.isdigit():
        eos_id = int(eos)
        if tok.id_to_token(eos_id) is None:
            raise UsageError(f"--eos {eos}: the tokenizer has no token with id {eos_id}")
        return eos_id
    found = tok.token_to_id(eos)
    if found is None:
        raise UsageError(
            f"--eos {eos!r}: the tokenizer has no such token (give the token, e.g. '</s>', or its id)"
        )
    return int(found)


def resolve_tokenizer(name: str, *, eos: str | None, no_eos: bool, dtype: str | None) -> TokenizerSpec:
    """Check the ``--tokenizer``, ``--eos`` and ``--dtype`` options and describe the tokenizer."""
    if name == "bytes":
        if eos is not None and eos != str(BYTE_EOS):
            raise UsageError(
                f"--eos does not apply to the byte tokenizer, whose end-of-document id is {BYTE_EOS}"
            )
        eos_id: int | None = None if no_eos else BYTE_EOS
        vocab = 256 if no_eos else BYTE_VOCAB  # without the end-of-document id, bytes fit uint8
    else:
        if not os.path.isfile(name):
            raise UsageError(
                f"--tokenizer {name!r}: use 'bytes' or the path of a local tokenizer.json (no such file)"
            )
        tokenizers = require("tokenizers", "--tokenizer path/to/tokenizer.json")
        try:
            tok = tokenizers.Tokenizer.from_file(name)
        except Exception as exc:  # the library raises a plain Exception for a bad file
            raise UsageError(
                f"--tokenizer {name!r} is not a tokenizer.json the tokenizers library reads: {exc}"
            ) from None
        vocab = int(tok.get_vocab_size(with_added_tokens=True))
        if no_eos:
            eos_id = None
        elif eos is None:
            raise UsageError(
                "--tokenizer with a tokenizer.json needs --eos TOKEN (the end-of-document token, "
                "e.g. --eos '</s>' or its id), or --no-eos"
            )
        else:
            eos_id = _eos_for_json(tok, eos)
            vocab = max(vocab, eos_id + 1)
    chosen = dtype or smallest_dtype(vocab)
    if chosen not in ("uint8", "uint16", "uint32", "int32", "int64", "uint64", "int16"):
        raise UsageError(f"--dtype {chosen}: token ids need an integer dtype such as uint16 or uint32")
    if vocab - 1 > np.iinfo(chosen).max:
        raise UsageError(
            f"--dtype {chosen} cannot hold token ids up to {vocab - 1}; use --dtype {smallest_dtype(vocab)} "
            "or leave --dtype out"
        )
    return TokenizerSpec(name=name, eos_id=eos_id, vocab_size=vocab, dtype=chosen)


def tokenizer_for_decoding(name: str, info: dict[str, Any]) -> Tokenizer:
    """The tokenizer ``inspect --tokenizer`` decodes with (``auto``: the one the manifest names)."""
    if name == "auto":
        name = str(info.get("tokenizer") or "")
        if not name:
            raise UsageError("--tokenizer auto: the dataset does not record its tokenizer; name it")
    eos_id = info.get("eos_id")
    if name == "bytes":
        return ByteTokenizer("uint16", BYTE_EOS)
    if not os.path.isfile(name):
        raise UsageError(
            f"--tokenizer {name!r}: use 'bytes' or the path of a local tokenizer.json (no such file)"
        )
    return JSONTokenizer(name, "int64", eos_id if isinstance(eos_id, int) else None)
