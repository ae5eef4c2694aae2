"""The mixture dataset and :func:`mix`. See :mod:`guideloom._datasets.mixture`."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from guideloom._core.checks import check_bool, check_int
from guideloom._core.mixture import MAX_SAMPLES, Layout
from guideloom._core.permutation import IndexArray
from guideloom._core.weight_schedule import ScheduledLayout, WeightSchedule, check_schedule_names
from guideloom._datasets.base import (
    BuiltinDataset,
    Call,
    DatasetAbstract,
    ReadHints,
    ReadPlan,
    read_async,
    read_sync,
)
from guideloom._datasets.documents import DocumentDataset
from guideloom._datasets.mixture.order import MixtureOrder, SourceKeys
from guideloom._datasets.stream import StreamDataset
from guideloom.storage.base import DocumentStorageAbstract, StreamStorageAbstract
from guideloom.types import DatasetFingerprint

__all__ = ["Mixture", "Source", "mix"]


Source = StreamStorageAbstract[Any, Any] | DocumentStorageAbstract[Any, Any] | DatasetAbstract[Any]


# -- the read path: mixture keys to per-source reads and back, pure functions of the offsets ---
# Apart from Mixture, which holds the sources: what a key means is fixed by the layout alone.
_Group = tuple[int, IndexArray | None, IndexArray]
"""One source's read: ``(source, where in the keys or None for all of them, its indexes)``."""


def _groups(offsets: IndexArray, keys: IndexArray) -> list[_Group]:
    """``(source, where in keys or None for all, indexes in the source)`` per source read: the
    keys decoded by the layout's offsets alone, no source needed."""
    keys = np.asarray(keys, dtype=np.int64)
    src = np.searchsorted(offsets, keys, side="right") - 1
    if keys.size and (keys.min() < 0 or keys.max() >= offsets[-1]):
        raise IndexError(f"mixture keys outside [0, {int(offsets[-1])})")
    if keys.size == 0:
        return []
    first = int(src[0])
    if (src == first).all():
        return [(first, None, keys - offsets[first])]
    order = np.argsort(src, kind="stable")
    cuts = np.flatnonzero(np.diff(src[order])) + 1
    out: list[_Group] = []
    for where in np.split(order, cuts):
        s = int(src[where[0]])
        out.append((s, where, keys[where] - offsets[s]))
    return out


def _assemble(
    names: tuple[str, ...],
    with_source: bool,
    n: int,
    groups: list[_Group],
    results: Sequence[Sequence[Any]],
) -> Sequence[Any]:
    """Each source's results back at their keys' places (as ``(name, sample)`` pairs for
    ``with_source``)."""
    if len(groups) == 1 and groups[0][1] is None:
        res = results[0]
        return [(names[groups[0][0]], x) for x in res] if with_source else res
    out: list[Any] = [None] * n
    for (s, where, _), res in zip(groups, results, strict=True):
        assert where is not None
        if with_source:
            name = names[s]
            for i, x in zip(where.tolist(), res, strict=True):
                out[i] = (name, x)
        else:
            for i, x in zip(where.tolist(), res, strict=True):
                out[i] = x
    return out


