"""The chunk-aware (block) shuffle through the loader: its keywords, the exactly-once and resume
guarantees (hypothesis), the checkpoint's record of the blocks, and ``stats()``."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.order import DEFAULT_WINDOW, BlockPermutation, default_block_size, make_order
from guideloom._core.plan import Permutation
from tests.support.data import ids

seeds = st.integers(0, 2**40)


def loader_over(
    storage: gl.StreamStorageAbstract[Any, Any], **options: Any
) -> gl.StatefulDataLoader[Any, list[int]]:
    options.setdefault("device", torch.device("cpu"))
    options.setdefault("shuffle", True)
    options.setdefault("shuffle_seed", 7)
    return gl.StatefulDataLoader.from_storage(storage, ids, sequence_length=1, **options)


def stream(n: int) -> gl.MemoryStreamStorage:
    return gl.MemoryStreamStorage(np.arange(n, dtype=np.int64))


class BlockyStorage(gl.MemoryStreamStorage):
    """Memory storage that asks ``"auto"`` for blocks of 64 bytes (8 int64 samples), as an
    object store asks for a few MiB."""

    shuffle_block_bytes = 64


def run(loader: gl.StatefulDataLoader[Any, list[int]], steps: int | None = None) -> list[list[int]]:
    out: list[list[int]] = []
    with loader:
        for batch in loader:
            out.append(batch)
            if steps is not None and len(out) == steps:
                break
    return out


# -- the keywords -------------------------------------------------------------------------------------
def test_the_default_is_the_global_row_shuffle_on_every_storage() -> None:
    n = 300
    global_order = Permutation(n, shuffle=True, seed=7, epoch=0).range(0, n).tolist()
    for storage in (stream(n), BlockyStorage(np.arange(n, dtype=np.int64))):
        for options in ({}, {"shuffle_block_size": None}, {"shuffle_block_size": 1}):
            got = [i for b in run(loader_over(storage, local_batch_size=10, **options)) for i in b]
            assert got == global_order, options


def test_auto_is_global_on_memory_and_blocks_where_the_storage_asks() -> None:
    n = 300
    global_order = Permutation(n, shuffle=True, seed=7, epoch=0).range(0, n).tolist()
    got = [i for b in run(loader_over(stream(n), local_batch_size=10, shuffle_block_size="auto")) for i in b]
    assert got == global_order
    loader = loader_over(
        BlockyStorage(np.arange(n, dtype=np.int64)), local_batch_size=10, shuffle_block_size="auto"
    )
    got = [i for b in run(loader) for i in b]
    block = default_block_size(8, 64)
    assert block == 8
    want = BlockPermutation(n, seed=7, epoch=0, block_size=block, window=DEFAULT_WINDOW).range(0, n).tolist()
    assert got == want
    assert loader.stats()["shuffle_block_size"] == 8 and loader.stats()["shuffle_window"] == DEFAULT_WINDOW
    assert loader.state_dict()["shuffle_block_size"] == 8


def test_block_and_window_are_shown_in_repr_and_stats() -> None:
    loader = loader_over(stream(100), shuffle_block_size=5, shuffle_window=3)
    assert "shuffle_block_size=5" in repr(loader) and "shuffle_window=3" in repr(loader)
    stats = loader.stats()
    assert stats["shuffle_block_size"] == 5 and stats["shuffle_window"] == 3
    assert "requests" not in stats, "memory storage sends no requests"
    plain = loader_over(stream(100), shuffle=False, shuffle_block_size=5)
    assert plain.stats()["shuffle_block_size"] == 1, "no shuffle: the identity, no blocks"
    assert loader_over(stream(100)).stats()["shuffle_window"] == 1, "a global shuffle has no window"


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"shuffle_block_size": 0}, ValueError, "shuffle_block_size must be >= 1"),
        ({"shuffle_block_size": "big"}, ValueError, "shuffle_block_size must be an int >= 1.*'auto'"),
        ({"shuffle_block_size": 2.5}, TypeError, "shuffle_block_size must be an int"),
        ({"shuffle_block_size": True}, TypeError, "shuffle_block_size must be an int"),
        ({"shuffle_window": 0}, ValueError, "shuffle_window must be >= 1"),
        ({"shuffle_window": None}, TypeError, "shuffle_window must be an int"),
    ],
)
def test_bad_block_options_are_refused(options: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        loader_over(stream(10), **options)


def test_numpy_ints_are_accepted() -> None:
    loader = loader_over(stream(50), shuffle_block_size=np.int64(4), shuffle_window=np.int32(2))
    assert loader.shuffle_block_size == 4 and type(loader.shuffle_block_size) is int
    assert loader.shuffle_window == 2 and type(loader.shuffle_window) is int


# -- exactly once, ranks, resume (hypothesis) ---------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    block=st.integers(2, 60),
    window=st.integers(1, 8),
    batch=st.integers(1, 9),
    seed=seeds,
    epoch=st.integers(0, 5),
)
def test_an_epoch_through_the_loader_is_a_bijection(
    n: int, block: int, window: int, batch: int, seed: int, epoch: int
) -> None:
    """Any N (also not a multiple of the block): every sample once, in the block order."""
    batch = min(batch, n)  # at least one global batch
    loader = loader_over(
        stream(n),
        local_batch_size=batch,
        shuffle_seed=seed,
        shuffle_block_size=block,
        shuffle_window=window,
        drop_last=False,
    )
    loader.load_state_dict({**loader.state_dict(), "epoch": epoch})
    got = [i for b in run(loader) for i in b]
    assert sorted(got) == list(range(n))
    want = make_order(n, shuffle=True, seed=seed, epoch=epoch, block_size=block, window=window)
    assert got == want.range(0, n).tolist()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    block=st.integers(2, 40),
    window=st.integers(1, 6),
    batch=st.integers(1, 6),
    world=st.integers(2, 4),
    seed=seeds,
)
def test_ranks_are_disjoint_and_cover_the_epoch(
    n: int, block: int, window: int, batch: int, world: int, seed: int
) -> None:
    if n < batch * world:
        batch = max(1, n // world)
    if n < batch * world:
        return
    per_rank = [
        [
            i
            for b in run(
                loader_over(
                    stream(n),
                    local_batch_size=batch,
                    rank=rank,
                    world_size=world,
                    shuffle_seed=seed,
                    shuffle_block_size=block,
                    shuffle_window=window,
                    drop_last=False,
                )
            )
            for i in b
        ]
        for rank in range(world)
    ]
    union = [i for mine in per_rank for i in mine]
    assert len(union) == len(set(union)), "a sample reached two ranks"
    assert sorted(union) == list(range(n))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(4, 300),
    block=st.integers(2, 40),
    window=st.integers(1, 6),
    layout=st.tuples(st.integers(1, 6), st.integers(1, 3)),
    resumed_layout=st.tuples(st.integers(1, 6), st.integers(1, 3)),
    seed=seeds,
    data=st.data(),
)
def test_resume_with_another_batch_and_world_size_equals_the_uninterrupted_run(
    n: int,
    block: int,
    window: int,
    layout: tuple[int, int],
    resumed_layout: tuple[int, int],
    seed: int,
    data: st.DataObject,
) -> None:
    options = {
        "shuffle_seed": seed,
        "shuffle_block_size": block,
        "shuffle_window": window,
        "drop_last": False,
    }
    uninterrupted = [i for b in run(loader_over(stream(n), **options)) for i in b]
    batch, world = layout
    batch2, world2 = resumed_layout
    if n < batch * world or n < batch2 * world2:
        return
    steps = data.draw(st.integers(0, -(-n // (batch * world))), label="steps before the checkpoint")
    # before: every rank of the first layout takes `steps` batches
    first: list[list[int]] = [[] for _ in range(steps)]
    state = None
    for rank in range(world):
        loader = loader_over(stream(n), local_batch_size=batch, rank=rank, world_size=world, **options)
        for step, b in enumerate(run(loader, steps) if steps else []):
            first[step].extend(b)
        state = loader.state_dict()
    assert state is not None
    before = [i for step in first for i in step]
    # after: the resumed layout from that checkpoint, batches of all its ranks in rank order
    later: list[list[list[int]]] = []
    for rank in range(world2):
        loader = loader_over(stream(n), local_batch_size=batch2, rank=rank, world_size=world2, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # same order settings: no warning
            loader.load_state_dict(state)
        later.append(run(loader))
    after = [i for step in zip(*later, strict=True) for b in step for i in b]
    assert before + after == uninterrupted


# -- the checkpoint ------------------------------------------------------------------------------------
def _load_warnings(loader: gl.StatefulDataLoader[Any, Any], state: dict[str, Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state)  # type: ignore[arg-type]
    return [str(w.message) for w in caught]


def test_a_resume_with_other_blocks_warns_like_another_seed() -> None:
    saved = loader_over(stream(100), shuffle_block_size=8, shuffle_window=4)
    state = dict(saved.state_dict())
    assert state["shuffle_block_size"] == 8 and state["shuffle_window"] == 4
    assert _load_warnings(loader_over(stream(100), shuffle_block_size=8, shuffle_window=4), state) == []
    (other_block,) = _load_warnings(loader_over(stream(100), shuffle_block_size=16, shuffle_window=4), state)
    assert "shuffle_block_size=8" in other_block and "shuffle_block_size=16" in other_block
    assert "Construct the loader with shuffle_block_size=8" in other_block
    (other_window,) = _load_warnings(loader_over(stream(100), shuffle_block_size=8, shuffle_window=2), state)
    assert "shuffle_window=4" in other_window and "shuffle_window=2" in other_window
    (global_now,) = _load_warnings(loader_over(stream(100)), state)
    assert "with shuffle_block_size=8, this loader has shuffle_block_size=None (a global row shuffle);" in (
        global_now
    )


def test_old_checkpoints_were_global_shuffles() -> None:
    state = dict(loader_over(stream(100)).state_dict())
    assert "shuffle_block_size" not in state and "shuffle_window" not in state, "as before blocks"
    assert _load_warnings(loader_over(stream(100)), state) == []
    (warning,) = _load_warnings(loader_over(stream(100), shuffle_block_size=4), state)
    assert "with shuffle_block_size=None (a global row shuffle), this loader has shuffle_block_size=4;" in (
        warning
    )
    assert "Construct the loader with shuffle_block_size=None to resume" in warning


def test_a_position_alone_says_nothing_of_the_blocks() -> None:
    """A checkpoint of ``epoch`` and ``observation_offset`` alone resumes a loader with blocks
    ("auto" or a size) without a warning, in the saved run's order; one that records its order
    without block keys is a global shuffle's, and still warns."""
    storage = BlockyStorage(np.arange(100, dtype=np.int64))
    for option in ("auto", 8):
        whole = run(loader_over(storage, local_batch_size=4, shuffle_block_size=option))
        resumed = loader_over(storage, local_batch_size=4, shuffle_block_size=option)
        assert _load_warnings(resumed, {"epoch": 0, "observation_offset": 40}) == []
        assert run(resumed) == whole[10:]
        (warning,) = _load_warnings(
            loader_over(storage, shuffle_block_size=option),
            {"epoch": 0, "observation_offset": 40, "shuffle": True},
        )
        assert "with shuffle_block_size=None (a global row shuffle)" in warning


