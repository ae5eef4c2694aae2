"""open_parquet's options (``guideloom/storage/_parquet/_options.py``): one set of keys, one
place for their defaults."""

from __future__ import annotations

import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import guideloom as gl
from guideloom.storage._parquet import ParquetOptions, ParquetSettings
from guideloom.storage._parquet._options import reader_keys
from guideloom.types import StoreOptions


def test_the_options_type_names_every_setting_and_the_store_keys() -> None:
    keys = set(typing.get_type_hints(ParquetOptions))
    assert keys - set(typing.get_type_hints(StoreOptions)) == reader_keys()


def test_open_parquet_reads_with_the_settings_defaults(tmp_path: Path) -> None:
    pq.write_table(pa.table({"ids": [[1, 2], [3]]}), tmp_path / "a.parquet")
    storage = gl.open_parquet(tmp_path, "ids")
    defaults = ParquetSettings()
    assert (storage.max_decoded_bytes, storage.fetch_ahead, storage.on_null) == (
        defaults.max_decoded_bytes,
        defaults.fetch_ahead,
        defaults.on_null,
    )
    assert ParquetSettings.of({"fetch_ahead": 2, "region": "x"}) == ParquetSettings(
        fetch_ahead=2, store={"region": "x"}
    )


def test_a_store_option_for_local_files_is_refused_by_name(tmp_path: Path) -> None:
    pq.write_table(pa.table({"ids": [[1, 2]]}), tmp_path / "a.parquet")
    with pytest.raises(TypeError, match="region"):
        gl.open_parquet(tmp_path, "ids", region="x")