def _digest(
    names: tuple[str, ...],
    datasets: Sequence[DatasetAbstract[Any]],
    layout: Layout,
    scheduled: ScheduledLayout | None = None,
) -> str:
    """What :meth:`Mixture.fingerprint_digest` returns, computed from the names, the sources and
    the layout alone (the mixture only caches it): each source's checkpoint fingerprint, with its
    name and weight."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"mixture:{layout.num_samples}".encode())
    if layout.shape:  # a schedule other than the Huffman tree's, which digests made before did not name
        h.update(f"\ntree:{layout.shape}".encode())
    if scheduled is not None:  # weights that change with progress: the whole schedule
        h.update(f"\n{scheduled.describe()}".encode())
    for name, ds, w in zip(names, datasets, layout.weights.tolist(), strict=True):
        f = ds._fingerprint()
        fp = f"{f['kind']}:{f['observations']}:{f['sequence_length']}:{f['digest']}"
        h.update(f"\n{name}:{w!r}:{fp}".encode())
    return h.hexdigest()


class Mixture(BuiltinDataset[Any]):
    """A weighted mixture of datasets, made by :func:`mix`: one dataset whose epoch interleaves
    its sources by weight, each source in its own seeded order (see :func:`mix`)."""

    _plain_reads: ClassVar[bool] = True
    _makes_own_order: ClassVar[bool] = True

    def __init__(
        self,
        sources: Mapping[str, Source],
        weights: Mapping[str, float] | WeightSchedule | None = None,
        *,
        sequence_length: int | Mapping[str, int] | None = None,
        num_samples: int | None = None,
        with_source: bool = False,
    ) -> None:
        self.names: tuple[str, ...] = _check_names(sources)
        """The sources' names, in the order given."""
        self.with_source = check_bool("with_source", with_source)
        """Whether each sample is a ``(source name, sample)`` pair."""
        self._num_samples = None if num_samples is None else check_int("num_samples", num_samples, 1)
        if self._num_samples is not None and self._num_samples >= MAX_SAMPLES:
            raise ValueError(f"num_samples must be below 2**62 (the schedule's range), got {num_samples}")
        self._schedule: WeightSchedule | None = None
        if isinstance(weights, WeightSchedule):
            check_schedule_names(weights, self.names)
            self._schedule = weights
            first = weights.weights[0]
            # the base layout gives the epoch's length and each source's keys; the schedule draws
            # (a source of weight 0 at position 0 takes the smallest positive weight there)
            least = min(x for x in first.values() if x > 0)
            weights = {name: x if x > 0 else least for name, x in first.items()}
        self._weights = _check_weights(self.names, weights)
        self._scheduled_cache: ScheduledLayout | None = None
        self._datasets, self._pending = _resolve_sources(self.names, sources, sequence_length)
        self._layout_cache: Layout | None = None
        self._list_cache: list[DatasetAbstract[Any]] | None = None
        self._own_cache: dict[bool, npt.NDArray[np.bool_]] = {}
        self._inline = False  # all sources read inline: once true, it stays (a cache completes)
        self._read_hints: ReadHints | None = None
        self._digest_cache: str | None = None
        self._keys = SourceKeys(self.names)

    def __repr__(self) -> str:
        return f"Mixture({list(self.names)}, num_samples={self._num_samples})"

    # -- the sources ------------------------------------------------------------------------------
    def with_sequence_length(self, sequence_length: int | None) -> Mixture:
        """This mixture with ``sequence_length`` for its stream storages that have none
        (``from_storage(mixture, sequence_length=...)`` calls it); ``None`` leaves it as it is."""
        if sequence_length is None:
            return self
        if not self._needs_length():
            raise ValueError(
                "every source of this mixture already has its sample rule (a sequence_length "
                "given to mix(), document storage, or a dataset), so sequence_length="
                f"{sequence_length} would apply to none: drop the argument"
            )
        out = Mixture.__new__(Mixture)
        out.__dict__.update(self.__dict__)
        out._datasets = {
            name: _with_length(self._datasets[name], sequence_length)
            if name in self._datasets
            else StreamDataset(self._pending[name], sequence_length)
            for name in self.names
        }
        out._pending = {}
        out._layout_cache = None
        out._scheduled_cache = None
        out._list_cache = None
        out._own_cache = {}
        out._read_hints = None
        out._digest_cache = None
        return out

    def _needs_length(self) -> bool:
        """Whether a stream source here, or in a mixture among the sources, has no
        ``sequence_length`` yet."""
        return bool(self._pending) or any(
            isinstance(ds, Mixture) and ds._needs_length() for ds in self._datasets.values()
        )

    @property
    def sources(self) -> dict[str, DatasetAbstract[Any]]:
        """Each source's dataset, by name."""
        self._require_resolved()
        return dict(self._datasets)

    def _datasets_list(self) -> list[DatasetAbstract[Any]]:
        """The sources' datasets in order (kept: the read path asks for it every window)."""
        if self._list_cache is None:
            self._require_resolved()
            self._list_cache = [self._datasets[name] for name in self.names]
        return self._list_cache

    def _own_orders(self, shuffle: bool) -> npt.NDArray[np.bool_]:
        """Which sources make their own order (``order()`` is not None), kept per ``shuffle``."""
        flags = self._own_cache.get(shuffle)
        if flags is None:
            own = [ds.order(shuffle=shuffle, seed=0, epoch=0) is not None for ds in self._datasets_list()]
            flags = self._own_cache[shuffle] = np.asarray(own, dtype=bool)
        return flags

    def _require_resolved(self) -> None:
        for ds in self._datasets.values():
            if isinstance(ds, Mixture):
                ds._require_resolved()  # an inner mixture's stream sources name themselves
        if self._pending:
            names = ", ".join(repr(n) for n in self._pending)
            raise ValueError(
                f"stream source(s) {names} need a sequence_length: pass sequence_length=<elements "
                "per sample> to mix() (an int for every stream source, or a dict by name) or to "
                "StatefulDataLoader.from_storage(mixture, ...)"
            )

    # -- the layout -------------------------------------------------------------------------------
    def _layout(self) -> Layout:
        if self._layout_cache is None:
            datasets = self._datasets_list()
            lengths = [len(ds) for ds in datasets]
            for name, n in zip(self.names, lengths, strict=True):
                if n < 1:
                    raise ValueError(f"mixture source {name!r} has no samples: remove it from the mixture")
            weights = self._weights if self._weights is not None else [float(n) for n in lengths]
            m = self._num_samples if self._num_samples is not None else sum(lengths)
            self._layout_cache = Layout.build(lengths, weights, m)
            self._scheduled_cache = None
            if self._schedule is not None:
                self._scheduled_cache = ScheduledLayout.build(lengths, self._schedule, self.names)
        return self._layout_cache

    def _scheduled(self) -> ScheduledLayout | None:
        """The layout of a schedule of weights (``None`` for constant weights)."""
        self._layout()
        return self._scheduled_cache

    @property
    def schedule(self) -> WeightSchedule | None:
        """The weights' schedule, where they change with progress (``None``: constant)."""
        return self._schedule

    @property
    def weights(self) -> dict[str, float]:
        """Each source's share of the mixture (normalised to sum to 1); under a schedule, the
        shares at position 0 (``loader.stats()`` reports those in force)."""
        scheduled = self._scheduled()
        shares = self._layout().weights if scheduled is None else scheduled.knot_weights[0]
        return dict(zip(self.names, shares.tolist(), strict=True))

    @property
    def samples_per_epoch(self) -> dict[str, int]:
        """How many samples each source serves in one mixture epoch (its weight times
        ``len(mixture)``, rounded by the schedule); under a schedule of weights, in the first
        epoch."""
        scheduled = self._scheduled()
        if scheduled is not None:
            counts = scheduled.counts(len(self)).tolist()
            return dict(zip(self.names, counts, strict=True))
        return dict(zip(self.names, self._layout().per_epoch.tolist(), strict=True))

    @property
    def discrepancy_bounds(self) -> dict[str, float]:
        """For each source, the bound on ``|samples of it among the first n positions - weight *
        n|`` that holds for every prefix ``n`` of every epoch (see :func:`mix`). Under a schedule of
        weights, the bound on ``|samples among the first P global positions - the integral of
        its weight over them|`` for every ``P`` (see :class:`~guideloom.WeightSchedule`)."""
        scheduled = self._scheduled()
        bounds = self._layout().bounds if scheduled is None else scheduled.bounds
        return dict(zip(self.names, bounds.tolist(), strict=True))

    def fingerprint_digest(self) -> str:
        """A digest of what fixes the order: the names, weights, epoch length and each source's
        checkpoint fingerprint (a checkpoint is refused over a mixture with another digest)."""
        if self._digest_cache is None:
            self._digest_cache = _digest(self.names, self._datasets_list(), self._layout(), self._scheduled())
        return self._digest_cache

    # -- DatasetAbstract ------------------------------------------------------------------------
    def _fingerprint(self) -> DatasetFingerprint:
        """Its sources' fingerprints, names and weights in one digest."""
        return DatasetFingerprint(
            kind="mixture", observations=len(self), sequence_length=0, digest=self.fingerprint_digest()
        )

    def __len__(self) -> int:
        """The mixture epoch's length: ``num_samples``, by default the sum of the sources' lengths."""
        return self._layout().num_samples

    def order(self, *, shuffle: bool, seed: int, epoch: int) -> MixtureOrder:
        return MixtureOrder(
            self._datasets_list(),
            self._layout(),
            self._keys,
            self._own_orders(shuffle),
            shuffle=shuffle,
            seed=seed,
            epoch=epoch,
            scheduled=self._scheduled(),
        )

    def describe(self, index: int) -> dict[str, Any]:
        """Mixture key ``index``: its ``source`` (``outer/inner`` through nested mixtures), the
        sample's index in it (``source_index``) and what that source says of the sample."""
        ((s, _, idx),) = _groups(self._layout().offsets, np.asarray([index], dtype=np.int64))
        inner = self._datasets_list()[s].describe(int(idx[0]))
        name = self.names[s]
        out = {"source": name, "source_index": int(idx[0]), **inner}
        if "source" in inner:
            out["source"] = f"{name}/{inner['source']}"
        return out

    def _position_stats(self, *, epoch: int, offset: int) -> dict[str, float]:
        """``source_epoch/<name>``: the epoch of its own that each source is in at this position
        (how many times it has been read whole; a source smaller than its share exceeds the
        mixture's epoch). Under a schedule of weights also ``weight/<name>``, each source's
        (normalised) weight in force at the position, and ``drawn/<name>``, its share of the samples
        drawn since the run began. Empty until the mixture is open."""
        lay = self._layout_cache
        if lay is None:  # not open yet (a remote source may not know its length): nothing to say
            return {}
        at = min(max(offset, 0), lay.num_samples)
        scheduled = self._scheduled_cache
        if scheduled is None:
            cum = epoch * lay.per_epoch + lay.counts(at)
        else:
            progress = epoch * lay.num_samples + at
            cum = scheduled.counts(progress)
        epochs = cum // lay.lengths
        out = {f"source_epoch/{name}": float(e) for name, e in zip(self.names, epochs.tolist(), strict=True)}
        if scheduled is not None:
            weights = scheduled.weights_at(progress).tolist()
            drawn = (cum / max(progress, 1)).tolist()
            for name, w, d in zip(self.names, weights, drawn, strict=True):
                out[f"weight/{name}"], out[f"drawn/{name}"] = float(w), float(d)
        return out

    async def open(self) -> None:
        datasets = self._datasets_list()
        opened: list[DatasetAbstract[Any]] = []
        try:
            for ds in datasets:
                await ds.open()
                opened.append(ds)
            self._layout_cache = None  # a storage may know its length only once open
            self._read_hints = None
            self._digest_cache = None
            self._inline = False
            # What a resume needs, made here once: the schedule, the fingerprint, the name keys.
            self._layout()
            self.fingerprint_digest()
            _ = self.read_hints
            self._keys.name_keys()
        except BaseException:
            for ds in reversed(opened):
                await ds.close()
            raise

    async def close(self) -> None:
        errors: list[BaseException] = []
        for ds in reversed(self._datasets_list()):
            try:
                await ds.close()
            except Exception as exc:  # close them all, then raise the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    def _read(self, indices: npt.NDArray[np.int64]) -> ReadPlan:
        """Samples at mixture keys ``indices``: each source read once (concurrently, async)."""
        datasets = self._datasets_list()
        groups = _groups(self._layout().offsets, indices)
        calls = [
            Call(
                functools.partial(datasets[s]._read_many_sync, idx),
                functools.partial(datasets[s].read_many, idx),
            )
            for s, _, idx in groups
        ]
        results = yield calls
        # a source whose samples a step finishes where a loader collates (texts it tokenizes)
        # is finished here: a mixture's samples are its sources' finished samples
        finishes = [datasets[s]._finish_step() for s, _, _ in groups]
        results = [r if f is None else f(r) for f, r in zip(finishes, results, strict=True)]
        return _assemble(self.names, self.with_source, len(indices), groups, results)

    async def read_many(self, indices: npt.NDArray[np.int64]) -> Sequence[Any]:
        return await read_async(self._read(indices))

    def read_many_sync(self, indices: npt.NDArray[np.int64]) -> Sequence[Any]:
        return read_sync(self._read(indices))

    @property
    def _reads_inline(self) -> bool:
        if not self._plain_reads or self._pending:
            return False
        if not self._inline:  # asked every window: kept once true (local files stay local)
            self._inline = all(ds._reads_inline for ds in self._datasets_list())
        return self._inline

    def _check_contract(self) -> None:
        """Each source's (what a source's own loader would check), then the mixture's."""
        for ds in self._datasets_list():
            ds._check_contract()
        super()._check_contract()

    def _hints(self) -> ReadHints:
        """The sources' most concurrent reads and largest read window, and their samples' bytes
        weighted by the mixture's weights; kept once computed."""
        if self._read_hints is None:
            hints = [ds.read_hints for ds in self._datasets_list()]
            nbytes = np.asarray([h.sample_nbytes for h in hints], dtype=np.float64)
            self._read_hints = ReadHints(
                max_concurrent_reads=max(h.max_concurrent_reads for h in hints),
                read_window_bytes=max(h.read_window_bytes for h in hints),
                sample_nbytes=round(float((nbytes * self._layout().weights).sum())),
            )
        return self._read_hints