def test_blocks_do_not_matter_without_shuffle() -> None:
    state = dict(loader_over(stream(100), shuffle=False, shuffle_block_size=8).state_dict())
    assert "shuffle_block_size" not in state
    assert _load_warnings(loader_over(stream(100), shuffle=False, shuffle_block_size=32), state) == []


def test_auto_is_recorded_as_the_size_it_chose() -> None:
    storage = BlockyStorage(np.arange(100, dtype=np.int64))
    state = dict(loader_over(storage, shuffle_block_size="auto").state_dict())
    assert state["shuffle_block_size"] == 8
    assert _load_warnings(loader_over(storage, shuffle_block_size=8), state) == []
    state_dict = loader_over(storage, shuffle_block_size="auto").state_dict()
    assert torch.load(_saved(state_dict), weights_only=True) == state_dict


def test_a_warning_names_auto_as_the_user_passed_it() -> None:
    """Over a storage without blocks of its own, "auto" is the size it resolves to (8 here): a
    resume with that size is the same order, and a warning names "auto" as given."""
    storage = BlockyStorage(np.arange(100, dtype=np.int64))
    auto = dict(loader_over(storage, shuffle_block_size="auto").state_dict())
    assert auto["shuffle_block_auto"] is True
    (global_now,) = _load_warnings(loader_over(storage), auto)
    assert (
        "saved by a loader with shuffle_block_size='auto' (resolved to 8), this loader has "
        "shuffle_block_size=None (a global row shuffle);" in global_now
    )
    assert "Construct the loader with shuffle_block_size='auto' to resume it exactly" in global_now
    (other,) = _load_warnings(loader_over(storage, shuffle_block_size=16), auto)
    assert "shuffle_block_size='auto' (resolved to 8), this loader has shuffle_block_size=16;" in other
    # the reverse: a size saved, "auto" resuming
    sized = dict(loader_over(storage, shuffle_block_size=4).state_dict())
    assert sized["shuffle_block_auto"] is False
    (auto_now,) = _load_warnings(loader_over(storage, shuffle_block_size="auto"), sized)
    assert "with shuffle_block_size=4, this loader has shuffle_block_size='auto' (resolved to 8);" in auto_now
    assert "Construct the loader with shuffle_block_size=4 to resume it exactly" in auto_now
    assert _load_warnings(loader_over(storage, shuffle_block_size=8), auto) == []
    same = dict(loader_over(storage, shuffle_block_size=8).state_dict())
    assert _load_warnings(loader_over(storage, shuffle_block_size="auto"), same) == []
    # "auto" resolving to a global shuffle (a storage in memory): nothing recorded, as for None
    assert "shuffle_block_auto" not in loader_over(stream(100), shuffle_block_size="auto").state_dict()
    (local_auto,) = _load_warnings(loader_over(stream(100), shuffle_block_size="auto"), sized)
    assert "this loader has shuffle_block_size='auto' (resolved to 1: a global row shuffle);" in local_auto


def _saved(state: Any) -> Any:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_resolve_block_size() -> None:
    from guideloom._core.order import LOCAL_BLOCK_SIZE, REMOTE_BLOCK_BYTES, resolve_block_size

    assert resolve_block_size(None, block_bytes=REMOTE_BLOCK_BYTES, sample_nbytes=4096) == 1
    assert resolve_block_size(7, block_bytes=None, sample_nbytes=0) == 7
    assert resolve_block_size("auto", block_bytes=None, sample_nbytes=4096) == LOCAL_BLOCK_SIZE
    assert resolve_block_size("auto", block_bytes=REMOTE_BLOCK_BYTES, sample_nbytes=4096) == 1024
    assert resolve_block_size("auto", block_bytes=REMOTE_BLOCK_BYTES, sample_nbytes=0) == LOCAL_BLOCK_SIZE
    assert resolve_block_size("auto", block_bytes=REMOTE_BLOCK_BYTES, sample_nbytes=2**23) == 1
