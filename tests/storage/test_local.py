"""The local on-disk format: writers, manifest checks, memory-mapped reading."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom import DatasetFormatError, DatasetIntegrityError
from guideloom.storage._format._manifest import MANIFEST_NAME


async def read_all_stream(storage: gl.StreamStorageAbstract, length: int) -> list[np.ndarray]:  # type: ignore[type-arg]
    await storage.open()
    try:
        starts = np.arange(0, len(storage) - length + 1, length, dtype=np.int64)
        return list(await storage.read_many(starts, length))
    finally:
        await storage.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.int32, np.int64, np.float32, np.bool_])
async def test_stream_round_trip_dtypes(tmp_path: Path, dtype: type) -> None:
    data = (np.arange(1000) % 200).astype(dtype)
    manifest = gl.write_stream(tmp_path / "ds", data)
    assert manifest.dtype == np.dtype(dtype)
    s = gl.open_stream(tmp_path / "ds")
    assert len(s) == 1000 and s.dtype == np.dtype(dtype)
    rows = await read_all_stream(s, 10)
    assert np.array_equal(np.concatenate(rows), data)


@pytest.mark.asyncio
async def test_chunks_shards_and_windows_across_shard_boundaries(tmp_path: Path) -> None:
    chunks = [np.arange(i * 37, (i + 1) * 37, dtype=np.uint16) for i in range(30)]  # 1110 elements
    manifest = gl.write_stream(tmp_path / "ds", iter(chunks), shard_bytes=2 * 101)  # 101 elements/shard
    assert len(manifest.tokens.files) == 11
    s = gl.open_stream(str(tmp_path / "ds"))
    await s.open()
    starts = np.array([0, 95, 101, 200, 990, 1100, 7], dtype=np.int64)
    out = await s.read_many(starts, 10)
    assert [o.tolist() for o in out] == [list(range(a, a + 10)) for a in starts.tolist()]
    aligned = await s.read_many(np.arange(0, 1100, 10, dtype=np.int64)[::-1].copy(), 10)
    assert np.array_equal(np.concatenate(aligned[::-1]), np.arange(1100))
    await s.close()


@pytest.mark.asyncio
async def test_stream_metadata_round_trip(tmp_path: Path) -> None:
    tokens = np.arange(64, dtype=np.uint16)
    mask = tokens % 3 == 0
    doc_id = np.repeat(np.arange(8, dtype=np.uint32), 8)
    gl.write_stream(
        tmp_path / "m", [tokens[:30], tokens[30:]], metadata={"loss_mask": mask, "doc_id": iter([doc_id])}
    )
    s = gl.open_stream(tmp_path / "m")
    assert s.fields == ("loss_mask", "doc_id")
    await s.open()
    (a, b) = await s.read_many(np.array([8, 40], dtype=np.int64), 8)
    await s.close()
    assert a["tokens"].tolist() == list(range(8, 16)) and a["doc_id"].tolist() == [1] * 8
    assert a["loss_mask"].dtype == np.bool_ and b["loss_mask"].tolist() == mask[40:48].tolist()


def test_metadata_length_mismatch_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="as long as the stream"):
        gl.write_stream(tmp_path / "bad", np.arange(10), metadata={"m": np.arange(9)})
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()
    assert list((tmp_path / "bad").iterdir()) == []


def test_values_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot represent.*dtype=np.uint32"):
        gl.write_stream(tmp_path / "x", [np.array([1, 2]), np.array([70000])], dtype=np.uint16)
    with pytest.raises(ValueError, match="cannot represent"):
        gl.write_stream(tmp_path / "y", np.array([-1, 2]), dtype=np.uint8)
    with pytest.raises(ValueError, match="cannot represent"):
        gl.write_stream(tmp_path / "z", np.array([1.5]), dtype=np.int32)
    # values that fit are cast exactly
    gl.write_stream(tmp_path / "ok", np.array([1, 2, 65535], dtype=np.int64), dtype=np.uint16)
    assert gl.open_stream(tmp_path / "ok").dtype == np.uint16


def _read_back(dest: Path) -> list[Any]:
    s = gl.open_stream(dest)
    asyncio.run(s.open())
    values: list[Any] = s.read_many_sync(np.array([0], np.int64), len(s))[0].tolist()
    return values


@pytest.mark.parametrize(
    ("values", "given", "dtype"),
    [
        ([2**60 + 1], np.float64, np.int64),  # the float already holds 2**60: no integer array could
        ([2**53 + 1, 1], np.float64, np.int64),  # 2**53: the first float that stands for two integers
        ([-(2**53)], np.float64, np.int64),
        ([2**53], np.float64, np.uint64),
        ([2**24], np.float32, np.int32),
        ([2**11], np.float16, np.int16),
    ],
)
def test_floats_beyond_their_exact_integers_are_refused_for_integer_dtypes(
    tmp_path: Path, values: list[int], given: Any, dtype: Any
) -> None:
    chunk = np.array(values, dtype=given)
    with pytest.raises(ValueError, match=r"exact.*pass an integer array") as info:
        gl.write_stream(tmp_path / "x", [np.arange(3, dtype=dtype), chunk], dtype=dtype)
    assert "chunk 1" in str(info.value) and np.dtype(given).name in str(info.value)
    assert not (tmp_path / "x" / MANIFEST_NAME).exists()
    # an integer array is written exactly; so are whole floats below the limit
    gl.write_stream(tmp_path / "ints", np.array(values, dtype=np.int64).astype(dtype))
    assert _read_back(tmp_path / "ints") == values
    bits = np.finfo(given).nmant + 1
    below = [2**bits - 1, 0] if np.dtype(dtype).kind == "u" else [2**bits - 1, -(2**bits - 1)]
    gl.write_stream(tmp_path / "below", np.array(below, dtype=given), dtype=dtype)
    assert _read_back(tmp_path / "below") == below


@pytest.mark.parametrize(
    ("chunk", "dtype"),
    [
        (np.array([-1], np.int32), np.uint32),  # same width: the cast and its inverse wrap back
        (np.array([2**63], np.uint64), np.int64),
        (np.array([2**64 - 1], np.uint64), np.int64),
        (np.array([-1], np.int64), np.uint64),
        (np.array([2**53 + 1], np.int64), np.float64),  # numpy's "safe" cast rounds it
        (np.array([2**63 - 1], np.int64), np.float64),
        (np.array([2**64 - 1], np.uint64), np.float64),
        (np.array([70000], np.int64), np.float16),
        (np.array([np.nan, 1.0]), np.int64),
        (np.array([np.inf]), np.int32),
        (np.array([3e9]), np.int32),
        (np.array([2.0]), np.bool_),
        (np.array([1e300]), np.float32),
    ],
)
def test_every_value_must_survive_the_cast(tmp_path: Path, chunk: Any, dtype: Any) -> None:
    with pytest.raises(ValueError, match=r"cannot represent|pass an integer array"):
        gl.write_stream(tmp_path / "x", chunk, dtype=dtype)
    assert not (tmp_path / "x" / MANIFEST_NAME).exists()


@pytest.mark.parametrize(
    ("values", "given", "dtype"),
    [
        ([2**62, -(2**63)], np.int64, np.float64),  # powers of two are exact floats
        ([2**53, 7, -(2**53)], np.int64, np.float64),
        ([2**32 - 1, 0], np.uint32, np.int64),
        ([2**31 - 1, 0], np.uint32, np.int32),
        ([0.0, 1.0, 0.0], np.float64, np.bool_),
        ([0.5, -2.0, float("nan"), float("inf")], np.float64, np.float32),
        ([1.0, 0.0], np.bool_, np.float16),
    ],
)
def test_values_that_survive_the_cast_are_written(
    tmp_path: Path, values: list[Any], given: Any, dtype: Any
) -> None:
    gl.write_stream(tmp_path / "ok", np.array(values, dtype=given), dtype=dtype)
    back = np.array(_read_back(tmp_path / "ok"), dtype=np.dtype(dtype))
    assert np.array_equal(back, np.array(values, dtype=given).astype(dtype), equal_nan=True)
    assert np.array_equal(back.astype(given), np.array(values, dtype=given), equal_nan=True)


def test_bad_inputs_have_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="1-D"):
        gl.write_stream(tmp_path / "a", np.zeros((2, 3)))
    with pytest.raises(TypeError, match="cannot be stored"):
        gl.write_stream(tmp_path / "b", np.arange(3), dtype=np.complex64)
    with pytest.raises(TypeError, match="iterable of 1-D arrays"):
        gl.write_documents(tmp_path / "c", np.arange(3))
    with pytest.raises(ValueError, match="field name"):
        gl.write_stream(tmp_path / "d", np.arange(3), metadata={"../x": np.arange(3)})
    with pytest.raises(ValueError, match="shard_bytes"):
        gl.write_stream(tmp_path / "e", np.arange(3), shard_bytes=0)


def test_a_list_of_numbers_or_a_tensor_is_one_array(tmp_path: Path) -> None:
    """``chunks`` is an array or an iterable of 1-D arrays: a list of ints or a 1-D tensor is
    one array (it was taken for chunks of scalars); for documents, it is refused as one."""
    import torch

    gl.write_stream(tmp_path / "a", [5, 6, 7], metadata={"mask": [1, 0, 1]})
    gl.write_stream(tmp_path / "b", torch.arange(4, dtype=torch.int32))
    a, b = gl.open_stream(tmp_path / "a"), gl.open_stream(tmp_path / "b")
    assert (len(a), len(b), b.dtype) == (3, 4, np.dtype(np.int32))
    asyncio.run(a.open())
    assert a.read_many_sync(np.array([0], np.int64), 3)[0]["mask"].tolist() == [1, 0, 1]
    assert len(gl.write_documents(tmp_path / "c", [[1, 2, 3], [4]]).offsets.files) > 0
    for one in ([1, 2, 3], torch.arange(3)):
        with pytest.raises(TypeError, match="not one 1-D array"):
            gl.write_documents(tmp_path / "d", one)


def test_existing_dataset_needs_overwrite_and_failed_overwrite_keeps_old(tmp_path: Path) -> None:
    dest = tmp_path / "ds"
    gl.write_stream(dest, np.arange(10, dtype=np.uint16))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        gl.write_stream(dest, np.arange(5))
    with pytest.raises(ValueError):
        gl.write_stream(dest, [np.arange(3), np.array([-5])], dtype=np.uint16, overwrite=True)
    assert len(gl.open_stream(dest)) == 10  # the old dataset is intact
    gl.write_stream(dest, np.arange(7, dtype=np.uint16), overwrite=True)
    assert len(gl.open_stream(dest)) == 7
    data_files = sorted(p.name for p in dest.iterdir() if p.suffix == ".bin")
    assert len(data_files) == 1, data_files  # the replaced dataset's files are gone


def test_interrupted_write_is_not_a_dataset(tmp_path: Path) -> None:
    def chunks():
        yield np.arange(10, dtype=np.uint16)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gl.write_stream(tmp_path / "ds", chunks())
    with pytest.raises(FileNotFoundError, match=r"no manifest\.json"):
        gl.open_stream(tmp_path / "ds")
    gl.write_stream(tmp_path / "ds", np.arange(4, dtype=np.uint16))  # the rerun works
    assert len(gl.open_stream(tmp_path / "ds")) == 4


def test_missing_dataset_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        gl.open_stream(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        gl.open_documents(f"file://{tmp_path}/nope")


def test_kind_mismatch(tmp_path: Path) -> None:
    gl.write_stream(tmp_path / "s", np.arange(10))
    gl.write_documents(tmp_path / "d", [np.arange(3)])
    with pytest.raises(DatasetFormatError, match="open_stream"):
        gl.open_documents(tmp_path / "s")
    with pytest.raises(DatasetFormatError, match="open_documents"):
        gl.open_stream(tmp_path / "d")


def _edit_manifest(path: Path, edit) -> None:
    doc = json.loads((path / MANIFEST_NAME).read_text())
    edit(doc)
    (path / MANIFEST_NAME).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (
            lambda d: d["fields"]["tokens"]["files"][0].update(path="../evil.bin"),
            DatasetFormatError,
            "plain relative",
        ),
        (
            lambda d: d["fields"]["tokens"]["files"][0].update(path="/etc/passwd"),
            DatasetFormatError,
            "plain relative",
        ),
        (
            lambda d: d["fields"]["tokens"]["files"][0].update(path="a/../../x"),
            DatasetFormatError,
            "plain relative",
        ),
        (lambda d: d["fields"]["tokens"]["files"][0].update(bytes=3), DatasetFormatError, "need"),
        (
            lambda d: d["fields"]["tokens"]["files"][0].update(elements=11, bytes=88),
            DatasetFormatError,
            "num_elements",
        ),
        (lambda d: d.update(num_elements=5), DatasetFormatError, "num_elements"),
        (lambda d: d.update(format_version=99), DatasetFormatError, "format_version"),
        (lambda d: d.update(format="other"), DatasetFormatError, "not a guideloom"),
        (lambda d: d["fields"]["tokens"].update(dtype="object"), DatasetFormatError, "dtype"),
        (
            lambda d: d["fields"]["tokens"]["files"][0].update(path="missing.bin"),
            DatasetIntegrityError,
            "missing",
        ),
    ],
)
def test_manifest_mismatch_is_refused(tmp_path: Path, edit, error: type, match: str) -> None:
    gl.write_stream(tmp_path / "ds", np.arange(10, dtype=np.int64))
    _edit_manifest(tmp_path / "ds", edit)
    with pytest.raises(error, match=match):
        gl.open_stream(tmp_path / "ds")


def test_truncated_data_file_is_refused(tmp_path: Path) -> None:
    m = gl.write_stream(tmp_path / "ds", np.arange(100, dtype=np.uint16))
    f = tmp_path / "ds" / m.tokens.files[0].path
    with open(f, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(DatasetIntegrityError, match="has 100 bytes"):
        gl.open_stream(tmp_path / "ds")
    with open(f, "r+b") as fh:
        fh.truncate(1)
    with pytest.raises(DatasetIntegrityError, match="has 1 byte, the manifest says 200;"):
        gl.open_stream(tmp_path / "ds")


def test_invalid_json_manifest(tmp_path: Path) -> None:
    gl.write_stream(tmp_path / "ds", np.arange(10))
    (tmp_path / "ds" / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DatasetFormatError, match="not valid JSON"):
        gl.open_stream(tmp_path / "ds")


def test_verify_detects_corruption(tmp_path: Path) -> None:
    m = gl.write_stream(tmp_path / "ds", np.arange(1000, dtype=np.uint16))
    gl.verify_dataset(tmp_path / "ds")
    f = tmp_path / "ds" / m.tokens.files[0].path
    with open(f, "r+b") as fh:
        fh.seek(10)
        fh.write(b"\xff")
    with pytest.raises(DatasetIntegrityError, match="checksum"):
        gl.verify_dataset(tmp_path / "ds")


@pytest.mark.parametrize("kind", ["stream", "documents"])
def test_a_file_damaged_in_place_is_refused_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A byte changed, the size the same: a dataset up to VERIFY_ON_OPEN_BYTES is refused when
    opened (checksums), never read as garbage; a larger one opens (its sizes checked) and the
    read of the damaged block is refused (block digests)."""
    import guideloom.storage._local._check as local

    if kind == "stream":
        m = gl.write_stream(tmp_path / "ds", np.arange(1000, dtype=np.uint16), metadata={"m": np.ones(1000)})
        opener: Any = gl.open_stream
    else:
        m = gl.write_documents(tmp_path / "ds", [np.arange(n, dtype=np.uint16) for n in (5, 300, 9)])
        opener = gl.open_documents
    assert len(opener(tmp_path / "ds")) > 0  # intact: opens (and is hashed once per process)
    for _name, _spec, f in m.all_files():
        path = tmp_path / "ds" / f.path
        original = path.read_bytes()
        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0xFF
        path.write_bytes(bytes(damaged))
        with pytest.raises(DatasetIntegrityError, match=f"{f.path}.*does not match its checksum"):
            opener(tmp_path / "ds")
        monkeypatch.setattr(local, "VERIFY_ON_OPEN_BYTES", 0)
        storage = opener(tmp_path / "ds")  # over the limit: sizes only, blocks when read
        with pytest.raises(DatasetIntegrityError, match=f"{f.path}.*block 0 .*does not match its digest"):
            storage.open_sync()  # files this small are read whole, and checked, when opened
            storage.read_many_sync(np.arange(1, dtype=np.int64), *([1] if kind == "stream" else []))
        monkeypatch.undo()
        path.write_bytes(original)
    opener(tmp_path / "ds")


