"""Texts to token arrays: the tokenizer a Parquet text column is read with.

:class:`TextEncoder` is small and picklable: it holds what names the tokenizer (a
``tokenizers.Tokenizer``, the path of a ``tokenizer.json``, or a callable from a text to token
ids) and builds the tokenizer itself the first time it encodes, in whichever process or thread
that is. A process worker forked from the process that made the encoder (guideloom's workers
are, where that is safe) uses the tokenizer that process built, whose pages it shares, instead of
building one of its own.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["TextEncoder", "TokenizerLike"]

#: What ``tokenizer=`` takes: a ``tokenizers.Tokenizer``, a path to a ``tokenizer.json``, or a
#: callable from one text to its token ids.
TokenizerLike = Any

#: Every encoder made in this process, by (process id, serial): a process forked from it finds
#: the encoder its copy was pickled from, and the tokenizer that encoder built.
_MADE: weakref.WeakValueDictionary[tuple[int, int], TextEncoder] = weakref.WeakValueDictionary()
_SERIALS = itertools.count()


def _unpadded(tok: Any) -> Any:
    """``tok`` without padding (a copy of a ``tokenizers.Tokenizer`` that pads: padding would
    make a document's tokens depend on the other texts of its batch)."""
    if getattr(tok, "padding", None) is None or not hasattr(tok, "to_str"):
        return tok
    import tokenizers

    copy = tokenizers.Tokenizer.from_str(tok.to_str())
    copy.no_padding()
    return copy


def _load_json(path: str) -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError(
            "a tokenizer.json needs the tokenizers library: pip install 'guideloom[tokenizers]'"
        ) from exc
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {path!r}: no such file (pass the path of a tokenizer.json)")
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as exc:  # the library raises a plain Exception for a bad file
        raise ValueError(f"{path!r} is not a tokenizer.json the tokenizers library reads: {exc}") from None


class TextEncoder:
    """Encodes a batch of texts to one 1-D token array each, with optional ``bos``/``eos`` ids
    around every document (given as token strings, resolved by the tokenizer, or as ids)."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        *,
        bos: int | str | None = None,
        eos: int | str | None = None,
        dtype: Any = None,
    ) -> None:
        if isinstance(tokenizer, os.PathLike):
            tokenizer = os.fspath(tokenizer)
        if not (isinstance(tokenizer, str) or callable(tokenizer) or hasattr(tokenizer, "encode_batch")):
            raise TypeError(
                "tokenizer must be a tokenizers.Tokenizer, the path of a tokenizer.json or a "
                f"callable from a text to token ids, got {type(tokenizer).__name__}"
            )
        self._source = tokenizer
        self._tok: Any = None
        self._origin = (os.getpid(), next(_SERIALS))
        _MADE[self._origin] = self
        tok = self._built()
        self.bos_id = self._token_id("bos", bos, tok)
        self.eos_id = self._token_id("eos", eos, tok)
        vocab = int(tok.get_vocab_size(with_added_tokens=True)) if hasattr(tok, "get_vocab_size") else 2**32
        self.dtype = (
            np.dtype(dtype) if dtype is not None else np.dtype(np.uint32 if vocab <= 2**32 else np.int64)
        )
        #: The dtype a storage keeps tokens in between their tokenizing and their delivery (as
        #: ``dtype``): the narrowest unsigned integer that holds every id of the vocabulary and
        #: ``bos``/``eos`` (a 32,768-id vocabulary's tokens kept in half the memory); ``dtype``
        #: where the ids are not known ahead (a callable).
        self.kept_dtype = self._narrowest(
            vocab if hasattr(tok, "get_vocab_size") else None, self.bos_id, self.eos_id
        )

    def __getstate__(self) -> dict[str, Any]:
        # A Tokenizer object pickles itself; a tokenizer.json travels as what was read from it,
        # so that a copy encodes as this one does even if the file changes meanwhile.
        state = {**self.__dict__, "_tok": None}
        if isinstance(self._source, str):
            state["_json"] = self._built().to_str()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (The process's environment is left alone: guideloom's process workers set
        # TOKENIZERS_PARALLELISM for themselves as they start, see the worker's entry point.)
        self.__dict__.update(state)
        made = _MADE.get(self._origin)
        if made is not None:  # this process is the one that made it, or was forked from it
            self._tok = made._tok
            self.__dict__.pop("_json", None)

    def describe(self) -> str:
        """What names this encoding in a fingerprint: the tokenizer's contents (a
        ``tokenizers.Tokenizer``, or a ``tokenizer.json``: a digest of its serialisation, so an
        edited file or another tokenizer is another dataset), a callable's qualified name, and
        the ids around documents."""
        tok = self._built()
        if hasattr(tok, "to_str"):
            name = self.__dict__.get("_digest", "")
            if not name:
                name = "sha256:" + hashlib.sha256(tok.to_str().encode()).hexdigest()[:32]
                if isinstance(self._source, str):  # its own tokenizer, read from a file: never changed
                    self.__dict__["_digest"] = name
        else:
            name = f"{getattr(tok, '__module__', '')}.{getattr(tok, '__qualname__', type(tok).__qualname__)}"
        return f"{name}|bos={self.bos_id}|eos={self.eos_id}|{self.dtype}"

    def _built(self) -> Any:
        if self._tok is None:
            src, text = self._source, self.__dict__.pop("_json", None)
            if text is not None:
                import tokenizers

                self._tok = tokenizers.Tokenizer.from_str(text)
            else:
                self._tok = _unpadded(_load_json(src) if isinstance(src, str) else src)
        return self._tok

    @staticmethod
    def _token_id(what: str, value: int | str | None, tok: Any) -> int | None:
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        if not isinstance(value, str) or not hasattr(tok, "token_to_id"):
            raise TypeError(
                f"{what} must be a token id (an int), or a token string where the tokenizer is a "
                f"tokenizers.Tokenizer or a tokenizer.json, got {value!r}"
            )
        found = tok.token_to_id(value)
        if found is None:
            raise ValueError(
                f"{what}={value!r}: the tokenizer has no such token (give the token, e.g. '</s>', or its id)"
            )
        return int(found)

    def _narrowest(self, vocab: int | None, *ids: int | None) -> np.dtype[Any]:
        """The narrowest of uint8, uint16 and ``dtype`` that holds ids ``[0, vocab)`` and ``ids``
        (``dtype`` where ``vocab`` is ``None`` or ``dtype`` is not an integer wider than it)."""
        if vocab is None or self.dtype.kind not in "iu":
            return self.dtype
        top = max([vocab - 1, *(i for i in ids if i is not None)])
        if min([0, *(i for i in ids if i is not None)]) < 0:
            return self.dtype
        for narrow in (np.dtype(np.uint8), np.dtype(np.uint16)):
            if top <= np.iinfo(narrow).max and narrow.itemsize < self.dtype.itemsize:
                return narrow
        return self.dtype

    def _checked(self, doc: Any) -> npt.NDArray[Any]:
        """A callable's token ids, refused unless they are integers that ``dtype`` holds (a
        cast would wrap them silently)."""
        ids = np.asarray(doc)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError(
                f"the tokenizer callable must return a sequence of integer token ids, got {ids.dtype} "
                f"of shape {ids.shape}"
            )
        if ids.size:
            info, low, high = np.iinfo(self.dtype), int(ids.min()), int(ids.max())
            if low < info.min or high > info.max:
                raise ValueError(
                    f"the tokenizer returned token id {low if low < info.min else high}, outside "
                    f"{self.dtype}'s range [{info.min}, {info.max}]: pass dtype= wide enough to "
                    "hold every id (e.g. dtype='int64')"
                )
        return ids

    def _ids(self, texts: Sequence[str]) -> list[Any]:
        """Each text's token ids (a list or an array), without ``bos``/``eos``."""
        docs = self._encoded(texts)
        return [d if isinstance(d, np.ndarray) else d.ids for d in docs]

    def _encoded(self, texts: Sequence[str]) -> list[Any]:
        """Each text encoded, without ``bos``/``eos``: a ``tokenizers`` encoding (``len()`` its
        tokens, ``.ids`` their ids as a list made on each access) or a callable's checked ids."""
        tok = self._built()
        if hasattr(tok, "encode_batch"):
            encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
            encoded: list[Any] = encode(list(texts), add_special_tokens=False)
            return encoded
        call: Callable[[str], Any] = tok
        return [self._checked(call(t)) for t in texts]

    def encode_kept(
        self, groups: Sequence[Sequence[str]]
    ) -> list[tuple[npt.NDArray[Any], npt.NDArray[np.int64]]]:
        """The texts of ``groups`` tokenized in one call, each group's tokens back to back in one
        read-only array of :attr:`kept_dtype` (``bos``/``eos`` around each text), with its
        texts' offsets into it: what a storage keeps for its reads. An array of a page or more
        is a memory mapping of its own, given back to the system whole once it is dropped (a
        small array per text, among the tokenizer's freed buffers, would leave the C heap
        holding pages that are mostly free). Each text's encoding is let go once its ids are
        copied, and its ids made as a list one text at a time: the call's encodings and their
        ids as Python ints (some 80 and 40 bytes a token) are not all held at once."""
        docs = self._encoded([t for group in groups for t in group])
        first = 0 if self.bos_id is None else 1
        extra = first + (0 if self.eos_id is None else 1)
        out = []
        at = 0
        for group in groups:
            offsets = np.zeros(len(group) + 1, dtype=np.int64)
            np.cumsum([len(docs[i]) + extra for i in range(at, at + len(group))], out=offsets[1:])
            flat = kept_array(int(offsets[-1]), self.kept_dtype)
            for start in offsets[:-1].tolist():
                doc, docs[at] = docs[at], None
                at += 1
                flat[start + first : start + first + len(doc)] = (
                    doc if isinstance(doc, np.ndarray) else doc.ids
                )
                del doc
            if self.bos_id is not None:
                flat[offsets[:-1]] = self.bos_id
            if self.eos_id is not None:
                flat[offsets[1:] - 1] = self.eos_id
            flat.flags.writeable = False
            out.append((flat, offsets))
        return out

    def encode_many(self, texts: Sequence[str]) -> list[npt.NDArray[Any]]:
        """One token array per text (``bos`` first and ``eos`` last where given)."""
        ids = self._ids(texts)
        dtype, bos, eos = self.dtype, self.bos_id, self.eos_id
        if bos is None and eos is None:
            return [np.array(doc, dtype=dtype) for doc in ids]
        # one array per document, the ids written into it (no list concatenated per document)
        first = 0 if bos is None else 1
        extra = first + (0 if eos is None else 1)
        out = []
        for doc in ids:
            arr = np.empty(len(doc) + extra, dtype=dtype)
            arr[first : first + len(doc)] = doc
            if bos is not None:
                arr[0] = bos
            if eos is not None:
                arr[-1] = eos
            out.append(arr)
        return out


def kept_array(n: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An uninitialised array of ``n`` elements; a memory mapping of its own from a page on."""
    nbytes = n * dtype.itemsize
    if nbytes < mmap.PAGESIZE:
        return np.empty(n, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype)


class TokenizeStep:
    """The step that turns a batch's texts into token arrays where collation runs (thread or
    process workers, or inline), then hands them to ``collate_fn``; picklable where both are."""

    __slots__ = ("collate_fn", "encoder")

    def __init__(self, encoder: TextEncoder, collate_fn: Callable[[Sequence[Any]], Any]) -> None:
        self.encoder, self.collate_fn = encoder, collate_fn

    def __call__(self, texts: Sequence[Any]) -> Any:
        return self.collate_fn(self.encoder.encode_many(texts))

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenizeStep, (self.encoder, self.collate_fn))

    def __repr__(self) -> str:
        return f"TokenizeStep({self.encoder.describe()}, {self.collate_fn!r})"