def _check_names(sources: Mapping[str, Source]) -> tuple[str, ...]:
    """The names of mix()'s ``sources``, checked: a non-empty mapping keyed by non-empty strings
    (one of the argument checks kept here, out of :class:`Mixture`'s constructor)."""
    if not isinstance(sources, Mapping) or not sources:
        raise TypeError(
            "mix() needs a non-empty mapping of source names to storages or datasets, e.g. "
            f'mix({{"web": web, "code": code}}), got {sources!r}'
        )
    for name in sources:
        if not isinstance(name, str) or not name:
            raise TypeError(f"source names must be non-empty strings, got {name!r}")
    return tuple(sources)


def _resolve_sources(
    names: tuple[str, ...], sources: Mapping[str, Source], sequence_length: int | Mapping[str, int] | None
) -> tuple[dict[str, DatasetAbstract[Any]], dict[str, StreamStorageAbstract[Any, Any]]]:
    """``(each source's dataset, the stream storages still without a sequence length)``.

    The sample rule of each kind of source in one place, apart from :class:`Mixture`, which only
    keeps the result: a dataset as it is, document storage one document per sample, stream
    storage cut by its ``sequence_length`` (or pending until ``from_storage`` gives one).
    """
    per_source, shared = _split_lengths(names, sequence_length)
    datasets: dict[str, DatasetAbstract[Any]] = {}
    pending: dict[str, StreamStorageAbstract[Any, Any]] = {}
    for name, src in sources.items():
        length = per_source.get(name, shared)
        if isinstance(src, DatasetAbstract):
            if name in per_source:
                raise ValueError(
                    f"source {name!r} is a dataset, which has its own sample rule: drop it "
                    "from sequence_length"
                )
            datasets[name] = src
        elif isinstance(src, StreamStorageAbstract):
            if length is None:
                pending[name] = src
            else:
                datasets[name] = StreamDataset(src, length)
        elif isinstance(src, DocumentStorageAbstract):
            if name in per_source:
                raise ValueError(
                    f"source {name!r} is document storage (one document per sample) and takes "
                    "no sequence_length: drop it from the sequence_length mapping"
                )
            datasets[name] = DocumentDataset(src)
        else:
            raise TypeError(
                f"source {name!r} must be stream or document storage (open_stream(), "
                "MemoryStreamStorage, ...) or a DatasetAbstract (StreamDataset, MapDataset, a "
                f"mixture, ...), got {type(src).__name__}"
            )
    return datasets, pending