def test_manifest_is_plain_json_with_checksums(tmp_path: Path) -> None:
    gl.write_stream(tmp_path / "ds", np.arange(10, dtype=np.uint16), info={"tokenizer": "bytes"})
    doc = json.loads((tmp_path / "ds" / MANIFEST_NAME).read_text())
    assert doc["kind"] == "stream" and doc["dtype"] == "uint16" and doc["num_elements"] == 10
    (f,) = doc["fields"]["tokens"]["files"]
    assert f["bytes"] == 20 and len(f["sha256"]) == 64
    assert doc["info"] == {"tokenizer": "bytes"}
    raw = (tmp_path / "ds" / f["path"]).read_bytes()
    assert np.array_equal(np.frombuffer(raw, "<u2"), np.arange(10))


@pytest.mark.asyncio
async def test_documents_round_trip(tmp_path: Path) -> None:
    docs = [np.arange(n, dtype=np.uint16) + n for n in (5, 0, 1, 300, 17)]
    gl.write_documents(tmp_path / "d", (d for d in docs), shard_bytes=64)
    s = gl.open_documents(tmp_path / "d")
    assert len(s) == 5 and s.dtype == np.uint16
    await s.open()
    out = await s.read_many(np.array([3, 0, 1, 4, 2], dtype=np.int64))
    await s.close()
    assert [o.tolist() for o in out] == [docs[i].tolist() for i in (3, 0, 1, 4, 2)]


