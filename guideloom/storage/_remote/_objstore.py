"""Object-store plumbing on obstore: locations, options, secrets, bounded concurrent range reads.

Every obstore call guideloom makes is one of obstore's *synchronous* functions, run on a Python
thread (the caller's, or the shared ``guideloom-io`` pool for batched reads) and awaited from the
event loop through ``run_in_executor``. That is deliberate. obstore's ``*_async`` functions
complete their asyncio futures from tokio worker threads, which call into Python
(``loop.call_soon_threadsafe``) *after* the awaiting coroutine may already have resumed; a process
that exits in that window aborts (SIGABRT, exit code 134) because the tokio thread tries to take
the GIL during interpreter finalisation. Measured with obstore 0.12 on CPython 3.11: 6 of 30 short
scripts aborted. The synchronous functions block in the calling Python thread with the GIL
released and never let a tokio thread touch Python, and the pool's threads are joined before the
interpreter finalises (``concurrent.futures`` registers that), so the abort cannot happen. Each
I/O thread runs one batch of up to :data:`RANGES_PER_CALL` ranges of an object, fetched
concurrently as conditional single-range GETs (the others on :func:`range_executor`); that
amortises the hand-off to the event loop over several requests. (obstore's ``get_ranges`` takes
no conditions, merges adjacent ranges into one request, and panics on a short body.)

Retries are guideloom's own (obstore's are turned off for reads, so the two never multiply):
bounded in count and in time, exponential backoff with full jitter, on throttling, 5xx,
timeouts, connection errors, short reads and answers obstore's client fails on (it panics on some
malformed ones); never on "not found", "forbidden", other 4xx, or an object that changed.

Every range read of a data object is conditional on the object being the one the dataset was
opened with (:class:`ObjectVersion`: its ETag, or its modification time where the store gives no
strong ETag), and the answer's own size and ETag are checked too, so a server that ignores the
condition cannot slip another object's bytes in; a read that covers a whole object is checked
against the manifest's sha256.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import random
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, TypeVar
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from guideloom._core.text import plural
from guideloom._errors import RemoteReadError, StorageError
from guideloom._process import pool

__all__ = [
    "RANGES_PER_CALL",
    "ClientFaultError",
    "InflightLimit",
    "Location",
    "ContentMismatchError",
    "ObjectChangedError",
    "ObjectVersion",
    "ReadOptions",
    "RetryPolicy",
    "WriteOptions",
    "get_checked",
    "io_executor",
    "make_store",
    "map_error",
    "obstore_message",
    "parse_location",
    "require_obstore",
    "split_options",
]

T = TypeVar("T")

#: Ranges per I/O-thread call (fetched concurrently, one GET each).
RANGES_PER_CALL: Final = 10
_MiB: Final = 2**20

_SCHEMES: Final = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "azure": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "adl": "azure",
    "http": "http",
    "https": "http",
}


# -- locations -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Location:
    """A parsed object-store URL: which backend, which bucket and prefix, and how to show it."""

    url: str = field(repr=False)  # as given: it may hold credentials
    kind: str  # "s3" | "gcs" | "azure" | "http"
    bucket: str
    prefix: str
    display: str  # the URL without credentials or query string: safe for messages and repr

    def object_url(self, relpath: str) -> str:
        return f"{self.display.rstrip('/')}/{relpath}"


def display_url(url: str) -> str:
    """``url`` without user information, query string or fragment (they may hold secrets)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def parse_location(url: str) -> Location:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        problem = str(exc)
    else:
        problem = ""
    if problem:  # raised here, not in the handler: the chain keeps no trace of the raw URL
        raise ValueError(f"invalid object-store URL {display_url(url)!r}: {problem}")
    kind = _SCHEMES.get(parts.scheme.lower())
    if kind is None:
        raise ValueError(f"unsupported location {display_url(url)!r}: use s3://, gs://, az:// or http(s)://")
    shown = display_url(url)
    if kind == "http":
        if not parts.hostname:
            raise ValueError(f"URL {shown!r} names no host")
        return Location(url, kind, "", parts.path.strip("/"), shown)
    # abfss://container@account.dfs.core.windows.net/... names its container before the "@"
    bucket = parts.netloc.split("@", 1)[0] if kind == "azure" and "@" in parts.netloc else parts.netloc
    if not bucket:
        raise ValueError(f"URL {shown!r} names no bucket: use {parts.scheme}://bucket/prefix")
    return Location(url, kind, bucket, parts.path.strip("/"), shown)


