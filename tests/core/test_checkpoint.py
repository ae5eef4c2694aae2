"""The checkpoint's pure checks (``guideloom._core.checkpoint``), with no loader: the dataset
fingerprint a checkpoint records, and what ``restore_position`` accepts, refuses and warns about.

Checkpoints taken and loaded through a loader (``state_dict``/``load_state_dict``, exact resume)
are in ``tests/loader/test_checkpoint.py``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom as gl
from guideloom._core.checkpoint import LoaderIdentity, restore_position


def _identity(
    dataset: Any, *, shuffle: bool = False, seed: int | None = 0, drop_last: bool = True
) -> LoaderIdentity:
    return LoaderIdentity(
        shuffle=shuffle, shuffle_seed=seed, drop_last=drop_last, fingerprint=dataset._fingerprint()
    )


def _state(dataset: Any, epoch: int = 0, offset: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "observation_offset": offset,
        "shuffle": False,
        "shuffle_seed": 0,
        "drop_last": True,
        "dataset": dict(dataset._fingerprint()),
        **extra,
    }


def _stream(n: int, length: int = 8) -> gl.StreamDataset[Any]:
    return gl.StreamDataset(gl.MemoryStreamStorage(np.arange(n, dtype=np.int32)), length)


def test_fingerprint_of_stream_and_documents(tmp_path: Path) -> None:
    fp = _stream(100, 8)._fingerprint()
    assert fp == {"kind": "stream", "observations": 12, "sequence_length": 8, "digest": ""}
    docs = gl.DocumentDataset(gl.MemoryDocumentStorage([np.arange(3), np.arange(5)]))
    assert docs._fingerprint() == {
        "kind": "documents",
        "observations": 2,
        "sequence_length": 0,
        "digest": "",
    }
    gl.write_stream(tmp_path / "a", np.arange(1000, dtype=np.uint16))
    written = gl.StreamDataset(gl.open_stream(tmp_path / "a"), 10)._fingerprint()
    assert len(written["digest"]) == 16 and written["observations"] == 100


def test_digest_follows_the_data(tmp_path: Path) -> None:
    gl.write_stream(tmp_path / "a", np.arange(1000, dtype=np.uint16))
    gl.write_stream(tmp_path / "b", np.arange(1000, dtype=np.uint16)[::-1].copy())
    gl.write_stream(tmp_path / "c", np.arange(1000, dtype=np.uint16))

    def digest(name: str) -> str:
        return gl.StreamDataset(gl.open_stream(tmp_path / name), 10)._fingerprint()["digest"]

    assert digest("a") == digest("c")  # same content, same files: same digest
    assert digest("a") != digest("b")  # same sizes, other tokens


def test_matching_checkpoint_restores_its_position() -> None:
    ds = _stream(1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert restore_position(_state(ds, 2, 40), _identity(ds)) == (2, 40)


def test_checkpoint_of_another_dataset_is_refused() -> None:
    big, small = _stream(100_000), _stream(10_000)
    with pytest.raises(
        ValueError, match=r"another dataset: observations 12500 \(saved\) != 1250.*allow_dataset_change"
    ):
        restore_position(_state(big, 0, 400), _identity(small))


def test_checkpoint_with_another_sequence_length_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sequence_length 8 \(saved\) != 16"):
        restore_position(_state(_stream(1024, 8)), _identity(_stream(2048, 16)))


def test_checkpoint_of_other_written_data_is_refused(tmp_path: Path) -> None:
    gl.write_stream(tmp_path / "a", np.arange(1000, dtype=np.uint16))
    gl.write_stream(tmp_path / "b", np.arange(1000, dtype=np.uint16)[::-1].copy())
    a = gl.StreamDataset(gl.open_stream(tmp_path / "a"), 10)
    b = gl.StreamDataset(gl.open_stream(tmp_path / "b"), 10)
    with pytest.raises(ValueError, match="digest"):
        restore_position(_state(a, 0, 10), _identity(b))


def test_escape_hatch_resumes_at_the_saved_position() -> None:
    big, small = _stream(100_000), _stream(10_000)
    assert restore_position(_state(big, 3, 400), _identity(small), allow_dataset_change=True) == (3, 400)


def test_escape_hatch_still_refuses_an_offset_past_the_end() -> None:
    big, small = _stream(100_000), _stream(10_000)
    with pytest.raises(ValueError, match=r"observation_offset=5000 is past the end .*1250 observations"):
        restore_position(_state(big, 0, 5000), _identity(small), allow_dataset_change=True)


def test_padding_past_the_end_of_the_saved_dataset_is_accepted() -> None:
    ds = _stream(1000)  # 125 observations; a final partial batch of 8 pads the offset to 128
    assert restore_position(_state(ds, 0, 128), _identity(ds)) == (0, 128)


@pytest.mark.parametrize("fingerprint", [True, False])
@pytest.mark.parametrize("offset", [200, 201, 10**6, 10**30])
def test_an_offset_past_a_final_padded_batch_is_refused(offset: int, fingerprint: bool) -> None:
    """A run passes the end of its dataset by the padding of its final batch: less than one
    global batch, which a loader keeps within the dataset; so N observations end before 2N."""
    ds = _stream(800)  # 100 observations
    state = _state(ds, 3, offset)
    if not fingerprint:
        del state["dataset"]
    with pytest.raises(
        ValueError, match=rf"observation_offset={offset} is past the end .*\(100 observations\)"
    ) as info:
        restore_position(state, _identity(ds))
    assert "{'epoch': 4, 'observation_offset': 0}" in str(info.value)


def test_every_offset_a_run_can_save_is_accepted() -> None:
    # a global batch G <= N over N observations: the final batch starts before N, ends before N + G
    ds = _stream(800)  # 100 observations
    for offset in (0, 99, 100, 104, 128, 199):
        assert restore_position(_state(ds, 0, offset), _identity(ds)) == (0, offset)
    empty = _stream(0)  # no loader iterates over it: only the start is a position
    assert restore_position(_state(empty, 2, 0), _identity(empty)) == (2, 0)
    with pytest.raises(ValueError, match=r"observation_offset=1 is past the end .*\(0 observations\)"):
        restore_position(_state(empty, 2, 1), _identity(empty))


def test_a_checkpoint_of_the_five_position_keys_loads_without_a_warning() -> None:
    """A checkpoint of the five position and order keys alone has no fingerprint: it
    loads silently, its padding past the end of an epoch included."""
    ds = _stream(1000)  # 125 observations
    for offset in (16, 128):
        state = _state(ds, 1, offset)
        del state["dataset"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert restore_position(state, _identity(ds)) == (1, offset)


def test_old_checkpoint_past_the_end_is_refused() -> None:
    state = _state(_stream(100_000), 0, 5000)
    del state["dataset"]
    with pytest.raises(ValueError, match="past the end"):
        restore_position(state, _identity(_stream(10_000)))


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([], TypeError, "must be a dict"),
        ({"epoch": 0}, ValueError, "lacks"),
        ({"epoch": -1, "observation_offset": 0}, ValueError, "epoch must be an int >= 0"),
        ({"epoch": 0, "observation_offset": True}, ValueError, "observation_offset must be an int"),
        ({"epoch": 0, "observation_offset": 0, "dataset": "x"}, ValueError, "'dataset' must be a dict"),
    ],
)
def test_malformed_checkpoints(state: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        restore_position(state, _identity(_stream(1000)))


def _deep(depth: int = 100_000) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


_FIELDS = [
    "epoch",
    "observation_offset",
    "shuffle",
    "shuffle_seed",
    "drop_last",
    "shuffle_block_size",
    "shuffle_window",
    "shuffle_block_auto",
    "dataset",
    "dataset.kind",
    "dataset.observations",
    "dataset.sequence_length",
    "dataset.digest",
]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("field", _FIELDS)
def test_a_deeply_nested_value_is_refused_by_name(field: str, shuffle: bool) -> None:
    """repr() of a 100,000-deep list raises RecursionError: no message may repr a value whole."""
    ds = _stream(1000)
    state = _state(ds, 1, 16, shuffle=shuffle, shuffle_block_size=4, shuffle_window=2)
    if field.startswith("dataset."):
        state["dataset"][field.split(".")[1]] = _deep()
    else:
        state[field] = _deep()
    key = field.rsplit(".", maxsplit=1)[-1]
    for allow in (False, True):
        with pytest.raises(ValueError, match=rf"\b{key}\b") as info:
            restore_position(state, _identity(ds, shuffle=shuffle), allow_dataset_change=allow)
        assert len(str(info.value)) < 400 and "[[[" in str(info.value)


@pytest.mark.parametrize("field", _FIELDS)
def test_a_huge_value_is_cut_short_in_the_message(field: str) -> None:
    ds = _stream(1000)
    state = _state(ds, 1, 16, shuffle_block_size=4, shuffle_window=2)
    huge: Any = "x" * 10**6
    if field.startswith("dataset."):
        state["dataset"][field.split(".")[1]] = huge
    else:
        state[field] = huge
    if field == "dataset.digest":  # of a storage in memory: not compared, so not refused
        assert restore_position(state, _identity(ds)) == (1, 16)
        return
    with pytest.raises(ValueError, match=field.rsplit(".", maxsplit=1)[-1]) as info:
        restore_position(state, _identity(ds))
    assert len(str(info.value)) < 600


def test_an_offset_too_long_to_print_is_refused() -> None:
    ds = _stream(1000)
    for offset in (10**5000, -(10**5000)):  # str() of an int refuses past 4300 digits
        with pytest.raises(ValueError, match="observation_offset") as info:
            restore_position(_state(ds, 0, offset), _identity(ds))
        assert len(str(info.value)) < 600 and "Exceeds the limit" not in str(info.value)


def test_order_changes_warn() -> None:
    ds = _stream(1000)
    with pytest.warns(UserWarning, match="shuffle=False, this loader has shuffle=True"):
        restore_position(_state(ds), _identity(ds, shuffle=True, seed=0))
    with warnings.catch_warnings():  # nothing differs: no warning, even for an unseeded shuffle
        warnings.simplefilter("error")
        restore_position(_state(ds, shuffle=True, shuffle_seed=None), _identity(ds, shuffle=True, seed=None))


class _Counted:
    """A dataset whose observations are counted as they are read: ``-1`` until counted."""

    def __init__(self, observations: int, kind: str = "packed-concat-blocks") -> None:
        self.fp = {"kind": kind, "observations": observations, "sequence_length": 16, "digest": "parquet-x"}

    def _fingerprint(self) -> dict[str, Any]:
        return dict(self.fp)


@pytest.mark.parametrize(("saved", "current"), [(-1, 500), (500, -1), (-1, -1)])
def test_a_count_not_known_on_one_side_is_not_compared(saved: int, current: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert restore_position(_state(_Counted(saved), 0, 300), _identity(_Counted(current))) == (0, 300)


def test_a_count_not_known_still_compares_the_rest_and_bounds_a_known_one() -> None:
    with pytest.raises(ValueError, match=r"kind 'packed-concat-blocks' \(saved\) != 'packed-concat'"):
        restore_position(_state(_Counted(-1), 0, 10), _identity(_Counted(-1, "packed-concat")))
    with pytest.raises(ValueError, match="past the end of this dataset"):  # counted here: bounded
        restore_position(_state(_Counted(-1), 0, 10_000), _identity(_Counted(500)))
    assert restore_position(_state(_Counted(500), 0, 10_000), _identity(_Counted(-1))) == (0, 10_000)