def test_copied_folder_reads_the_same(tmp_path: Path) -> None:
    import shutil

    gl.write_documents(tmp_path / "a", [np.arange(3), np.arange(4)])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert len(gl.open_documents(tmp_path / "b")) == 2


def test_reading_does_not_load_the_file(tmp_path: Path) -> None:
    """A 64 GiB sparse data file opens instantly: nothing is read until samples are asked for."""
    import asyncio
    import hashlib
    import resource

    n = 32 * 2**30
    folder = tmp_path / "big"
    folder.mkdir()
    with open(folder / "t.bin", "wb") as f:
        f.truncate(2 * n)
    man = {
        "format": "guideloom-dataset",
        "format_version": 1,
        "kind": "stream",
        "dtype": "uint16",
        "num_elements": n,
        "checksum": "sha256",
        "fields": {
            "tokens": {
                "dtype": "uint16",
                "files": [
                    {
                        "path": "t.bin",
                        "elements": n,
                        "bytes": 2 * n,
                        "sha256": hashlib.sha256(b"").hexdigest(),
                    }
                ],
            }
        },
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(man))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s = gl.open_stream(folder)

    async def go() -> list[np.ndarray]:
        await s.open()
        return list(await s.read_many(np.array([n - 4096, 12345 * 2048], dtype=np.int64), 2048))

    rows = asyncio.run(go())
    assert all(r.sum() == 0 for r in rows)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB
    os.unlink(folder / "t.bin")


