"""Public types: the loader's checkpoint, the keyword arguments of ``from_storage``, and the
options of the storage functions for object stores.

No ``from __future__ import annotations`` here: ``TypedDict`` reads ``NotRequired`` from the
evaluated annotations, so with string annotations Python 3.11 would list the optional keys of
:class:`StatefulDataLoaderStateDict` in ``__required_keys__``.
"""

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

if TYPE_CHECKING:
    import torch

__all__ = [
    "DatasetFingerprint",
    "LoaderOptions",
    "OpenOptions",
    "StatefulDataLoaderStateDict",
    "StoreOptions",
    "WriteOptions",
]


class DatasetFingerprint(TypedDict):
    """What a checkpoint records of the dataset its position counts.

    ``load_state_dict`` refuses a checkpoint whose fingerprint does not match the loader's
    dataset (unless told ``allow_dataset_change=True``): a position counted over other data
    would skip or repeat observations.
    """

    kind: str
    """``"stream"``, ``"documents"``, ``"packed-concat"`` or ``"packed-best_fit"`` (a custom
    dataset: its class name)."""
    observations: int
    """Number of observations (samples) in the dataset; ``-1`` for one counted as it is read
    (packed Parquet text) whose count was not complete when the checkpoint was saved."""
    sequence_length: int
    """Elements per stream sample; 0 for documents."""
    digest: str
    """A digest of the written dataset's manifest (files, lengths, checksums); empty for
    storages without one (in memory), which are compared by their counts alone."""


class StatefulDataLoaderStateDict(TypedDict):
    """Checkpoint returned by ``StatefulDataLoader.state_dict``.

    ``epoch`` and ``observation_offset`` identify the global sample position delivered to the
    consumer; prefetched batches that were not yielded are not included. ``shuffle``,
    ``shuffle_seed`` and ``drop_last`` record how the loader was constructed; ``load_state_dict``
    does not apply them. All values are plain ints, bools or None, so the checkpoint saves with
    ``torch.save`` and loads with ``torch.load(..., weights_only=True)``.
    """

    epoch: int
    """Epoch index. It increments when an iterator is exhausted."""
    observation_offset: int
    """Global sample position in the current epoch; advances by the global batch size per
    delivered batch, including padding in an incomplete final batch."""
    shuffle: bool
    """Whether that loader was constructed with shuffling enabled."""
    shuffle_seed: int | None
    """Seed used for shuffling. None is not reproducible."""
    drop_last: bool
    """Whether that loader drops an incomplete global batch."""
    dataset: NotRequired[DatasetFingerprint]
    """The dataset the position counts. A checkpoint without it (the five position and order keys
    alone) loads without the dataset check: only its offset is checked."""
    shuffle_block_size: NotRequired[int]
    """Samples per shuffle block that loader's order used (``"auto"`` resolved), present for a
    block shuffle only: absent means blocks of 1, a global row shuffle (or no shuffle)."""
    shuffle_window: NotRequired[int]
    """Blocks per mixing window that loader's order used (present with ``shuffle_block_size``)."""
    shuffle_block_auto: NotRequired[bool]
    """Whether that loader was given ``shuffle_block_size="auto"`` (present with
    ``shuffle_block_size``): over a storage's own blocks (a Parquet file's row groups),
    ``"auto"`` keeps them, an order no size reproduces."""
    counts: NotRequired[str]
    """What a dataset counted as it read (packed Parquet text: each block's tokens), present for
    such a dataset: a resume in another process counts only the blocks it reads, not every
    window before its offset. Encoded, with a digest (a damaged one is refused)."""
    history: NotRequired[str]
    """Where the batch geometry (``local_batch_size``, ``world_size``) changed in the current
    epoch and the one before: ``epoch:offset:step:local_batch_size:world_size`` per change,
    ``;`` between them (``""`` before the loader's first iterator). What ``explain()`` maps a
    step to positions with after resumes; a checkpoint without it counts the steps before its
    offset as if the loading side's geometry had taken them."""


