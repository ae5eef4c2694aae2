"""Fixtures shared by the storage tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from guideloom.storage._cache import _chunk_schedule
from guideloom.storage._cache._chunks import ChunkCache


@pytest.fixture
def stopped() -> Iterator[list[ChunkCache]]:
    """Chunk caches a test appends here are stopped when it ends, whatever it raised."""
    caches: list[ChunkCache] = []
    yield caches
    for c in caches:
        c.stop()


@pytest.fixture(scope="module")
def short_first_read_grace() -> Iterator[None]:
    """A chunk cache here starts downloading 50 ms after its plan where no read came first, not
    1 s after (the grace that spares a cold cache's first batch the downloads' competition): the
    tests that use it wait for the planner to settle before they read, and check what it
    downloads, not when it starts."""
    old = _chunk_schedule.FIRST_READ_GRACE_SECONDS
    _chunk_schedule.FIRST_READ_GRACE_SECONDS = 0.05
    yield
    _chunk_schedule.FIRST_READ_GRACE_SECONDS = old


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small BPE ``tokenizer.json`` trained on the Parquet tests' words (``<s>``, ``</s>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tests.storage.test_parquet import WORDS

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(WORDS)] * 20 + [f"r{i}" for i in range(1000)]
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<s>", "</s>"])
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)
