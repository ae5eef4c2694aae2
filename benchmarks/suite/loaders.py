"""Every loader of the suite, built the way its documentation shows, yielding int64 (16, 2048) batches.

``build(name, spec)`` returns a zero-argument callable producing a fresh iterator; construction and
(for a resume) state loading happen inside it, so the caller can time them as part of the first
batch. ``spec`` holds ``nw`` (num_workers), ``resume`` (a batch index or None), ``big`` (the
virtual epoch of 2**24 samples) and the paths of :class:`benchmarks.suite.data.Data`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .data import BATCH, SEED, SEQ

Factory = Callable[[], Iterator[torch.Tensor]]


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """The collate of the workload, the same for every loader: the rows as one array, widened to
    int64. ``np.asarray`` stacks a list of rows (one copy); guideloom's ``Rows`` are the rows of
    one block, which it returns without a copy."""
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


def _order(num_samples: int, start: int, count: int) -> np.ndarray:
    from benchmarks._internals import Permutation

    return Permutation(num_samples, shuffle=True, seed=SEED, epoch=0).range(start, start + count)


def epochs(spec: dict[str, Any], loader: Any) -> Iterator[torch.Tensor]:
    """One epoch of ``loader``, or with ``multi_epoch`` one after another over the same loader,
    as a training loop runs ``for epoch ...: for batch in loader`` (the remote measurements'
    steady state may span epochs: a cached epoch over 100M tokens takes a tenth of a second)."""
    yield from loader
    while spec.get("multi_epoch"):
        yield from loader


# -- the limit -------------------------------------------------------------------------------------
def bare(spec: dict[str, Any]) -> Factory:
    """No loader: gather each batch's rows from a numpy memmap in one operation, convert to a tensor."""

    def it() -> Iterator[torch.Tensor]:
        mm = np.memmap(spec["raw"], dtype=np.uint16, mode="r")
        rows = len(mm) // SEQ
        view = mm[: rows * SEQ].reshape(rows, SEQ)
        start = (spec["resume"] or 0) * BATCH
        order = _order(rows, start, min(rows - start, 2**20))  # the epoch (or its next 2**20 samples)
        for b in range(len(order) // BATCH):
            yield torch.from_numpy(view[order[b * BATCH : (b + 1) * BATCH]].astype(np.int64))

    return it


# -- guideloom -------------------------------------------------------------------------------------
def guideloom(spec: dict[str, Any]) -> Factory:
    import guideloom as gl

    def it() -> Iterator[torch.Tensor]:
        options = {"cache_dir": spec["cache"]} if spec.get("gl_cache") else {}
        blocks = {"shuffle_block_size": spec["gl_block"]} if spec.get("gl_block") else {}
        loader = gl.StatefulDataLoader.from_storage(
            gl.open_stream(spec["gl"], **options),
            collate,
            sequence_length=SEQ,
            local_batch_size=BATCH,
            shuffle=True,
            shuffle_seed=SEED,
            num_workers=spec["nw"],
            prefetch=spec.get("prefetch", 0),
            device=torch.device("cpu"),
            **blocks,
        )
        with loader:
            if spec["resume"]:
                state = dict(loader.state_dict())
                state["observation_offset"] = spec["resume"] * BATCH
                loader.load_state_dict(state)  # type: ignore[arg-type]
            yield from epochs(spec, loader)

    return it


# -- torch.utils.data.DataLoader -----------------------------------------------------------------
class MemmapRows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A map-style dataset over the raw uint16 file: one row per ``__getitem__`` (the usual way)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows = os.path.getsize(path) // 2 // SEQ
        self._mm: np.ndarray | None = None

    def _view(self) -> np.ndarray:
        if self._mm is None:  # opened lazily, in each worker
            self._mm = np.memmap(self.path, dtype=np.uint16, mode="r")[: self.rows * SEQ].reshape(
                self.rows, SEQ
            )
        return self._mm

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self._view()[i])