class LoaderOptions(TypedDict, total=False):
    """The keyword arguments ``StatefulDataLoader.from_storage`` takes after ``sequence_length``.

    Each is optional and means what the constructor's parameter of the same name means; an
    omitted one takes the default given here.
    """

    device: "torch.device | None"
    """Device batches are moved to. Default ``None``: the current CUDA device when CUDA is
    available, otherwise CPU."""
    local_batch_size: int
    """Observations per batch on this rank. Default ``1``."""
    rank: int
    """This process's rank, in ``[0, world_size)``. Default ``0``."""
    world_size: int
    """Number of ranks the dataset is partitioned across. Default ``1``."""
    num_workers: int
    """Collate workers; ``0`` collates in the pipeline itself. Default ``0``."""
    parallel_method: Literal["thread", "process"]
    """What the collate workers are. Default ``"thread"``."""
    shuffle: bool
    """Shuffle the order every epoch. Default ``False``."""
    shuffle_seed: int | None
    """Seed of the shuffled order; ``None`` picks a random one (not reproducible). Default
    ``None``."""
    pin_memory: bool
    """Pin batches before a CUDA copy. Default ``False``."""
    drop_last: bool
    """Drop an incomplete final global batch. Default ``True``."""
    prefetch: int
    """Batches prepared ahead of the consumer's requests. Default ``0``."""
    shuffle_block_size: int | Literal["auto"] | None
    """Samples per contiguous shuffle block. ``None`` or ``1``: a global row shuffle, the same
    order over every storage. ``"auto"``: the storage's default, blocks of about 4 MiB on object
    storage (a few large range requests instead of one per sample) and a global shuffle on
    memory and local files. An int: that many samples per block. Default ``None``."""
    shuffle_window: int
    """Blocks per mixing window of a block shuffle: samples are shuffled among this many
    consecutive blocks of the shuffled block order (ignored for a global shuffle). Default
    ``16``."""
    track_deliveries: bool
    """Tally each delivered batch (a count and a digest of its positions) for ``audit()``.
    Default ``True``; the cost is a few microseconds a batch."""
    persistent_workers: bool
    """Keep process workers running between iterators (epochs), until ``close()``. Default
    ``True``."""
    collate_mode: Literal["auto", "workers", "inline"] | None
    """Where ``collate_fn`` runs when ``num_workers > 0``. ``"auto"``: measured in a sync ``for``
    over memory or local files, the workers kept only while they make your loop's cycle shorter
    (see the docs' Workers page); with process workers, the batches read while they start are
    collated in the main process. ``"workers"``: only on the workers, as
    ``torch.utils.data.DataLoader`` does (needs ``num_workers > 0``). ``"inline"``: each batch read
    and collated when you ask for it, as at ``num_workers=0`` and ``prefetch=0``; no worker is
    started. Default ``None``: ``"workers"`` with ``parallel_method="process"`` and
    ``num_workers > 0`` (``collate_fn`` then runs only in the worker processes), else ``"auto"``."""


class StoreOptions(TypedDict, total=False):
    """How to reach an object store (``s3://``, ``gs://``, ``az://``, ``http(s)://``): the keys
    every call that opens, writes or verifies a remote dataset takes. They override the standard
    environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). Credentials never
    appear in a message, a log line or a ``repr``. Any other obstore ``S3Config``, ``GCSConfig``
    or ``AzureConfig`` key is passed on to the store as well."""

    endpoint: str
    """The store's URL (``endpoint_url`` is taken as a synonym)."""
    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    session_token: str
    region: str
    skip_signature: bool
    """Send unsigned requests (public buckets)."""
    allow_http: bool
    allow_invalid_certificates: bool
    proxy_url: str
    user_agent: str
    root_certificate: str
    client_options: Mapping[str, Any]
    """obstore ``ClientConfig`` keys."""
    timeout: float
    """Seconds per request. Default ``30``."""
    connect_timeout: float
    """Seconds to connect. Default ``5``."""
    retries: int
    """Retries of a failed request. Default ``5``."""
    retry_timeout: float
    """No retry starts after this many seconds. Default ``120``."""
    backoff: float
    """First retry's backoff in seconds, doubled each retry, with full jitter. Default ``0.1``."""
    max_backoff: float
    """Longest backoff in seconds. Default ``5``."""


class OpenOptions(StoreOptions, total=False):
    """What ``open_stream``, ``open_documents`` and ``verify_dataset`` take for a remote dataset:
    how to reach the store, and how to read it."""

    max_inflight_requests: int
    """Range requests in flight at once. Default ``256``."""
    max_inflight_bytes: int
    """Bytes in flight at once. Default 64 MiB."""
    coalesce_gap: int
    """Bytes between two ranges that one request bridges. Default 8 KiB; ``0`` fetches exactly
    the ranges asked for."""
    max_read_amplification: float
    """Bytes a read may fetch per byte asked for, bridging its smallest gaps. Default ``4``."""
    max_request_bytes: int
    """Largest range one request asks for. Default 4 MiB."""
    max_concurrent_reads: int
    """Read-ahead windows the loader keeps in flight. Default ``4``."""
    offsets_cache_bytes: int
    """Documents: offsets up to this size are loaded at ``open()``, larger ones read per batch.
    Default 64 MiB."""
    cache_dir: str | os.PathLike[str] | None
    """A local folder the dataset is copied to in the background and read from once complete.
    Default ``None``: no copy."""
    cache_max_bytes: int | None
    """A limit on ``cache_dir``: a larger dataset is cached in chunks, downloaded ahead in the
    loader's order and evicted by next use. Default ``None``: the whole copy."""
    cache_chunk_bytes: int
    """Chunk size of a bounded cache. Default 16 MiB."""


class WriteOptions(StoreOptions, total=False):
    """What ``write_stream`` and ``write_documents`` take for a remote destination."""

    part_size: int
    """Multipart upload part size. Default 16 MiB."""
    max_upload_concurrency: int
    """Parts uploaded at once. Default ``4``."""