# -- options ---------------------------------------------------------------------------------------
def _seconds(name: str, value: Any, *, minimum: float = 0.0) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ValueError(f"{name} must be a number of seconds >= {minimum}, got {value!r}")
    return float(value)


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries: at most ``retries`` more attempts, none started after ``retry_timeout``."""

    timeout: float = 30.0
    connect_timeout: float = 5.0
    retries: int = 5
    retry_timeout: float = 120.0
    backoff: float = 0.1
    max_backoff: float = 5.0

    def delay(self, attempt: int) -> float:
        """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
        return random.uniform(0.0, min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """Read-ahead tuning of an object-store dataset (``open_stream(url, **options)``)."""

    max_inflight_requests: int = 256
    max_inflight_bytes: int = 64 * _MiB
    coalesce_gap: int = 8 * 1024
    max_request_bytes: int = 4 * _MiB
    max_concurrent_reads: int = 4
    offsets_cache_bytes: int = 64 * _MiB
    max_read_amplification: float = 4.0
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    cache_dir: str | None = None
    cache_max_bytes: int | None = None
    cache_chunk_bytes: int = 16 * _MiB


@dataclass(frozen=True, slots=True)
class WriteOptions:
    part_size: int = 16 * _MiB
    max_upload_concurrency: int = 4
    policy: RetryPolicy = field(default_factory=RetryPolicy)


_POLICY_KEYS: Final = ("timeout", "connect_timeout", "retries", "retry_timeout", "backoff", "max_backoff")
_READ_KEYS: Final = (
    "max_inflight_requests",
    "max_inflight_bytes",
    "coalesce_gap",
    "max_request_bytes",
    "max_concurrent_reads",
    "offsets_cache_bytes",
    "max_read_amplification",
    "cache_dir",
    "cache_max_bytes",
    "cache_chunk_bytes",
)
_WRITE_KEYS: Final = ("part_size", "max_upload_concurrency")
_CLIENT_KEYS: Final = (
    "allow_http",
    "allow_invalid_certificates",
    "proxy_url",
    "user_agent",
    "root_certificate",
)
_ALIASES: Final = {"endpoint_url": "endpoint", "aws_endpoint_url": "endpoint"}


def _policy(opts: dict[str, Any]) -> RetryPolicy:
    p = RetryPolicy()
    return RetryPolicy(
        timeout=_seconds("timeout", opts.pop("timeout", p.timeout), minimum=0.001),
        connect_timeout=_seconds(
            "connect_timeout", opts.pop("connect_timeout", p.connect_timeout), minimum=0.001
        ),
        retries=_count("retries", opts.pop("retries", p.retries), 0),
        retry_timeout=_seconds("retry_timeout", opts.pop("retry_timeout", p.retry_timeout)),
        backoff=_seconds("backoff", opts.pop("backoff", p.backoff)),
        max_backoff=_seconds("max_backoff", opts.pop("max_backoff", p.max_backoff)),
    )


def _amplification(value: Any) -> float:
    """``max_read_amplification``: a number >= 1 (bytes read per byte asked for, at most)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1.0:
        raise ValueError(
            f"max_read_amplification must be a number >= 1 (1 reads only the bytes asked for; "
            f"4 may read up to 4x the bytes to save requests), got {value!r}"
        )
    return float(value)


def _cache_dir(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"cache_dir must be a path (str or os.PathLike), got {type(value).__name__}")
    return os.fspath(value)


def _cache_limits(opts: dict[str, Any]) -> dict[str, Any]:
    """``cache_max_bytes`` and ``cache_chunk_bytes``, checked (they need ``cache_dir``)."""
    out: dict[str, Any] = {}
    if "cache_max_bytes" in opts:
        limit = opts.pop("cache_max_bytes")
        if limit is not None:
            out["cache_max_bytes"] = _count("cache_max_bytes", limit, 0)
    if "cache_chunk_bytes" in opts:
        out["cache_chunk_bytes"] = _count("cache_chunk_bytes", opts.pop("cache_chunk_bytes"), 4096)
    if out and opts.get("cache_dir") is None:
        raise ValueError(
            f"{' and '.join(sorted(out))} only apply with cache_dir: pass cache_dir=<a local folder> "
            "as well, or drop them"
        )
    return out


def split_options(
    options: Mapping[str, Any], *, write: bool
) -> tuple[ReadOptions, WriteOptions, dict[str, Any], dict[str, Any]]:
    """Split ``options`` into read tuning, write tuning, store config and client options."""
    opts = dict(options)
    wrong: tuple[str, ...] = _READ_KEYS if write else _WRITE_KEYS
    bad = [k for k in wrong if k in opts]
    if bad:
        raise TypeError(f"options {bad} only apply to {'reading' if write else 'writing'} a dataset")
    policy = _policy(opts)
    limits = _cache_limits(opts)  # before cache_dir is taken from opts
    d = ReadOptions()
    read = ReadOptions(
        max_inflight_requests=_count(
            "max_inflight_requests", opts.pop("max_inflight_requests", d.max_inflight_requests), 1
        ),
        max_inflight_bytes=_count(
            "max_inflight_bytes", opts.pop("max_inflight_bytes", d.max_inflight_bytes), 1
        ),
        coalesce_gap=_count("coalesce_gap", opts.pop("coalesce_gap", d.coalesce_gap), 0),
        max_request_bytes=_count("max_request_bytes", opts.pop("max_request_bytes", d.max_request_bytes), 1),
        max_concurrent_reads=_count(
            "max_concurrent_reads", opts.pop("max_concurrent_reads", d.max_concurrent_reads), 1
        ),
        offsets_cache_bytes=_count(
            "offsets_cache_bytes", opts.pop("offsets_cache_bytes", d.offsets_cache_bytes), 0
        ),
        max_read_amplification=_amplification(opts.pop("max_read_amplification", d.max_read_amplification)),
        policy=policy,
        cache_dir=_cache_dir(opts.pop("cache_dir", None)),
        **limits,
    )
    w = WriteOptions()
    part_size = _count("part_size", opts.pop("part_size", w.part_size), 5 * _MiB)
    writeopts = WriteOptions(
        part_size=part_size,
        max_upload_concurrency=_count(
            "max_upload_concurrency", opts.pop("max_upload_concurrency", w.max_upload_concurrency), 1
        ),
        policy=policy,
    )
    client = dict(opts.pop("client_options", None) or {})
    for key in _CLIENT_KEYS:
        if key in opts:
            client[key] = opts.pop(key)
    config = {_ALIASES.get(k, k): v for k, v in opts.items()}
    return read, writeopts, config, client


# -- secrets ---------------------------------------------------------------------------------------
_SECRET_NAME: Final = re.compile(r"(secret|token|password|passwd|sas|credential|private|key)", re.IGNORECASE)
_ENV_PREFIX: Final = re.compile(r"^(AWS|AZURE|GOOGLE|GCS|GCP|OBJECT_STORE)_", re.IGNORECASE)
_SCRUB_PATTERNS: Final = (
    (re.compile(r"(?i)(https?|s3|gs|az|abfss?)://[^/\s@]*@"), r"\1://***@"),  # user:password@
    (re.compile(r"(?i)(https?://[^\s?#\"']*)\?[^\s\"'<>,)]*"), r"\1?***"),  # query strings (SAS)
    (
        re.compile(
            r"(?i)(authorization|x-amz-security-token|x-amz-signature|signature)([\"':= ]+)[^\s\"',]+"
        ),
        r"\1\2***",
    ),
)


def secret_values(config: Mapping[str, Any], url: str = "") -> tuple[str, ...]:
    """Strings that must never appear in a message: credential options, credential env vars,
    and the password and query values of ``url``."""
    found = {str(v) for k, v in config.items() if _SECRET_NAME.search(k) and isinstance(v, str)}
    try:
        parts = urlsplit(url)
        found.update(v for v in (parts.password, parts.username) if v)
        found.update(v for _k, v in parse_qsl(parts.query) if v)
    except ValueError:
        pass
    for name, value in os.environ.items():
        if _ENV_PREFIX.match(name) and _SECRET_NAME.search(name.split("_", 1)[1]):
            found.add(value)
    return tuple(sorted((s for s in found if len(s) >= 4), key=len, reverse=True))


def scrub(text: str, secrets: Sequence[str]) -> str:
    for s in secrets:
        text = text.replace(s, "***")
    for pattern, repl in _SCRUB_PATTERNS:
        text = pattern.sub(repl, text)
    return text


def obstore_message(exc: BaseException, secrets: Sequence[str]) -> str:
    """The first paragraph of an obstore error (without its Rust debug dump), scrubbed."""
    text = str(exc).split("\n\nDebug source:", 1)[0].strip()
    text = " ".join(text.split())
    if len(text) > 600:
        text = text[:600] + "..."
    return scrub(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, secrets)


def map_error(exc: BaseException, what: str, secrets: Sequence[str]) -> Exception:
    """An obstore failure as the Python error a user expects, with a scrubbed message.

    Raise the result outside the ``except`` block that caught ``exc`` (``raise ... from None``
    would still keep ``exc``, and the credentials its text may hold, as ``__context__``).
    """
    import obstore.exceptions as oe

    msg = f"{what}: {obstore_message(exc, secrets)}"
    if isinstance(exc, FileNotFoundError | oe.NotFoundError):
        return FileNotFoundError(msg)
    if isinstance(exc, PermissionError | oe.PermissionDeniedError | oe.UnauthenticatedError):
        return PermissionError(msg)
    return StorageError(msg)


# -- stores ----------------------------------------------------------------------------------------
INSTALL_HINT: Final = 'pip install "guideloom[remote]"'


def require_obstore() -> Any:
    """The ``obstore.store`` module, or a ModuleNotFoundError that says which extra to install."""
    try:
        import obstore.store
    except ImportError:
        store = None
    else:
        store = obstore.store
    if store is None:  # raised outside the handler: the error is the whole message
        raise ModuleNotFoundError(
            "object-store locations (s3://, gs://, az://, http(s)://) need the obstore package, "
            f"which guideloom's remote extra installs: {INSTALL_HINT}",
            name="obstore",
        )
    return store


#: Called once, before this process's first object store is made: obstore's runtime, whose
#: threads a fork cannot copy, starts with the stores. Process workers fork a standby zygote here.
BEFORE_FIRST_STORE: list[Callable[[], None]] = []
_FIRST_STORE = threading.Event()  # set once the hooks have run


def _before_first_store() -> None:
    if not _FIRST_STORE.is_set():
        _FIRST_STORE.set()
        for hook in BEFORE_FIRST_STORE:
            hook()


_ENV_CLIENT_KEYS: Final = {
    "allow_http": bool,
    "allow_invalid_certificates": bool,
    "proxy_url": str,
    "proxy_ca_certificate": str,
    "proxy_excludes": str,
    "user_agent": str,
    "http1_only": bool,
    "http2_only": bool,
}
_ENV_PREFIXES: Final = {"s3": ("AWS_",), "gcs": ("GOOGLE_", "GCS_"), "azure": ("AZURE_",), "http": ()}


def _client_env(kind: str) -> dict[str, Any]:
    """HTTP-client settings from the environment (e.g. ``AWS_ALLOW_HTTP``).

    obstore reads these itself only when no ``client_options`` are passed; guideloom always
    passes some (its timeouts), so it reads them here, under the explicit options.
    """
    out: dict[str, Any] = {}
    for key, typ in _ENV_CLIENT_KEYS.items():
        for prefix in _ENV_PREFIXES[kind]:
            value = os.environ.get(f"{prefix}{key.upper()}")
            if value is not None:
                out[key] = value.strip().lower() in ("1", "true", "yes", "on") if typ is bool else value
                break
    return out


def make_store(
    loc: Location,
    config: Mapping[str, Any],
    client: Mapping[str, Any],
    policy: RetryPolicy,
    *,
    obstore_retries: bool,
) -> Any:
    """One obstore client for ``loc``; environment variables first, explicit ``config`` over them.

    ``obstore_retries`` lets obstore retry (writes, where guideloom does not retry itself); for
    reads guideloom retries and obstore's retries stay off so the two never multiply.
    """
    store_mod = require_obstore()
    import obstore.exceptions

    client_options = {
        **_client_env(loc.kind),
        "timeout": timedelta(seconds=policy.timeout),
        "connect_timeout": timedelta(seconds=min(policy.connect_timeout, policy.timeout)),
        **client,
    }
    if obstore_retries:
        retry = {
            "max_retries": policy.retries,
            "retry_timeout": timedelta(seconds=policy.retry_timeout),
            "backoff": {
                "init_backoff": timedelta(seconds=max(policy.backoff, 0.001)),
                "max_backoff": timedelta(seconds=max(policy.max_backoff, 0.001)),
                "base": 2,
            },
        }
    else:
        retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=max(policy.retry_timeout, 1.0))}
    secrets = secret_values(config, loc.url)
    if loc.kind == "http" and config:
        raise TypeError(f"unexpected options for an http(s) location: {sorted(config)}")
    error: Exception
    _before_first_store()
    try:
        return _new_store(store_mod, loc, dict(config), client_options, retry)
    except obstore.exceptions.UnknownConfigurationKeyError as exc:
        error = TypeError(f"unknown option for {loc.display!r}: {obstore_message(exc, secrets)}")
    except obstore.exceptions.BaseError as exc:
        error = ValueError(f"cannot configure {loc.display!r}: {obstore_message(exc, secrets)}")
    except Exception as exc:  # pyo3 conversion errors on bad option types
        error = TypeError(f"invalid options for {loc.display!r}: {scrub(str(exc), secrets)}")
    raise error  # outside the handlers: obstore's own error (and what it quotes) is not chained


def _new_store(
    store_mod: Any, loc: Location, config: dict[str, Any], client_options: dict[str, Any], retry: Any
) -> Any:
    if loc.kind == "http":
        base = loc.url.split("#", 1)[0].split("?", 1)[0]
        if base.lower().startswith("http://"):
            client_options.setdefault("allow_http", True)  # the URL asks for plain HTTP
        return store_mod.HTTPStore(base, client_options=client_options, retry_config=retry)
    # s3://, gs:// and az:// name a bucket (container) and a prefix; other Azure URLs
    # (https://<account>.blob.core.windows.net/...) are parsed by obstore itself.
    bucket_store: Any = {"s3": store_mod.S3Store, "gcs": store_mod.GCSStore}.get(loc.kind)
    if bucket_store is None and loc.url.lower().startswith(("az://", "azure://")):
        bucket_store = store_mod.AzureStore
    if bucket_store is not None:
        return bucket_store(
            loc.bucket,
            prefix=loc.prefix or None,
            config=config,
            client_options=client_options,
            retry_config=retry,
        )
    return store_mod.AzureStore.from_url(
        loc.url.split("?", 1)[0], config=config, client_options=client_options, retry_config=retry
    )


# -- versions and checked reads --------------------------------------------------------------------
class ShortReadError(StorageError):
    """A range read returned fewer bytes than asked for (retried; never a short sample)."""


class ClientFaultError(StorageError):
    """obstore's client failed on the server's answer (a Rust panic, e.g. on a body shorter than
    its headers said): a failed request, retried as other transient failures are."""


class ObjectChangedError(StorageError):
    """An object is not the one the dataset was opened with (never retried, never read)."""


class ContentMismatchError(ObjectChangedError):
    """An object's bytes do not match what the manifest records for them (its checksum or its
    block digests), whenever it was changed: never retried, never delivered."""


def _is_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a Rust panic surfaced by pyo3 (``pyo3_runtime.PanicException``, a
    BaseException, so that ``except Exception`` does not see it)."""
    return type(exc).__name__ == "PanicException" and not isinstance(exc, Exception)


