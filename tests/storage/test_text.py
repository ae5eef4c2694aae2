"""Texts to token arrays (``guideloom/storage/_text.py``): what a copy of the encoder leaves of the
process it is unpickled in, and ``TOKENIZERS_PARALLELISM`` in guideloom's own process workers
only."""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support import ROOT

VAR = "TOKENIZERS_PARALLELISM"


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without ``TOKENIZERS_PARALLELISM``, this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k != VAR}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def test_an_encoder_unpickled_in_a_process_guideloom_did_not_start_leaves_its_environment(
    tokenizer_json: str,
) -> None:
    """A copy unpickled in a process of the user's (a Ray task, a process pool of their own)
    encodes as the original does and sets nothing in that process's environment."""
    from guideloom.storage._text import TextEncoder

    encoder = TextEncoder(tokenizer_json, eos="</s>")
    same = pickle.loads(pickle.dumps(encoder))  # a copy in this process
    assert same.encode_many(["r1 r2"])[0].tolist() == encoder.encode_many(["r1 r2"])[0].tolist()
    code = (
        "import os, pickle, sys\n"
        "enc = pickle.loads(sys.stdin.buffer.read())\n"
        f"print(os.environ.get({VAR!r}), enc.encode_many(['r1 r2'])[0].tolist())\n"
    )
    want = encoder.encode_many(["r1 r2"])[0].tolist()
    for env, seen in ((_env(), "None"), (_env(**{VAR: "true"}), "true")):
        out = subprocess.run(
            [sys.executable, "-c", code], input=pickle.dumps(encoder), capture_output=True, check=True,
            cwd=ROOT, env=env, timeout=60,
        )  # fmt: skip
        assert out.stdout.decode().split(" ", 1) == [seen, f"{want}\n"]


_SCRIPT = """
import os, sys
import torch
import guideloom as gl

def seen(tokens):
    return {{"pid": os.getpid(), "var": os.environ.get({var!r}), "docs": len(tokens)}}

if __name__ == "__main__":
    storage = gl.open_parquet({folder!r}, "text", tokenizer={tokenizer!r}, eos="</s>")
    loader = gl.StatefulDataLoader.from_storage(
        storage, seen, local_batch_size=4, num_workers=2, parallel_method=sys.argv[1],
        collate_mode="workers" if sys.argv[1] == "process" else "auto", device=torch.device("cpu"),
    )
    with loader:
        batches = list(loader)
    workers = {{b["pid"] for b in batches}} - {{os.getpid()}}
    print(sys.argv[1], len(workers), *sorted({{str(b["var"]) for b in batches}}), os.environ.get({var!r}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["process", "thread"])
def test_only_guideloom_s_process_workers_set_one_thread_tokenizing_unless_the_user_did(
    tmp_path: Path, tokenizer_json: str, method: str
) -> None:
    """Each process worker sees ``false`` where the variable is unset, and the user's value
    where it is set; the main process's environment is never changed, nor that of thread
    workers (the user's own process)."""
    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.table({"text": [f"r{i} alpha beta" for i in range(64)]}), folder / "a.parquet")
    script = tmp_path / "encode_in_workers.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(var=VAR, folder=str(folder), tokenizer=tokenizer_json)))
    for value in (None, "true"):
        env = _env() if value is None else _env(**{VAR: value})
        out = subprocess.run(
            [sys.executable, str(script), method], capture_output=True, text=True, check=True, env=env,
            cwd=tmp_path, timeout=100,
        )  # fmt: skip
        got, workers, *seen = out.stdout.split()
        # under load one worker may collate every batch; none is collated in the main process
        # (collate_mode="workers"), where the variable would read as the main process's
        assert (got, int(workers) >= 1 if method == "process" else int(workers) == 0) == (method, True)
        in_workers = ("false" if method == "process" else "None") if value is None else value
        assert seen == [in_workers, str(value)], out.stderr


def test_an_encoder_keeps_tokens_in_the_narrowest_dtype_that_holds_every_id(tokenizer_json: str) -> None:
    """A 300-id vocabulary's tokens are kept as uint16 whatever the delivered dtype; an id past
    uint16 (``eos``) keeps them wider, and a callable's ids, not known ahead, at ``dtype``."""
    from guideloom.storage._text import TextEncoder

    assert TextEncoder(tokenizer_json, eos="</s>").kept_dtype == np.uint16
    assert TextEncoder(tokenizer_json, dtype="int64").kept_dtype == np.uint16
    assert TextEncoder(tokenizer_json, eos=70_000).kept_dtype == np.uint32
    assert TextEncoder(tokenizer_json, dtype="uint16").kept_dtype == np.uint16
    assert TextEncoder(lambda t: [1, 2]).kept_dtype == np.uint32


def test_encode_kept_holds_each_groups_tokens_back_to_back_as_encode_many_makes_them(
    tokenizer_json: str,
) -> None:
    """One read-only array per group, its texts' tokens (``bos``/``eos`` around each) at its
    offsets, as ``encode_many`` makes them one by one; one of a page or more is a mapping of
    its own."""
    from guideloom.storage._text import TextEncoder

    encoder = TextEncoder(tokenizer_json, bos="<s>", eos="</s>")
    long = " ".join(f"r{i % 1000}" for i in range(3000))
    groups = [["r1 r2", "", "r3"], [], [long, "r4"]]
    kept = encoder.encode_kept(groups)
    assert len(kept) == len(groups)
    for texts, (flat, offsets) in zip(groups, kept, strict=True):
        assert flat.dtype == np.uint16 and not flat.flags.writeable and offsets.tolist()[0] == 0
        rows = [flat[a:b].tolist() for a, b in itertools.pairwise(offsets.tolist())]
        assert rows == [r.tolist() for r in encoder.encode_many(texts)]
    mapped = [isinstance(getattr(flat.base, "obj", None), mmap.mmap) for flat, _ in kept]
    assert mapped == [False, False, True]


def test_encode_kept_lets_each_encoding_go_once_its_ids_are_copied(tokenizer_json: str) -> None:
    """A call's encodings are not all held until the last is copied: when a text's ids are
    read, the texts before it have let theirs go (a call's encodings hold some 80 bytes a
    token), and the tokens are the tokenizer's own."""
    import weakref

    from tokenizers import Tokenizer

    from guideloom.storage._text import TextEncoder

    live: weakref.WeakSet[Any] = weakref.WeakSet()
    alive_at_read: list[int] = []

    class Tracked:
        def __init__(self, encoding: Any) -> None:
            self._encoding = encoding
            live.add(self)

        def __len__(self) -> int:
            return len(self._encoding)

        @property
        def ids(self) -> list[int]:
            alive_at_read.append(len(live))
            ids: list[int] = self._encoding.ids
            return ids

    class Tokenizing:
        """A ``tokenizers.Tokenizer`` whose encodings are counted while alive."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> list[Any]:
            return [
                Tracked(e)
                for e in self._inner.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
            ]

    inner = Tokenizer.from_file(tokenizer_json)
    encoder = TextEncoder(Tokenizing(inner), eos="</s>")
    groups = [["r1 r2", "r3 r4 r5"], ["r6", "r7 r8", "r9"]]
    kept = encoder.encode_kept(groups)
    assert alive_at_read == [5, 4, 3, 2, 1]
    eos = inner.token_to_id("</s>")
    for texts, (flat, offsets) in zip(groups, kept, strict=True):
        rows = [flat[a:b].tolist() for a, b in itertools.pairwise(offsets.tolist())]
        assert rows == [[*inner.encode(t, add_special_tokens=False).ids, eos] for t in texts]
