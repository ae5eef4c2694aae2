"""Construction and arguments: the API reference's parameters, their checks and defaults."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from guideloom.pytorch import StatefulDataLoader
from tests.support.data import identity_stream, stack_collate
from tests.support.loader import make

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def test_same_object_from_both_modules() -> None:
    assert gl.StatefulDataLoader is StatefulDataLoader


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"local_batch_size": 0}, "local_batch_size"),
        ({"world_size": 0}, "world_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"prefetch": -1}, "prefetch"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"parallel_method": "fork"}, "parallel_method"),
    ],
)
def test_bad_arguments_raise_value_error(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(identity_stream(10), **kw)


def test_sequence_length_below_one() -> None:
    with pytest.raises(ValueError, match="sequence_length"):
        StatefulDataLoader.from_storage(identity_stream(10), stack_collate, sequence_length=0)


def test_from_storage_pairing_errors() -> None:
    with pytest.raises(ValueError, match="sequence_length"):
        StatefulDataLoader.from_storage(identity_stream(10), stack_collate)  # type: ignore[call-overload]
    docs = gl.MemoryDocumentStorage([np.arange(3)])
    with pytest.raises(ValueError, match=r"takes no"):
        StatefulDataLoader.from_storage(docs, stack_collate, sequence_length=4)
    with pytest.raises(TypeError, match="StreamStorageAbstract"):
        StatefulDataLoader.from_storage(np.arange(3), stack_collate, sequence_length=4)  # type: ignore[call-overload]


def test_from_storage_builds_the_matching_dataset() -> None:
    s = StatefulDataLoader.from_storage(identity_stream(10), stack_collate, sequence_length=4)
    assert isinstance(s.dataset, gl.StreamDataset) and s.dataset.sequence_length == 4
    d = StatefulDataLoader.from_storage(gl.MemoryDocumentStorage([np.arange(3)]), stack_collate)
    assert isinstance(d.dataset, gl.DocumentDataset)


def test_defaults_and_default_device() -> None:
    loader = StatefulDataLoader(gl.StreamDataset(identity_stream(10), 4), stack_collate)
    assert loader.device == StatefulDataLoader.get_default_device() == torch.device("cpu")
    assert (loader.local_batch_size, loader.rank, loader.world_size, loader.num_workers) == (1, 0, 1, 0)
    assert (loader.parallel_method, loader.shuffle, loader.shuffle_seed) == ("thread", False, None)
    assert (loader.pin_memory, loader.drop_last, loader.prefetch) == (False, True, 0)


def test_construction_does_not_read_and_open_checks_size() -> None:
    class Exploding(gl.MemoryStreamStorage):
        async def open(self) -> None:
            raise AssertionError("construction must not open the storage")

    make(Exploding(np.arange(40)))  # no error
    loader = make(identity_stream(5), local_batch_size=3, world_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        loader.open()
    with pytest.raises(ValueError, match="fewer than one global batch"), loader:
        pass


def test_len_and_global_batch_size() -> None:
    loader = make(identity_stream(10), local_batch_size=2, world_size=2, drop_last=True)
    assert loader.global_batch_size == 4
    with loader:
        assert len(loader) == 2
    assert len(make(identity_stream(10), local_batch_size=2, world_size=2, drop_last=False)) == 3
    # trailing elements that do not fill a sample are not a sample
    assert len(make(identity_stream(10, extra=3), local_batch_size=1)) == 10


@pytest.mark.parametrize("name", ["shuffle", "drop_last", "pin_memory"])
@pytest.mark.parametrize("value", ["no", "yes", 1, None])
def test_bool_options_refuse_truthy_values(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        make(identity_stream(100), **{name: value})


def test_numpy_integers_are_accepted_everywhere() -> None:
    loader = make(
        identity_stream(100), local_batch_size=np.int64(5), shuffle_seed=np.int32(3), prefetch=np.int64(0)
    )
    assert type(loader.local_batch_size) is int and loader.local_batch_size == 5
    assert type(loader.shuffle_seed) is int and loader.state_dict()["shuffle_seed"] == 3


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        make(identity_stream(100), device="cuda")


def test_a_stream_too_short_for_one_sample_blames_the_sequence_length() -> None:
    loader = StatefulDataLoader.from_storage(identity_stream(10), stack_collate, sequence_length=100)
    with pytest.raises(
        ValueError, match=r"from a stream of 40 elements.*use a sequence_length of at most 40"
    ):
        loader.open()
    loader = StatefulDataLoader.from_storage(
        identity_stream(10), stack_collate, sequence_length=4, local_batch_size=20
    )
    with pytest.raises(ValueError, match="use a smaller local_batch_size or sequence_length"):
        loader.open()
