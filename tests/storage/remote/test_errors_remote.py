"""What object-store errors carry: no credential anywhere in their chain, and a clear missing extra."""

from __future__ import annotations

import asyncio
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import guideloom
from guideloom_dev.servers import SECRET_KEY, FaultProxy, MotoS3, free_port
from tests.support.remote import BUCKET, Copies, start_proxy

URL_SECRET = "url-secret-9d41c7e2"
ENV_SECRET = "env-secret-3a8f61b0"
FAST = {"timeout": 1.0, "connect_timeout": 0.5, "backoff": 0.01, "max_backoff": 0.02}


def chain_texts(exc: BaseException) -> list[str]:
    """``str``, ``repr`` and every ``args`` item of each link of ``exc``'s chain (causes, contexts,
    exception-group members), and the traceback text Python prints for it."""
    texts = ["".join(traceback.format_exception(exc))]
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        texts += [str(e), repr(e), *(repr(a) for a in e.args), *getattr(e, "__notes__", [])]
        todo += [e.__cause__, e.__context__]
        if isinstance(e, BaseExceptionGroup):
            todo += list(e.exceptions)
    assert len(seen) >= 1
    return texts


def assert_no_secret(exc: BaseException, *secrets: str) -> None:
    for text in chain_texts(exc):
        for secret in secrets:
            assert secret not in text, f"{secret!r} appears in the error chain: {text[:2000]}"