class MemmapRowsBatched(MemmapRows):
    """The same, with a batched ``__getitems__``: one fancy-index gather per batch, already int64."""

    def __getitems__(self, idx: list[int]) -> torch.Tensor:  # type: ignore[override]
        return torch.from_numpy(self._view()[np.asarray(idx)].astype(np.int64))


def _identity(batch: Any) -> Any:
    return batch


class SkipSampler(torch.utils.data.Sampler[int]):
    """torch's own shuffle (randperm with a seeded generator), starting ``skip`` positions in.

    torch's DataLoader keeps no state: this is the cheapest resume a user can write for it."""

    def __init__(self, n: int, skip: int) -> None:
        self.n, self.skip = n, skip

    def __len__(self) -> int:
        return self.n - self.skip

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(SEED)
        yield from torch.randperm(self.n, generator=g)[self.skip :].tolist()


def _torch_common(spec: dict[str, Any], batched: bool) -> tuple[Any, dict[str, Any]]:
    ds = (MemmapRowsBatched if batched else MemmapRows)(spec["raw"])
    kw: dict[str, Any] = {
        "batch_size": BATCH,
        "num_workers": spec["nw"],
        "collate_fn": _identity if batched else collate,
        "drop_last": True,
    }
    if spec["nw"]:
        kw["persistent_workers"] = False
        kw["prefetch_factor"] = 2
    return ds, kw


def torch_dl(spec: dict[str, Any], batched: bool = False) -> Factory:
    def it() -> Iterator[torch.Tensor]:
        ds, kw = _torch_common(spec, batched)
        sampler = SkipSampler(len(ds), (spec["resume"] or 0) * BATCH)
        dl = torch.utils.data.DataLoader(ds, sampler=sampler, **kw)
        yield from dl

    return it


def torch_dl_batched(spec: dict[str, Any]) -> Factory:
    return torch_dl(spec, batched=True)


# -- torchdata StatefulDataLoader ------------------------------------------------------------------
def torchdata(spec: dict[str, Any], batched: bool = False) -> Factory:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def it() -> Iterator[torch.Tensor]:
        ds, kw = _torch_common(spec, batched)
        dl = StatefulDataLoader(ds, shuffle=True, generator=torch.Generator().manual_seed(SEED), **kw)
        if spec["resume"]:
            dl.load_state_dict(_torchdata_state(spec["resume"], spec["nw"], len(ds)))
        yield from dl

    return it


def torchdata_batched(spec: dict[str, Any]) -> Factory:
    return torchdata(spec, batched=True)


def _torchdata_state(batches: int, nw: int, n: int) -> dict[str, Any]:
    """The state torchdata's StatefulDataLoader would have saved after ``batches`` batches
    (written out so the run need not load a million batches first; the layout is its own)."""
    g = torch.Generator().manual_seed(SEED)
    sampler_state = {
        "samples_yielded": batches * BATCH,
        "sampler_iter_state": {"generator": g.get_state(), "yielded": batches * BATCH},
    }
    if nw == 0:
        return {
            "_index_sampler_state": None,
            "_sampler_iter_state": sampler_state,
            "_sampler_iter_yielded": batches,
            "_num_yielded": batches,
            "_IterableDataset_len_called": None,
            "_shared_seed": None,
            "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": False},
            "dataset_state": None,
            "_iterator_finished": False,
        }
    raise NotImplementedError("torchdata resume is measured with num_workers=0")


# -- MosaicML Streaming ----------------------------------------------------------------------------
def _mds_collate(samples: Sequence[dict[str, bytes]]) -> torch.Tensor:
    return collate([np.frombuffer(s["tokens"], dtype=np.uint16) for s in samples])


