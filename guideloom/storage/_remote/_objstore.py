"""Object stores on obstore: making a store, checked range reads, retries, the I/O pools.

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

import concurrent.futures
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, TypeVar

from guideloom._core.text import plural
from guideloom._errors import RemoteReadError, StorageError
from guideloom._process import pool
from guideloom.storage._remote._locations import Location
from guideloom.storage._remote._options import RetryPolicy, obstore_message, scrub, secret_values

__all__ = [
    "BEFORE_FIRST_STORE",
    "ClientFaultError",
    "ContentMismatchError",
    "ObjectChangedError",
    "ObjectVersion",
    "RANGES_PER_CALL",
    "ShortReadError",
    "call_with_retries",
    "get_checked",
    "io_executor",
    "make_store",
    "range_executor",
    "remote_read_error",
    "require_obstore",
    "retryable",
]

T = TypeVar("T")

#: Ranges per I/O-thread call (fetched concurrently, one GET each).
RANGES_PER_CALL: Final = 10


# -- stores ---------------------------------------------------------------------------------------
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


# -- retries --------------------------------------------------------------------------------------
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


def remote_read_error(
    what: str, exc: BaseException, attempts: int, elapsed: float, secrets: Sequence[str]
) -> RemoteReadError:
    tried = f"after {attempts} attempt{'s' if attempts != 1 else ''} in {elapsed:.1f}s"
    return RemoteReadError(f"reading {what} failed {tried}: {obstore_message(exc, secrets)}")


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