def _with_length(dataset: DatasetAbstract[Any], sequence_length: int) -> DatasetAbstract[Any]:
    """A source with ``sequence_length`` given to the mixtures in it that still need one."""
    if isinstance(dataset, Mixture) and dataset._needs_length():
        return dataset.with_sequence_length(sequence_length)
    return dataset


def _check_weights(names: tuple[str, ...], weights: Mapping[str, float] | None) -> list[float] | None:
    if weights is None:
        return None
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict of source name to weight, got {type(weights).__name__}")
    if set(weights) != set(names):
        missing, extra = set(names) - set(weights), set(weights) - set(names)
        raise ValueError(
            f"weights must name every source once: missing {sorted(missing)}, unknown {sorted(extra)}"
        )
    out = []
    for name in names:
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating):
            raise TypeError(f"weight of {name!r} must be a number, got {type(w).__name__}")
        if not math.isfinite(float(w)) or float(w) <= 0:
            raise ValueError(
                f"weight of {name!r} must be finite and > 0, got {w!r} (drop a source to give it none)"
            )
        out.append(float(w))
    return out


def _split_lengths(
    names: tuple[str, ...], sequence_length: int | Mapping[str, int] | None
) -> tuple[dict[str, int], int | None]:
    """``(per-source lengths, the shared one)`` from mix()'s ``sequence_length``."""
    if sequence_length is None:
        return {}, None
    if isinstance(sequence_length, Mapping):
        unknown = set(sequence_length) - set(names)
        if unknown:
            raise ValueError(
                f"sequence_length names unknown sources {sorted(unknown)}; sources: {list(names)}"
            )
        return {k: check_int(f"sequence_length[{k!r}]", v, 1) for k, v in sequence_length.items()}, None
    return {}, check_int("sequence_length", sequence_length, 1)