def streaming(spec: dict[str, Any]) -> Factory:
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    def it() -> Iterator[torch.Tensor]:
        clean_stale_shared_memory()
        kw: dict[str, Any] = {"local": spec["mds"]}
        if spec.get("remote_mds"):
            kw = {"remote": spec["remote_mds"], "local": spec["cache"]}
        ds = StreamingDataset(**kw, shuffle=True, shuffle_seed=SEED, batch_size=BATCH, num_canonical_nodes=1)
        if spec["resume"]:
            ds.load_state_dict(
                {
                    "epoch": 0,
                    "sample_in_epoch": spec["resume"] * BATCH,
                    "num_canonical_nodes": 1,
                    "shuffle_seed": SEED,
                    "initial_physical_nodes": 1,
                }
            )
        dl = StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=spec["nw"], collate_fn=_mds_collate, drop_last=True
        )
        yield from epochs(spec, dl)

    return it


# -- LitData ---------------------------------------------------------------------------------------
def _lit_collate(samples: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(samples).to(torch.int64)


def litdata(spec: dict[str, Any]) -> Factory:
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    kw: dict[str, Any] = {}
    src = spec["litdata"]
    if spec.get("remote_litdata"):
        src = spec["remote_litdata"]
        kw = {"cache_dir": spec["cache"], "storage_options": spec["storage_options"]}
        # LitData's obstore client refuses plain http; the loopback server here is http, so let it
        # (over https to a real bucket nothing would change).
        import litdata.streaming.downloader as lit_dl

        lit_dl._OBSTORE_CLIENT_OPTIONS = {**lit_dl._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}  # type: ignore[assignment]

    def make() -> Any:
        ds = StreamingDataset(src, item_loader=TokensLoader(block_size=SEQ), shuffle=True, seed=SEED, **kw)
        return StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=spec["nw"], collate_fn=_lit_collate, drop_last=True
        )

    state = None
    if spec["resume"]:  # LitData's own state after one batch (untimed), moved to batch `resume`
        dl0 = make()
        next(iter(dl0))
        state = dl0.state_dict()
        n = spec["resume"] * BATCH
        state["num_samples_yielded"] = n
        state["dataset"]["num_samples_yielded"] = n
        state["dataset"]["sample_in_epoch"] = n
        del dl0

    def it() -> Iterator[torch.Tensor]:
        dl = make()
        if state is not None:
            dl.load_state_dict(state)
        yield from epochs(spec, dl)

    return it


# -- Grain -----------------------------------------------------------------------------------------
class GrainMemmapSource:
    """A Grain ``RandomAccessDataSource`` over the raw uint16 file (Grain's memmap data source)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows = os.path.getsize(path) // 2 // SEQ
        self._mm: np.ndarray | None = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        return np.asarray(self._mm[i * SEQ : (i + 1) * SEQ])

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "rows": self.rows, "_mm": None}


def _grain_int64(batch: np.ndarray) -> np.ndarray:
    return batch.astype(np.int64)


def grain(spec: dict[str, Any]) -> Factory:
    import grain.python as gp

    def it() -> Iterator[torch.Tensor]:
        src = GrainMemmapSource(spec["raw"])
        sampler = gp.IndexSampler(
            num_records=len(src), shard_options=gp.NoSharding(), shuffle=True, num_epochs=1, seed=SEED
        )

        class ToInt64(gp.MapTransform):
            def map(self, element: np.ndarray) -> np.ndarray:
                return _grain_int64(element)

        dl = gp.DataLoader(
            data_source=src,
            sampler=sampler,
            operations=[gp.Batch(batch_size=BATCH, drop_remainder=True), ToInt64()],
            worker_count=spec["nw"],
        )
        iterator = iter(dl)
        if spec["resume"]:
            state = json.loads(iterator.get_state())
            # the last record index of batch `resume - 1`; the sampler is stateless (no replay)
            state["last_seen_indices"] = {"0": spec["resume"] * BATCH - 1}
            iterator.set_state(json.dumps(state).encode())
        for b in iterator:
            yield torch.from_numpy(b)

    return it


PEERS: dict[str, Callable[[dict[str, Any]], Factory]] = {
    "bare": bare,
    "guideloom": guideloom,
    "torch": torch_dl,
    "torch-getitems": torch_dl_batched,
    "torchdata": torchdata,
    "torchdata-getitems": torchdata_batched,
    "streaming": streaming,
    "litdata": litdata,
    "grain": grain,
}
