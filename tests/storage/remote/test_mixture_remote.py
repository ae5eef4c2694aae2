"""A mixture of object-store sources (moto S3 and nginx on 127.0.0.1) reads what the same
mixture of the local copies reads, sync and async, and their checkpoints are interchangeable."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import guideloom as gl
from guideloom_dev.servers import MotoS3, Nginx
from tests.support.loader import roundtrip, take
from tests.support.remote import Copies

CPU = torch.device("cpu")


def digests(samples: Sequence[tuple[str, Any]]) -> list[tuple[str, str]]:
    out = []
    for name, s in samples:
        arrays = [s[k] for k in sorted(s)] if isinstance(s, dict) else [s]
        h = hashlib.blake2b(digest_size=8)
        for a in arrays:
            h.update(np.ascontiguousarray(a).tobytes())
        out.append((name, h.hexdigest()))
    return out


def mixture(plain: Any, stream: Any) -> gl.Mixture:
    return gl.mix(
        {"plain": plain, "meta": stream},
        {"plain": 0.75, "meta": 0.25},
        sequence_length={"plain": 64, "meta": 32},
        num_samples=900,
        with_source=True,
    )


def loader(m: gl.Mixture, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    return gl.StatefulDataLoader(
        m, digests, local_batch_size=8, shuffle=True, shuffle_seed=3, device=CPU, **kw
    )


def test_a_remote_mixture_reads_what_the_local_one_does(
    plain_copies: Copies, stream_copies: Copies, s3: MotoS3, nginx: Nginx
) -> None:
    local = mixture(gl.open_stream(plain_copies.local), gl.open_stream(stream_copies.local))
    remote = mixture(
        gl.open_stream(plain_copies.s3_url, **s3.options()),
        gl.open_stream(f"{nginx.url}/{stream_copies.http_path}"),
    )
    with loader(local) as ld:
        expected = take(ld)
    with loader(remote, prefetch=3, num_workers=2) as ld:
        assert take(ld) == expected
    assert not remote._reads_inline  # the remote sources were read through their async reads

    async def run_async() -> list[Any]:
        async with loader(remote, prefetch=2) as ld:
            return [b async for b in ld]

    assert asyncio.run(run_async()) == expected
    with loader(local) as ld:  # a checkpoint of the local mixture resumes the remote one
        head = take(ld, 7)
        head_state = roundtrip(ld.state_dict())
    with loader(remote) as ld:
        ld.load_state_dict(head_state)
        assert head + take(ld) == expected


def test_breaking_out_of_a_mixture_with_an_s3_source_leaves_no_coroutine_unawaited(
    plain_copies: Copies, stream_copies: Copies, s3: MotoS3
) -> None:
    """The loader's close cancels the reads in flight, some before their calls started: each
    call's coroutine is closed then, not dropped with a "never awaited" warning."""
    m = mixture(gl.open_stream(plain_copies.s3_url, **s3.options()), gl.open_stream(stream_copies.local))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for stop in (1, 2, 3, 5, 8, 13):
            with loader(m, prefetch=4) as ld:
                for i, _ in enumerate(ld):
                    if i == stop:
                        break
            gc.collect()  # a coroutine dropped unawaited warns when it is collected
    assert [str(w.message) for w in caught] == []