def mix(
    sources: Mapping[str, Source],
    weights: Mapping[str, float] | WeightSchedule | None = None,
    *,
    sequence_length: int | Mapping[str, int] | None = None,
    num_samples: int | None = None,
    with_source: bool = False,
) -> Mixture:
    """A weighted mixture of storages and datasets, usable wherever a storage or a dataset is.

    ``StatefulDataLoader.from_storage(mix(...), collate_fn, ...)`` and
    ``StatefulDataLoader(mix(...), collate_fn, ...)`` both take it; it shuffles, shards across
    ranks and resumes exactly like a single dataset.

    Args:
        sources: Name to source: stream storage (cut into ``sequence_length`` samples), document
            storage (one document per sample), or any ``DatasetAbstract`` (a ``StreamDataset``
            with its own length, a ``MapDataset``, a packed dataset, another mixture).
        weights: Name to weight (any positive numbers; they are normalised), or a
            :class:`~guideloom.WeightSchedule` of weights that change with training progress
            (piecewise constant or linear over the mixture's global position). Default: each
            source's number of samples, so an epoch reads every source about once.
        sequence_length: Elements per sample of the stream storages: one int for all, or a dict
            by name. Stream storages left without one take ``from_storage``'s
            ``sequence_length``.
        num_samples: Samples in one mixture epoch (``len(mixture)``). Default: the sum of the
            sources' lengths.
        with_source: Make each sample a ``(source name, sample)`` pair, for a collate that needs
            to know where a sample came from (a per-source loss or metric).

    Position ``p`` of an epoch is served by source ``s`` by a deterministic low-discrepancy
    schedule: among the first ``n`` positions, source ``s`` serves ``weight_s * n`` samples up to
    a bound (:attr:`Mixture.discrepancy_bounds`), whatever ``n``: below 1 (at most ``1 - 1/(2S
    - 2)`` for S sources) for weights that print as short decimals or integers (``0.7``,
    ``0.15``, ``3``; a period of at most 2^15 positions), and for any weights in an epoch of at
    most 2^15 positions; 1/2 for two sources and within 1 for even weights otherwise, up to
    about 1.5 for ragged float weights over many sources in a longer epoch. Behind the schedule
    each source reads its own samples in its own seeded order; a source with fewer samples than
    its share of the epoch starts over in a fresh order (its own epoch, which ``loader.stats()``
    reports as ``source_epoch/<name>``), and one with more carries on where it stopped at the next mixture
    epoch. The order depends on ``(shuffle, shuffle_seed, epoch)``, the sources' lengths, names
    and weights and ``num_samples`` alone; a checkpoint records a fingerprint of all of them.

    Raises:
        TypeError: For a source that is neither storage nor a dataset, or weights that are not
            numbers.
        ValueError: For weights that do not name every source once or are not finite and
            positive, and (when the mixture is used) a stream storage without a sequence length
            or a source without samples.

    Examples:
        >>> import numpy as np
        >>> import guideloom as gl
        >>> web = gl.MemoryStreamStorage(np.arange(1000, dtype=np.uint16))
        >>> code = gl.MemoryDocumentStorage([np.arange(n, dtype=np.uint16) for n in (3, 5, 7)])
        >>> m = gl.mix({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, sequence_length=10)
        >>> len(m), m.samples_per_epoch
        (103, {'web': 72, 'code': 31})
    """
    return Mixture(
        sources, weights, sequence_length=sequence_length, num_samples=num_samples, with_source=with_source
    )