@pytest.mark.asyncio
async def test_samples_are_writable_copies(tmp_path: Path) -> None:
    import warnings

    import torch

    gl.write_documents(tmp_path / "d", [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)])
    gl.write_stream(tmp_path / "s", np.arange(20, dtype=np.int32))
    docs = gl.open_documents(tmp_path / "d")
    stream = gl.open_stream(tmp_path / "s")
    await docs.open()
    await stream.open()
    samples = [
        *await docs.read_many(np.array([1, 0], dtype=np.int64)),
        *await stream.read_many(np.array([4]), 4),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in samples:
            assert s.flags.writeable
            torch.from_numpy(s)  # no "not writable" warning
    samples[0][0] = 99  # does not touch the dataset
    again = await docs.read_many(np.array([1], dtype=np.int64))
    assert again[0].tolist() == [0, 1, 2]
    await docs.close()
    await stream.close()


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


@pytest.mark.asyncio
async def test_mapped_pages_do_not_accumulate_in_rss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import guideloom.storage._local._sharded as local

    monkeypatch.setattr(local, "MAPPED_BUDGET", 8 * 2**20)
    gl.write_stream(tmp_path / "ds", np.zeros(48 * 2**20, dtype=np.uint8))  # 48 MiB
    s = gl.open_stream(tmp_path / "ds")
    await s.open()
    before = _rss_file_kib()
    peak = before
    for start in range(0, 48 * 2**20, 2**20):  # read every byte once, 1 MiB at a time
        await s.read_many(np.arange(start, start + 2**20, 4096, dtype=np.int64), 4096)
        peak = max(peak, _rss_file_kib())
    await s.close()
    assert peak - before < 16 * 1024, f"mapped file pages grew by {(peak - before) // 1024} MiB"


def _open_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Any, opener: Any) -> tuple[Any, Any]:
    """The same dataset opened twice: gathered from the maps, and (over a tiny budget) read with preadv."""
    import guideloom.storage._local._sharded as local

    write(tmp_path / "ds")
    mapped = opener(tmp_path / "ds")
    asyncio.run(mapped.open())
    monkeypatch.setattr(local, "MAPPED_BUDGET", 1024)
    preads = opener(tmp_path / "ds")
    asyncio.run(preads.open())
    return mapped, preads


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_preadv_reads_equal_mapped_reads_across_shard_boundaries(data: st.DataObject) -> None:
    import tempfile

    tokens = np.arange(5_000, dtype=np.uint16) * 7
    length = data.draw(st.integers(1, 300))
    starts = np.asarray(
        data.draw(st.lists(st.integers(0, len(tokens) - length), max_size=40)), dtype=np.int64
    )
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mapped, preads = _open_both(
            Path(tmp),
            mp,
            lambda p: gl.write_stream(p, tokens, shard_bytes=1_000),  # 500-element shards
            gl.open_stream,
        )
        assert preads._arrays["tokens"]._fds and not mapped._arrays["tokens"]._fds
        a = np.asarray(asyncio.run(mapped.read_many(starts, length)))
        b = np.asarray(asyncio.run(preads.read_many(starts, length)))
        assert a.shape == b.shape == (len(starts), length)
        assert np.array_equal(a, b)
        assert all(np.array_equal(b[i], tokens[s : s + length]) for i, s in enumerate(starts.tolist()))