def _client_fault(exc: BaseException) -> ClientFaultError:
    text = " ".join(str(exc).split())[:300]
    return ClientFaultError(f"the object store client failed on the server's answer ({text})")


def _weak(etag: str) -> str:
    return etag[2:] if etag.startswith("W/") else etag


@dataclass(frozen=True, slots=True)
class ObjectVersion:
    """The object a dataset was opened with: its size, its ETag and modification time (from the
    listing or a HEAD at open), and its sha256 from the manifest."""

    size: int
    etag: str | None = None
    last_modified: datetime | None = None
    sha256: str | None = None

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> ObjectVersion:
        """From obstore's ``ObjectMeta`` (a listing's entry or a HEAD)."""
        etag = meta.get("e_tag")
        modified = meta.get("last_modified")
        return cls(
            int(meta["size"]),
            str(etag) if etag else None,
            modified if isinstance(modified, datetime) else None,
        )

    def conditions(self) -> dict[str, Any]:
        """GET options that make the store refuse (412) a read of any other object: ``if_match``
        with a strong ETag; else ``if_unmodified_since`` (a weak ETag never matches a range)."""
        if self.etag and not self.etag.startswith("W/"):
            return {"if_match": self.etag}
        if self.last_modified is not None:
            return {"if_unmodified_since": self.last_modified}
        return {}

    def check(self, meta: Mapping[str, Any]) -> None:
        """Refuse an answer whose object is another one (a server may ignore the condition)."""
        size = meta.get("size")
        if size is not None and int(size) != self.size:
            raise ObjectChangedError(f"it has {plural(int(size), 'byte')} now, the manifest says {self.size}")
        etag = meta.get("e_tag")
        if self.etag and etag and _weak(str(etag)) != _weak(self.etag):
            raise ObjectChangedError(f"its ETag is {etag} now, {self.etag} when the dataset was opened")


