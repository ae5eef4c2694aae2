"""Object-store locations: a URL parsed into its backend, bucket and prefix, and shown without
the credentials or query string it may hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Location", "display_url", "parse_location"]


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