def raised(fn: Callable[[], object]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_the_chain_walker_sees_contexts_causes_and_groups() -> None:
    """The helper itself: a secret hidden in any link is found."""

    def hidden(where: str) -> BaseException:
        inner = ValueError(f"token={URL_SECRET}")
        if where == "context":
            try:
                raise inner
            except ValueError:
                try:
                    raise OSError("outer") from None  # from None still keeps __context__
                except OSError as e:
                    return e
        if where == "cause":
            err = OSError("outer")
            err.__cause__ = inner
            return err
        return ExceptionGroup("group", [OSError("outer"), inner])

    for where in ("context", "cause", "group"):
        with pytest.raises(AssertionError, match="appears in the error chain"):
            assert_no_secret(hidden(where), URL_SECRET)


def test_open_stream_with_credentials_in_the_url_keeps_them_out_of_the_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", ENV_SECRET)
    dead = free_port()  # nothing listens there
    for url in (
        f"http://reader:{URL_SECRET}@127.0.0.1:{dead}/corpus",
        f"http://127.0.0.1:{dead}/corpus?sig={URL_SECRET}",
    ):
        exc = raised(lambda url=url: guideloom.open_stream(url, retries=0, **FAST))
        assert isinstance(exc, OSError)
        assert f"127.0.0.1:{dead}/corpus" in str(exc)
        assert_no_secret(exc, URL_SECRET, ENV_SECRET)
    exc = raised(lambda: guideloom.open_documents(f"http://reader:{URL_SECRET}@[::1/x"))
    assert isinstance(exc, ValueError)
    assert_no_secret(exc, URL_SECRET)


def test_a_server_that_refuses_url_credentials_does_not_leak_them(plain_copies: Copies, s3: MotoS3) -> None:
    """moto answers 403 to basic auth, and obstore's own message quotes the URL with them."""
    url = f"http://reader:{URL_SECRET}@127.0.0.1:{s3.port}/{BUCKET}/copies/plain"
    for call in (guideloom.open_stream, guideloom.verify_dataset):
        exc = raised(lambda call=call: call(url, retries=0, **FAST))
        assert isinstance(exc, PermissionError), repr(exc)
        assert f"http://127.0.0.1:{s3.port}/{BUCKET}/copies/plain" in str(exc)
        assert_no_secret(exc, URL_SECRET)


def test_open_stream_against_a_bad_endpoint_keeps_the_secret_key_out_of_the_chain(s3: MotoS3) -> None:
    options = {**s3.options(), "endpoint": f"http://127.0.0.1:{free_port()}", "retries": 0, **FAST}
    exc = raised(lambda: guideloom.open_stream(f"s3://{BUCKET}/x", **options))
    assert isinstance(exc, OSError)
    assert_no_secret(exc, SECRET_KEY)
    bad_type = raised(lambda: guideloom.open_stream(f"s3://{BUCKET}/x", **{**options, "region": 5}))
    assert isinstance(bad_type, TypeError | ValueError)
    assert_no_secret(bad_type, SECRET_KEY)


def test_a_failing_read_keeps_every_credential_out_of_the_chain(
    plain_copies: Copies, s3: MotoS3, proxy_for: list[FaultProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", ENV_SECRET)
    proxy = start_proxy(proxy_for, s3.port)
    storage = guideloom.open_stream(plain_copies.s3_url, retries=1, **FAST, **s3.options(proxy.url))

    async def read(kinds: tuple[str, ...]) -> None:
        async with storage:  # opened (the manifest is read again) before the faults start
            proxy.fail_every, proxy.fault_kinds = 1, kinds
            try:
                await storage.read_many(np.asarray([0, 9000, 20_000], dtype=np.int64), 64)
            finally:
                proxy.fail_every = 0

    for kinds in (("503",), ("reset",), ("truncate",)):
        exc = raised(lambda kinds=kinds: asyncio.run(read(kinds)))
        assert isinstance(exc, guideloom.RemoteReadError), repr(exc)
        assert_no_secret(exc, SECRET_KEY, ENV_SECRET)

    # ... and at the failing batch of a loader
    loader = guideloom.StatefulDataLoader.from_storage(
        storage, np.asarray, sequence_length=64, local_batch_size=4, device=torch.device("cpu")
    )
    loader.open()
    proxy.fail_every, proxy.fault_kinds = 1, ("503",)
    exc = raised(lambda: list(loader))
    loader.close()
    assert isinstance(exc, guideloom.RemoteReadError)
    assert_no_secret(exc, SECRET_KEY, ENV_SECRET)


def test_a_failed_read_of_an_object_gone_after_open_names_it_without_credentials(
    plain_copies: Copies, s3: MotoS3
) -> None:
    prefix = f"gone-{free_port()}"
    s3.upload_folder(plain_copies.local, BUCKET, prefix)
    storage = guideloom.open_stream(f"s3://{BUCKET}/{prefix}", retries=0, **FAST, **s3.options())
    c = s3.client()
    for o in c.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/tokens")["Contents"]:
        c.delete_object(Bucket=BUCKET, Key=o["Key"])

    async def read() -> None:
        async with storage:
            await storage.read_many(np.asarray([0], dtype=np.int64), 10)

    exc = raised(lambda: asyncio.run(read()))
    assert isinstance(exc, guideloom.DatasetIntegrityError) and "missing" in str(exc)
    assert_no_secret(exc, SECRET_KEY)


def test_write_stream_to_a_bad_endpoint_keeps_the_secret_key_out_of_the_chain(s3: MotoS3) -> None:
    options = {**s3.options(), "endpoint": f"http://127.0.0.1:{free_port()}", "retries": 0, **FAST}
    exc = raised(
        lambda: guideloom.write_stream(f"s3://{BUCKET}/w", np.arange(10, dtype=np.uint16), **options)
    )
    assert isinstance(exc, OSError)
    assert_no_secret(exc, SECRET_KEY)


def test_verify_dataset_failures_keep_the_secret_key_out_of_the_chain(
    plain_copies: Copies, s3: MotoS3, proxy_for: list[FaultProxy]
) -> None:
    dead = {**s3.options(), "endpoint": f"http://127.0.0.1:{free_port()}", "retries": 0, **FAST}
    exc = raised(lambda: guideloom.verify_dataset(plain_copies.s3_url, **dead))
    assert isinstance(exc, OSError)
    assert_no_secret(exc, SECRET_KEY)
    # The manifest and the listing get through; the first data object's download fails.
    proxy = start_proxy(proxy_for, s3.port)
    proxy.fail_every, proxy.fault_kinds = 3, ("503",)
    exc = raised(
        lambda: guideloom.verify_dataset(plain_copies.s3_url, retries=0, **FAST, **s3.options(proxy.url))
    )
    assert isinstance(exc, OSError) and "tokens-" in str(exc), repr(exc)
    assert_no_secret(exc, SECRET_KEY)


# -- a missing extra -------------------------------------------------------------------------------
def hide_obstore(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import obstore`` (and its submodules) fail as if the package were not installed."""
    for name in [n for n in sys.modules if n == "obstore" or n.startswith("obstore.")] + ["obstore"]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize(
    "call",
    [
        lambda: guideloom.open_stream("s3://bucket/corpus"),
        lambda: guideloom.open_documents("https://example.org/corpus"),
        lambda: guideloom.verify_dataset("gs://bucket/corpus"),
        lambda: guideloom.write_stream("s3://bucket/corpus", np.arange(3, dtype=np.uint16)),
        lambda: guideloom.write_documents("az://container/corpus", [np.arange(3)]),
    ],
    ids=["open_stream", "open_documents", "verify_dataset", "write_stream", "write_documents"],
)
def test_without_obstore_the_error_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, call: Callable[[], Any]
) -> None:
    hide_obstore(monkeypatch)
    with pytest.raises(ModuleNotFoundError) as info:
        call()
    assert 'pip install "guideloom[remote]"' in str(info.value)
    assert info.value.name == "obstore"
    assert info.value.__context__ is None and info.value.__cause__ is None, "one error, not a chain"


def test_without_obstore_local_datasets_still_work(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    hide_obstore(monkeypatch)
    guideloom.write_stream(tmp_path / "d", np.arange(10, dtype=np.uint16))
    assert len(guideloom.open_stream(tmp_path / "d")) == 10