def test_preadv_document_reads_equal_mapped_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, int(n), dtype=np.int32) for n in rng.integers(0, 400, 60)]
    mapped, preads = _open_both(
        tmp_path, monkeypatch, lambda p: gl.write_documents(p, docs, shard_bytes=4_000), gl.open_documents
    )
    idx = rng.permutation(len(docs)).astype(np.int64)
    a = asyncio.run(mapped.read_many(idx))
    b = asyncio.run(preads.read_many(idx))
    assert [x.tolist() for x in a] == [x.tolist() for x in b] == [docs[i].tolist() for i in idx.tolist()]


@pytest.mark.parametrize("preads", [False, True])
@pytest.mark.parametrize("shard_bytes", [12, 1 << 20])
def test_empty_documents_at_the_end_read_as_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_bytes: int, preads: bool
) -> None:
    """An empty last document (its span starts where the last shard ends) reads as empty, mapped
    and through ``preadv``, alone, among others and through the loader (it raised IndexError)."""
    import guideloom.storage._local._sharded as local

    if preads:
        monkeypatch.setattr(local, "MAPPED_BUDGET", 0)
    docs = [np.arange(5, dtype=np.uint16), np.zeros(0, np.uint16), np.arange(3, dtype=np.uint16)]
    docs += [np.zeros(0, np.uint16)] * 2
    gl.write_documents(tmp_path / "ds", docs, shard_bytes=shard_bytes)
    storage = gl.open_documents(tmp_path / "ds")
    asyncio.run(storage.open())
    assert storage._tokens is not None and bool(storage._tokens._fds) == preads
    want = [d.tolist() for d in docs]
    assert [x.tolist() for x in storage.read_many_sync(np.array([4], np.int64))] == [[]]
    assert [x.tolist() for x in storage.read_many_sync(np.arange(5, dtype=np.int64))] == want
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_documents(tmp_path / "ds"), lambda b: [x.tolist() for x in b], local_batch_size=5
    )
    with loader:
        assert list(loader) == [want]