def get_checked(store: Any, path: str, start: int, end: int, version: ObjectVersion | None) -> Any:
    """Bytes ``[start, end)`` of object ``path``, a blocking call: conditional on ``version``
    (when known), the answer's object, length and (for a whole object) checksum checked.

    Raises :class:`ObjectChangedError` for another object, :class:`ShortReadError` for fewer
    bytes than asked for, :class:`ClientFaultError` where obstore panics, obstore's errors else.
    """
    import obstore

    options: Any = {"range": (start, end)}  # obstore's GetOptions
    if version is not None:
        options.update(version.conditions())
    error: Exception
    try:
        result = obstore.get(store, path, options=options)
        if version is not None:
            version.check(result.meta)
        data = result.bytes()
    except BaseException as exc:
        if not _is_panic(exc):
            raise
        error = _client_fault(exc)
    else:
        got = memoryview(data).nbytes
        if got != end - start:
            raise ShortReadError(
                f"the server returned {got} of the {end - start} bytes asked for (short read)"
            )
        whole = version is not None and version.sha256 and start == 0 and end == version.size
        if whole and hashlib.sha256(data).hexdigest() != version.sha256:  # type: ignore[union-attr]
            raise ContentMismatchError("it does not match its checksum in the manifest")
        return data
    raise error  # outside the handler: the panic is not this error's __context__


