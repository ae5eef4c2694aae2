"""Object-store datasets (s3://, gs://, az://, http(s)://).

Not available in this version: these entry points say so clearly instead of failing later.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["open_documents", "open_stream", "sink_for", "verify_dataset"]


def _unsupported(url: str) -> NoReturn:
    raise NotImplementedError(
        f"object-store locations such as {url!r} are not supported by this version of guideloom; "
        "copy the dataset to a local folder and open that"
    )


def sink_for(url: str, **options: Any) -> NoReturn:
    _unsupported(url)


def open_stream(url: str, **options: Any) -> NoReturn:
    _unsupported(url)


def open_documents(url: str, **options: Any) -> NoReturn:
    _unsupported(url)


def verify_dataset(url: str, **options: Any) -> NoReturn:
    _unsupported(url)
