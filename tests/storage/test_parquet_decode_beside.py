"""A read over several row groups of local files decodes those it needs on the other cores beside
it (``ParquetStorage._decode_beside`` in ``guideloom/storage/_parquet/_storage.py``): each row
group once, a failure raised by the read itself, no thread left after the read."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import guideloom as gl
from guideloom._errors import DatasetFormatError
from guideloom.storage._parquet import _rowgroups, _storage

GROUPS, ROWS_PER_GROUP = 6, 40
BESIDE = "guideloom-parquet-decode"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("beside")
    n = GROUPS * ROWS_PER_GROUP
    ids = [[i] * (1 + i % 5) for i in range(n)]
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))})
    pq.write_table(table, out / "a.parquet", row_group_size=ROWS_PER_GROUP)
    return out


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three cores, whatever the machine's: two threads decode beside a read."""
    monkeypatch.setattr(_storage, "process_cores", lambda: 3)


@pytest.fixture
def decoded_by(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, str]]]:
    """Each row group decoded, with the thread that decoded it; each decode takes 20 ms (the
    threads beside a read take row groups while it decodes its first)."""
    seen: list[tuple[int, str]] = []
    real = _rowgroups._RowGroups._decode_new

    def slow(self: Any, group: int) -> Any:
        seen.append((group, threading.current_thread().name))
        time.sleep(0.02)
        return real(self, group)

    monkeypatch.setattr(_rowgroups._RowGroups, "_decode_new", slow)
    yield seen


def every_row(storage: Any) -> list[list[int]]:
    """Every row, in an order that touches every row group (the rows of a global shuffle)."""
    n = GROUPS * ROWS_PER_GROUP
    order = np.arange(n).reshape(GROUPS, ROWS_PER_GROUP).T.reshape(-1)  # row 0 of each group, ...
    rows = storage.read_many_sync(order)
    out: list[list[int]] = [[] for _ in range(n)]
    for i, row in zip(order.tolist(), rows, strict=True):
        out[i] = row.tolist()
    return out


def beside_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == BESIDE]


def test_a_read_over_every_row_group_decodes_them_beside_it_each_once(
    folder: Path, cores: None, decoded_by: list[tuple[int, str]]
) -> None:
    storage = gl.open_parquet(folder, "input_ids")
    assert every_row(storage) == [[i] * (1 + i % 5) for i in range(GROUPS * ROWS_PER_GROUP)]
    groups = sorted(g for g, _ in decoded_by)
    assert groups == list(range(GROUPS))  # each once
    names = dict(decoded_by)
    assert names[0] == threading.current_thread().name  # the read decodes its first row group
    assert names[GROUPS - 1] == BESIDE  # the threads beside it start from the last
    assert storage.figures()["parquet_row_group_decodes"] == GROUPS
    assert not beside_threads()  # joined before the read returned


def test_a_row_group_that_failed_beside_the_read_is_decoded_again_by_the_read(
    folder: Path, cores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _rowgroups._RowGroups._decode_new
    calls: list[tuple[int, str]] = []

    def fails_beside(self: Any, group: int) -> Any:
        calls.append((group, threading.current_thread().name))
        time.sleep(0.02)
        if threading.current_thread().name == BESIDE:
            raise DatasetFormatError("a decode beside the read failed")
        return real(self, group)

    monkeypatch.setattr(_rowgroups._RowGroups, "_decode_new", fails_beside)
    storage = gl.open_parquet(folder, "input_ids")
    assert every_row(storage) == [[i] * (1 + i % 5) for i in range(GROUPS * ROWS_PER_GROUP)]
    failed = {g for g, name in calls if name == BESIDE}
    assert failed  # the threads beside it tried, and the read decoded those row groups itself
    assert {g for g, name in calls if name != BESIDE} == set(range(GROUPS))
    assert not beside_threads()


def test_a_row_group_that_cannot_be_decoded_fails_the_read_with_its_own_error(
    folder: Path, cores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _rowgroups._RowGroups._decode_new
    damaged = GROUPS - 2

    def damaged_group(self: Any, group: int) -> Any:
        time.sleep(0.02)
        if group == damaged:
            raise DatasetFormatError(f"row group {group} is damaged")
        return real(self, group)

    monkeypatch.setattr(_rowgroups._RowGroups, "_decode_new", damaged_group)
    storage = gl.open_parquet(folder, "input_ids")
    with pytest.raises(DatasetFormatError, match=f"row group {damaged} is damaged"):
        every_row(storage)
    assert not beside_threads()


@pytest.mark.parametrize(
    ("max_decoded_bytes", "cores_here", "beside"),
    [(1 << 30, 3, True), (2048, 3, False), (1 << 30, 1, False)],
    ids=["fits", "over-the-cache", "one-core"],
)
def test_row_groups_are_decoded_beside_a_read_only_where_they_fit_and_a_core_is_free(
    folder: Path,
    decoded_by: list[tuple[int, str]],
    monkeypatch: pytest.MonkeyPatch,
    max_decoded_bytes: int,
    cores_here: int,
    beside: bool,
) -> None:
    monkeypatch.setattr(_storage, "process_cores", lambda: cores_here)
    storage = gl.open_parquet(folder, "input_ids", max_decoded_bytes=max_decoded_bytes)
    rows = every_row(storage)
    assert rows == [[i] * (1 + i % 5) for i in range(GROUPS * ROWS_PER_GROUP)]
    assert any(name == BESIDE for _, name in decoded_by) is beside


def test_arrows_free_pages_are_given_back_once_the_decodes_beside_a_read_are_done(
    folder: Path, cores: None, decoded_by: list[tuple[int, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_rowgroups, "RELEASE_EVERY_BYTES", 1)  # due after every decode
    released: list[int] = []
    real_pa: Callable[[], Any] = _rowgroups._pa

    class Pool:
        def release_unused(self) -> None:
            released.append(len(beside_threads()))

    class Arrow:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_pa(), name)

        def default_memory_pool(self) -> Pool:
            return Pool()

    monkeypatch.setattr(_rowgroups, "_pa", Arrow)
    monkeypatch.setattr(_storage, "_pa", Arrow)
    storage = gl.open_parquet(folder, "input_ids")
    every_row(storage)
    assert released == [0]  # once, after the threads beside the read were joined