def test_a_file_truncated_after_open_is_an_integrity_error_with_preadv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import guideloom.storage._local._sharded as local

    monkeypatch.setattr(local, "MAPPED_BUDGET", 1024)
    gl.write_stream(tmp_path / "ds", np.arange(4_000, dtype=np.uint16))
    s = gl.open_stream(tmp_path / "ds")
    asyncio.run(s.open())
    (shard,) = [p for p in (tmp_path / "ds").iterdir() if p.suffix == ".bin"]
    os.truncate(shard, 1_000)
    with pytest.raises(DatasetIntegrityError, match="truncated"):
        asyncio.run(s.read_many(np.asarray([3_000], dtype=np.int64), 100))


def test_preadv_arrays_hold_no_maps_and_offsets_never_use_preadv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import guideloom.storage._local._sharded as local

    monkeypatch.setattr(local, "MAPPED_BUDGET", 16)
    monkeypatch.setattr(local, "SMALL_FILE_BYTES", 0)  # map even the small offsets file
    gl.write_documents(tmp_path / "d", [np.arange(n, dtype=np.int64) for n in (3, 50, 7)])
    docs = gl.open_documents(tmp_path / "d")
    asyncio.run(docs.open())
    assert docs._tokens._fds and not docs._tokens._maps  # type: ignore[attr-defined]
    assert docs._offsets._maps and not docs._offsets._fds  # type: ignore[attr-defined]
    got = asyncio.run(docs.read_many(np.asarray([1, 2], dtype=np.int64)))
    assert [g.tolist() for g in got] == [list(range(50)), list(range(7))]
    assert docs._tokens.slice(2, 5).tolist() == [2, 0, 1]  # type: ignore[attr-defined]
    assert docs._tokens.take(np.asarray([0, 3])).tolist() == [0, 0]  # type: ignore[attr-defined]


