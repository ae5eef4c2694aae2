"""The options of an object-store dataset and their secrets: read and write tuning, the retry
policy, store config and client options split and checked; the strings that are secret (credential
options and environment variables, a URL's password and query) kept out of every message, and
obstore's errors turned into the Python errors users expect, scrubbed.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

from guideloom._errors import StorageError

__all__ = [
    "ReadSettings",
    "RetryPolicy",
    "WriteSettings",
    "map_error",
    "obstore_message",
    "scrub",
    "secret_values",
    "split_options",
]

_MiB: Final = 2**20


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
class ReadSettings:
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
class WriteSettings:
    """Upload tuning of an object-store write (``write_stream(url, **options)``; the public
    option set is :class:`guideloom.types.WriteOptions`)."""

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
) -> tuple[ReadSettings, WriteSettings, dict[str, Any], dict[str, Any]]:
    """Split ``options`` into read tuning, write tuning, store config and client options."""
    opts = dict(options)
    wrong: tuple[str, ...] = _READ_KEYS if write else _WRITE_KEYS
    bad = [k for k in wrong if k in opts]
    if bad:
        raise TypeError(f"options {bad} only apply to {'reading' if write else 'writing'} a dataset")
    policy = _policy(opts)
    limits = _cache_limits(opts)  # before cache_dir is taken from opts
    d = ReadSettings()
    read = ReadSettings(
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
    w = WriteSettings()
    part_size = _count("part_size", opts.pop("part_size", w.part_size), 5 * _MiB)
    writeopts = WriteSettings(
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