# -- retries ---------------------------------------------------------------------------------------


_STATUS: Final = re.compile(r"status(?: code)?:? (\d{3})")


def retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, timeouts, connection errors and short reads: yes. 404, 403, other 4xx: no."""
    import obstore.exceptions as oe

    if isinstance(exc, ShortReadError | ClientFaultError):
        return True
    if isinstance(exc, ObjectChangedError):
        return False
    if isinstance(exc, FileNotFoundError | PermissionError | NotImplementedError | ValueError | TypeError):
        return False
    if isinstance(
        exc,
        oe.NotFoundError
        | oe.PermissionDeniedError
        | oe.UnauthenticatedError
        | oe.InvalidPathError
        | oe.NotSupportedError
        | oe.UnknownConfigurationKeyError
        | oe.PreconditionError
        | oe.NotModifiedError
        | oe.AlreadyExistsError,
    ):
        return False
    if isinstance(exc, oe.BaseError | OSError | TimeoutError):
        m = _STATUS.search(str(exc).split("\n\nDebug source:", 1)[0])
        if m is not None:
            status = int(m.group(1))
            return status >= 500 or status in (408, 429)
        return True
    return False


def call_with_retries(fn: Callable[[], T], policy: RetryPolicy) -> T:
    """Run blocking ``fn`` (an obstore call) with bounded retries; the last error propagates."""
    t0 = time.monotonic()
    attempt = 0
    while True:
        try:
            try:
                return fn()
            except BaseException as panic:
                if not _is_panic(panic):
                    raise
                fault = _client_fault(panic)
            raise fault  # outside the handler: the panic is not its __context__
        except Exception as exc:
            attempt += 1
            if not retryable(exc) or attempt > policy.retries:
                raise
            delay = policy.delay(attempt)
            if time.monotonic() - t0 + delay > policy.retry_timeout:
                raise
            time.sleep(delay)


# -- the I/O pool ----------------------------------------------------------------------------------
_IO_THREADS: Final = 128
_RANGE_THREADS: Final = 512


def io_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The shared pool that runs blocking obstore calls (threads start on demand).

    Its threads are joined before the interpreter finalises (``concurrent.futures`` registers
    that), so no thread is inside obstore when Python shuts down.
    """
    return pool("io", _IO_THREADS)


