"""Datasets of one's own: a DatasetAbstract subclass without a storage, and MapDataset over any
object with ``__len__``/``__getitem__``, in the loader with thread and process workers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

import guideloom as gl
from tests.support.loader import roundtrip, take

CPU = torch.device("cpu")


class Squares(gl.DatasetAbstract[int]):
    """A random-access source of its own: sample ``i`` is ``i * i``; counts its opens and reads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.opened = self.closed = 0
        self.calls: list[int] = []

    async def open(self) -> None:
        self.opened += 1

    async def close(self) -> None:
        self.closed += 1

    def __len__(self) -> int:
        return self.n

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[int]:
        self.calls.append(len(indices))
        return [int(i) * int(i) for i in indices]


class Bare(gl.DatasetAbstract[int]):
    """The least a dataset needs: ``__len__`` and ``read_many``."""

    def __len__(self) -> int:
        return 10

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[int]:
        return indices.tolist()


class Batched:
    """A map-style source with PyTorch's batched ``__getitems__``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.batched_calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        raise AssertionError("read through __getitems__")

    def __getitems__(self, keys: list[int]) -> list[int]:
        self.batched_calls += 1
        return [k + 1000 for k in keys]


class TorchSquares(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


def as_list(samples: Sequence[int]) -> list[int]:
    return [int(x) for x in samples]


def stack(samples: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(samples))


def test_a_subclass_needs_no_storage_and_its_open_and_close_are_called() -> None:
    ds = Squares(20)
    assert ds.storage is None
    with gl.StatefulDataLoader(ds, as_list, local_batch_size=4, device=CPU) as ld:
        assert ds.opened == 1
        batches = take(ld)
    assert ds.closed == 1
    assert batches == [[i * i for i in range(k, k + 4)] for k in range(0, 20, 4)]
    assert sum(ds.calls) == 20  # read through its read_many, in batched calls


def test_the_defaults_of_a_dataset_without_storage() -> None:
    ds = Bare()
    asyncio.run(ds.open())  # nothing to open or close: no error
    asyncio.run(ds.close())
    assert ds.read_hints == gl.ReadHints(
        max_concurrent_reads=1, read_window_bytes=4 * 2**20, read_window_batches=64, shuffle_block_bytes=None
    )
    assert ds.sequence_length == 0 and ds._fingerprint()["sequence_length"] == 0
    assert ds.order(shuffle=True, seed=0, epoch=0) is None and ds._position_stats(epoch=0, offset=0) == {}
    assert not ds._reads_inline
    with pytest.raises(NotImplementedError, match="no blocking reads"):
        ds._read_many_sync(np.arange(2))
    with gl.StatefulDataLoader(
        ds, as_list, local_batch_size=5, shuffle=True, shuffle_seed=1, device=CPU
    ) as ld:
        assert sorted(x for b in take(ld) for x in b) == list(range(10))


def test_the_built_in_datasets_keep_their_storage() -> None:
    s = gl.MemoryStreamStorage(np.arange(10))
    d = gl.MemoryDocumentStorage([np.arange(3)])
    assert gl.StreamDataset(s, 2).storage is s and gl.DocumentDataset(d).storage is d


def test_a_dataset_answers_its_storage_s_read_figures_and_its_own_sequence_length() -> None:
    class Remote(gl.MemoryStreamStorage):
        read_window_batches = 256
        shuffle_block_bytes = 8 * 2**20

    ds = gl.StreamDataset(Remote(np.arange(10)), 2)
    assert ds.read_hints.read_window_batches == 256 and ds.read_hints.shuffle_block_bytes == 8 * 2**20
    assert ds.read_hints.sample_nbytes == 2 * 8  # two int64 elements
    assert ds.sequence_length == 2 and ds._fingerprint()["sequence_length"] == 2
    assert gl.DocumentDataset(gl.MemoryDocumentStorage([np.arange(3)])).sequence_length == 0
    assert Remote(np.arange(10))._written_manifest() is None  # not a dataset guideloom wrote


def test_a_subclass_with_workers_and_resume() -> None:
    # thread workers here; process workers read the same way (the reads stay in this process,
    # the samples go to the workers): the MapDataset test below runs them
    def make() -> gl.StatefulDataLoader[int, list[int]]:
        return gl.StatefulDataLoader(
            Squares(40),
            as_list,
            local_batch_size=3,
            shuffle=True,
            shuffle_seed=4,
            num_workers=2,
            parallel_method="thread",
            prefetch=2,
            device=CPU,
        )

    with make() as ld:
        full = take(ld)
    with make() as ld:
        head = take(ld, 5)
        state = roundtrip(ld.state_dict())
    with make() as ld:
        ld.load_state_dict(state)
        assert head + take(ld) == full
    seen = [x for b in full for x in b]  # 13 batches of 3: 39 of the 40, each once
    assert len(seen) == len(set(seen)) == 39 and set(seen) <= {i * i for i in range(40)}


def test_map_dataset_over_a_list_a_range_and_a_torch_dataset() -> None:
    words = [f"w{i}" for i in range(9)]
    with gl.StatefulDataLoader(gl.MapDataset(words), list, local_batch_size=3, device=CPU) as ld:
        assert take(ld) == [words[0:3], words[3:6], words[6:9]]
    ds = gl.MapDataset(TorchSquares())
    assert len(ds) == 24 and ds._reads_inline
    with gl.StatefulDataLoader(ds, stack, local_batch_size=8, shuffle=True, shuffle_seed=0, device=CPU) as ld:
        batches = take(ld)
    seen = torch.cat(batches)
    assert sorted(seen[:, 0].tolist()) == list(range(24)) and (seen[:, 1] == seen[:, 0] ** 2).all()


def test_map_dataset_reads_through_getitems_in_batched_calls() -> None:
    src = Batched(32)
    ds = gl.MapDataset(src)
    with gl.StatefulDataLoader(ds, as_list, local_batch_size=4, device=CPU) as ld:
        assert [x for b in take(ld) for x in b] == list(range(1000, 1032))
    assert 1 <= src.batched_calls <= 8  # one call per read window, not one per sample


@pytest.mark.parametrize("method", ["thread", "process"])
@pytest.mark.slow
def test_map_dataset_with_workers_matches_the_inline_run(method: str) -> None:
    kw: dict[str, Any] = {"local_batch_size": 4, "shuffle": True, "shuffle_seed": 9, "device": CPU}
    with gl.StatefulDataLoader(gl.MapDataset(range(50)), as_list, **kw) as ld:
        inline = take(ld)
    with gl.StatefulDataLoader(
        gl.MapDataset(range(50)), as_list, num_workers=2, parallel_method=method, prefetch=1, **kw
    ) as ld:
        assert take(ld) == inline


def test_map_dataset_from_async_for_reads_off_the_loop() -> None:
    async def main() -> list[list[int]]:
        async with gl.StatefulDataLoader(
            gl.MapDataset(range(12)), as_list, local_batch_size=4, device=CPU
        ) as ld:
            return [b async for b in ld]

    assert asyncio.run(main()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_map_dataset_refuses_what_is_not_map_style() -> None:
    with pytest.raises(TypeError, match="__len__ and __getitem__"):
        gl.MapDataset(iter(range(3)))
    with pytest.raises(ValueError, match="takes no sequence_length"):
        gl.StatefulDataLoader.from_storage(gl.MapDataset(range(3)), as_list, sequence_length=2, device=CPU)


def test_the_contract_a_subclass_sees_is_small() -> None:
    """What ``help(gl.DatasetAbstract)`` and the reference page show: the members a dataset of
    one's own implements or may override; the loader's other hooks are internal."""
    public = {name for name in dir(gl.DatasetAbstract) if not name.startswith("_")}
    contract = {"storage", "open", "close", "read_many", "order", "describe", "sequence_length", "read_hints"}
    assert public == contract
    assert gl.DatasetAbstract.__abstractmethods__ == frozenset({"__len__", "read_many"})


class Windowed(Squares):
    read_hints = gl.ReadHints(read_window_batches=2)


def test_a_dataset_s_declared_read_hints_size_its_reads() -> None:
    plain, windowed = Squares(400), Windowed(400)
    for ds in (plain, windowed):
        with gl.StatefulDataLoader(ds, as_list, local_batch_size=4, device=CPU) as ld:
            assert sorted(x for b in take(ld) for x in b) == [i * i for i in range(400)]
    assert max(plain.calls) > 8, "the default windows grow past two batches"
    assert max(windowed.calls) <= 8, "windows of two batches of four at most"


def test_read_hints_as_separate_members_are_refused() -> None:
    with pytest.raises(TypeError, match=r"defines max_concurrent_reads.*read_hints = ReadHints"):

        class Loose(Bare):
            max_concurrent_reads = 4


class HintedInInit(Squares):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.read_hints = gl.ReadHints(read_window_batches=2)


def test_read_hints_set_in_init_size_the_reads_too() -> None:
    ds = HintedInInit(400)
    with gl.StatefulDataLoader(ds, as_list, local_batch_size=4, device=CPU) as ld:
        assert sorted(x for b in take(ld) for x in b) == [i * i for i in range(400)]
    assert max(ds.calls) <= 8


def test_read_hints_that_are_not_read_hints_are_refused_saying_what_to_do() -> None:
    with pytest.raises(TypeError, match=r"read_hints is a dict, not a ReadHints.*ReadHints\("):

        class Declared(Bare):
            read_hints = {"max_concurrent_reads": 4}  # type: ignore[assignment]  # noqa: RUF012

    with pytest.raises(TypeError, match=r"read_hints is a dict, not a ReadHints"):
        Bare().read_hints = {"max_concurrent_reads": 4}  # type: ignore[assignment]

    class Computed(Bare):
        @property
        def read_hints(self) -> gl.ReadHints:
            return {"max_concurrent_reads": 4}  # type: ignore[return-value]

    loader = gl.StatefulDataLoader(Computed(), as_list, local_batch_size=2, device=CPU)
    with pytest.raises(TypeError, match=r"Computed.read_hints gave a dict, not a ReadHints"), loader:
        pass


def test_a_read_hint_set_on_the_dataset_object_is_refused_not_ignored() -> None:
    ds = Bare()
    ds.max_concurrent_reads = 8  # type: ignore[attr-defined]
    loader = gl.StatefulDataLoader(ds, as_list, local_batch_size=2, device=CPU)
    with pytest.raises(TypeError, match=r"sets max_concurrent_reads on the dataset.*ReadHints"), loader:
        pass


@pytest.mark.parametrize(
    "hook", ["will_read", "read_many_sync", "fingerprint", "collate_with", "natural_blocks"]
)
def test_a_loader_hook_defined_by_a_dataset_of_one_s_own_is_refused_not_ignored(hook: str) -> None:
    with pytest.raises(
        TypeError, match=rf"defines {hook}, which the loader does not ask.*__len__ and read_many"
    ):
        type("Hooked", (Bare,), {hook: lambda self, *a, **k: None})


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_concurrent_reads", 0, ValueError),
        ("read_window_bytes", 0, ValueError),
        ("read_window_batches", 1.5, TypeError),
        ("shuffle_block_bytes", 0, ValueError),
        ("sample_nbytes", -1, ValueError),
    ],
)
def test_read_hints_are_checked(field: str, value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=field):
        gl.ReadHints(**{field: value})


def test_a_subclass_of_a_guideloom_dataset_may_define_its_blocking_read_and_no_other_hook() -> None:
    class Checked(gl.StreamDataset):  # type: ignore[type-arg]
        def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Any:
            return super().read_many_sync(indices)

    with pytest.raises(TypeError, match=r"defines will_read, which the loader does not ask"):

        class Hinted(gl.StreamDataset):  # type: ignore[type-arg]
            def will_read(self, windows: Any) -> None:
                pass


def test_a_mixture_s_sources_are_checked_as_a_loader_would_check_them() -> None:
    loose = Bare()
    loose.max_concurrent_reads = 8  # type: ignore[attr-defined]
    mixed = gl.mix({"a": loose, "b": Bare()}, weights={"a": 0.5, "b": 0.5})
    loader = gl.StatefulDataLoader(mixed, as_list, local_batch_size=2, device=CPU)
    with pytest.raises(TypeError, match=r"sets max_concurrent_reads on the dataset"), loader:
        pass