def _damage_in_place(path: Path, data: bytes) -> None:
    """Write ``data`` over ``path`` in place (same inode), its modification time kept (bit rot)."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.write(data)
        fh.truncate(len(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("preads", [False, True])
def test_a_block_changed_in_place_after_it_was_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preads: bool
) -> None:
    import guideloom.storage._local._sharded as local

    if preads:
        monkeypatch.setattr(local, "MAPPED_BUDGET", 1024)
    tokens = np.arange(200_000, dtype=np.uint16)
    gl.write_stream(tmp_path / "ds", tokens, shard_bytes=160 * 1024)
    s = gl.open_stream(tmp_path / "ds")
    asyncio.run(s.open())
    starts = np.asarray([0, 70_000], dtype=np.int64)
    for _ in range(2):  # every block read checked, then read again as checked
        assert np.array_equal(
            np.asarray(s.read_many_sync(starts, 64)), tokens[starts[:, None] + np.arange(64)]
        )
    (shard, *_) = sorted((tmp_path / "ds").glob("*.bin"))
    old = bytearray(shard.read_bytes())
    old[10] ^= 1
    _damage_in_place(shard, bytes(old))
    with pytest.raises(DatasetIntegrityError, match=f"{shard.name}.*block 0"):
        s.read_many_sync(starts, 64)


def test_a_mapped_file_truncated_after_open_is_refused_not_a_crash(tmp_path: Path) -> None:
    tokens = np.arange(100_000, dtype=np.uint16)
    gl.write_stream(tmp_path / "ds", tokens)
    s = gl.open_stream(tmp_path / "ds")
    asyncio.run(s.open())
    (shard,) = (tmp_path / "ds").glob("*.bin")
    s.read_many_sync(np.asarray([90_000], dtype=np.int64), 100)
    _damage_in_place(shard, shard.read_bytes()[:1000])
    with pytest.raises(DatasetIntegrityError, match=f"{shard.name}.*truncated"):
        s.read_many_sync(np.asarray([90_000], dtype=np.int64), 100)


def test_a_file_touched_but_unchanged_reads_on(tmp_path: Path) -> None:
    """A new status change time (``chmod``, a copy tool's ``utime``) only has the blocks checked again."""
    tokens = np.arange(100_000, dtype=np.uint16)
    gl.write_stream(tmp_path / "ds", tokens)
    s = gl.open_stream(tmp_path / "ds")
    asyncio.run(s.open())
    starts = np.asarray([5, 90_000], dtype=np.int64)
    want = tokens[starts[:, None] + np.arange(100)]
    assert np.array_equal(np.asarray(s.read_many_sync(starts, 100)), want)
    (shard,) = (tmp_path / "ds").glob("*.bin")
    _damage_in_place(shard, shard.read_bytes())
    os.chmod(shard, 0o600)
    assert np.array_equal(np.asarray(s.read_many_sync(starts, 100)), want)


def test_document_tokens_changed_after_they_were_read_are_refused(tmp_path: Path) -> None:
    docs = [np.full(n, n, dtype=np.uint16) for n in range(1, 40_000, 97)]
    gl.write_documents(tmp_path / "ds", docs)
    s = gl.open_documents(tmp_path / "ds")
    asyncio.run(s.open())
    every = np.arange(len(docs), dtype=np.int64)
    assert [len(d) for d in s.read_many_sync(every)] == [len(d) for d in docs]  # every block checked
    tokens = max((tmp_path / "ds").glob("*.bin"), key=lambda p: p.stat().st_size)
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 0xFF
    _damage_in_place(tokens, bytes(data))
    with pytest.raises(DatasetIntegrityError, match=f"{tokens.name}.*does not match"):
        s.read_many_sync(every)