def range_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The pool on which a batched read's ranges after its first are fetched, concurrently, each
    a blocking conditional GET (threads start on demand; joined as the I/O pool's are). Apart
    from :func:`io_executor`, whose threads wait on it: its own tasks never wait on anything,
    so neither pool can starve the other. Its size bounds the ranges in flight at once, beside
    one per I/O thread."""
    return pool("range", _RANGE_THREADS)


# -- bounded in-flight requests and bytes ----------------------------------------------------------
class InflightLimit:
    """A FIFO-fair limit on requests and bytes in flight, for one event loop.

    A single acquisition larger than the byte budget is admitted when nothing else is in flight,
    so an oversized request waits its turn instead of deadlocking.
    """

    def __init__(self, max_requests: int, max_bytes: int, peak: list[int] | None = None) -> None:
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests = 0
        self.nbytes = 0
        self.peak_bytes = 0
        #: Where the peak is also kept, beyond this loop's life (:class:`PerLoop`).
        self._peak = [0] if peak is None else peak
        self._waiters: deque[tuple[int, int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int, b: int) -> bool:
        if self.requests == 0:
            return True
        return self.requests + n <= self.max_requests and self.nbytes + b <= self.max_bytes

    def _take(self, n: int, b: int) -> None:
        self.requests += n
        self.nbytes += b
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        self._peak[0] = max(self._peak[0], self.nbytes)

    async def acquire(self, n: int, b: int) -> None:
        if not self._waiters and self._fits(n, b):
            self._take(n, b)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, b, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n, b)  # granted, then cancelled before we could use it
            else:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
                self._wake()
            raise

    def release(self, n: int, b: int) -> None:
        self.requests -= n
        self.nbytes -= b
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, b, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(n, b):
                return
            self._waiters.popleft()
            self._take(n, b)
            fut.set_result(None)


class PerLoop:
    """One :class:`InflightLimit` per event loop (a storage may be read from several loops)."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self._args = (max_requests, max_bytes)
        self._peak = [0]  # the peak over every loop, those closed since included
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, InflightLimit] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> tuple[int, int]:
        return self._args  # the limits of each loop stay with that loop's process

    def __setstate__(self, args: tuple[int, int]) -> None:
        self.__init__(*args)  # type: ignore[misc]

    def get(self) -> InflightLimit:
        loop = asyncio.get_running_loop()
        limit = self._limits.get(loop)
        if limit is None:
            limit = self._limits[loop] = InflightLimit(*self._args, peak=self._peak)
        return limit

    def peak_bytes(self) -> int:
        return self._peak[0]


def remote_read_error(
    what: str, exc: BaseException, attempts: int, elapsed: float, secrets: Sequence[str]
) -> RemoteReadError:
    tried = f"after {attempts} attempt{'s' if attempts != 1 else ''} in {elapsed:.1f}s"
    return RemoteReadError(f"reading {what} failed {tried}: {obstore_message(exc, secrets)}")
