"""Block digests: written with every data file, checked before any byte of a block is read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom import DatasetFormatError, DatasetIntegrityError
from guideloom.storage._format import _blocks
from guideloom.storage._format._blocks import (
    BLOCK_BYTES,
    INLINE_BLOCKS,
    BlockHasher,
    BlockMismatch,
    block_digests,
    check_range,
    digest_held,
    distinct,
    widen,
)
from guideloom.storage._format._manifest import MANIFEST_NAME
from guideloom.storage._local import _check, _sharded


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x01]))


def _big(tmp_path: Path, shard_bytes: int = 8 * 2**20) -> tuple[Path, np.ndarray]:
    data = (np.arange(3 * 2**20) % 50_000).astype(np.uint16)
    gl.write_stream(tmp_path / "ds", data, shard_bytes=shard_bytes)
    return tmp_path / "ds", data


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=3 * 4096 + 7), st.lists(st.integers(1, 5000), max_size=20))
def test_streamed_digests_equal_whole_ones(data: bytes, cuts: list[int]) -> None:
    """However the bytes arrive, the writer's digests are those of the whole file's blocks."""
    hasher = BlockHasher(4096)
    pos = 0
    for n in cuts:
        hasher.update(data[pos : pos + n])
        pos += n
    hasher.update(data[pos:])
    assert np.array_equal(hasher.digests(), block_digests(data, 4096))
    assert len(hasher.digests()) == -(-len(data) // 4096)


@given(st.integers(0, 10**6), st.integers(0, 10**5), st.integers(1, 2 * 10**6))
def test_widen_covers_whole_blocks(start: int, n: int, size: int) -> None:
    end = min(start + n, size)
    start = min(start, end)
    lo, hi = widen(start, end, 4096, size)
    if end > start:
        assert lo <= start and end <= hi and lo % 4096 == 0 and (hi % 4096 == 0 or hi == size)
        assert hi - lo < (end - start) + 2 * 4096


def test_small_files_carry_digests_inline_and_large_ones_a_sidecar(tmp_path: Path) -> None:
    folder, _ = _big(tmp_path)
    doc = json.loads((folder / MANIFEST_NAME).read_text())
    files = doc["fields"]["tokens"]["files"]
    assert [f["blocks"]["size"] for f in files] == [BLOCK_BYTES] * len(files)
    big = files[0]
    assert big["bytes"] // BLOCK_BYTES > INLINE_BLOCKS and big["blocks"]["file"] == big["path"] + ".xxh3"
    side = np.frombuffer((folder / big["blocks"]["file"]).read_bytes(), "<u8")
    assert np.array_equal(side, block_digests((folder / big["path"]).read_bytes(), BLOCK_BYTES))
    small = gl.write_stream(tmp_path / "small", np.arange(100, dtype=np.uint16))
    (f,) = small.tokens.files
    assert f.blocks is not None and f.blocks.inline is not None and f.blocks.sidecar is None


@pytest.mark.parametrize("preads", [False, True])
def test_a_damaged_block_is_refused_before_any_of_its_bytes_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preads: bool
) -> None:
    """A byte flipped in place, the size the same, in a dataset too large to be hashed on open:
    the rows in other blocks read, any row in the damaged block is refused (maps and preadv)."""
    monkeypatch.setattr(_check, "VERIFY_ON_OPEN_BYTES", 0)
    if preads:
        monkeypatch.setattr(_sharded, "MAPPED_BUDGET", 2**20)
    folder, data = _big(tmp_path)
    (first,) = [p for p in folder.iterdir() if p.name.endswith("00000.bin")]
    _flip(first, 5 * BLOCK_BYTES + 100)
    storage = gl.open_stream(folder)
    storage.open_sync()
    fine = storage.read_many_sync(np.asarray([40 * BLOCK_BYTES // 2, 41 * BLOCK_BYTES // 2], np.int64), 1024)
    assert np.array_equal(fine[0], data[40 * BLOCK_BYTES // 2 :][:1024])  # another group of blocks
    for start in (5 * BLOCK_BYTES // 2, 5 * BLOCK_BYTES // 2 - 10, 6 * BLOCK_BYTES // 2 - 10):
        with pytest.raises(DatasetIntegrityError, match=rf"{first.name}'?: block 5 .*does not match"):
            storage.read_many_sync(np.asarray([40 * BLOCK_BYTES // 2, start], np.int64), 64)


def test_a_file_replaced_by_other_bytes_of_its_size_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file replaced after a read checked its blocks: the next open sees a new file (inode,
    mtime) and checks its blocks again."""
    monkeypatch.setattr(_check, "VERIFY_ON_OPEN_BYTES", 0)
    folder, data = _big(tmp_path)
    storage = gl.open_stream(folder)
    storage.open_sync()
    assert np.array_equal(storage.read_many_sync(np.asarray([0], np.int64), 8)[0], data[:8])
    (first,) = [p for p in folder.iterdir() if p.name.endswith("00000.bin")]
    other = bytearray(first.read_bytes())
    other[3] ^= 0xFF
    tmp = first.with_name("new")
    tmp.write_bytes(bytes(other))
    os.replace(tmp, first)
    again = gl.open_stream(folder)
    again.open_sync()
    with pytest.raises(DatasetIntegrityError, match="block 0 "):
        again.read_many_sync(np.asarray([0], np.int64), 8)


def test_a_damaged_sidecar_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_check, "VERIFY_ON_OPEN_BYTES", 0)
    folder, _ = _big(tmp_path)
    (side,) = [p for p in folder.iterdir() if p.name.endswith("00000.bin.xxh3")]
    _flip(side, 10)
    with pytest.raises(DatasetIntegrityError, match=f"block digests file '{side.name}'"):
        gl.open_stream(folder).open_sync()


def test_documents_check_their_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_check, "VERIFY_ON_OPEN_BYTES", 0)
    docs = [np.full(n, n % 60_000, dtype=np.uint16) for n in range(1, 2500)]
    gl.write_documents(tmp_path / "d", docs)
    (tokens,) = [p for p in (tmp_path / "d").iterdir() if p.name.startswith("tokens") and p.suffix == ".bin"]
    _flip(tokens, tokens.stat().st_size - 10)
    storage = gl.open_documents(tmp_path / "d")
    storage.open_sync()
    assert storage.read_many_sync(np.asarray([5], np.int64))[0].tolist() == docs[5].tolist()
    with pytest.raises(DatasetIntegrityError, match="does not match its digest"):
        storage.read_many_sync(np.asarray([len(docs) - 1], np.int64))


def test_a_dataset_written_without_block_digests_reads_as_before(tmp_path: Path) -> None:
    folder, data = _big(tmp_path)
    doc = json.loads((folder / MANIFEST_NAME).read_text())
    for f in doc["fields"]["tokens"]["files"]:
        del f["blocks"]
    (folder / MANIFEST_NAME).write_text(json.dumps(doc))
    storage = gl.open_stream(folder)
    assert not storage.manifest.has_blocks
    storage.open_sync()
    assert np.array_equal(storage.read_many_sync(np.asarray([7], np.int64), 9)[0], data[7:16])


@pytest.mark.parametrize(
    "blocks",
    [
        {"size": 65536, "algorithm": "md5", "digests": ""},
        {"size": 1000, "algorithm": "xxh3_64", "digests": ""},
        {"size": 65536, "algorithm": "xxh3_64", "digests": "00"},
        {"size": 65536, "algorithm": "xxh3_64", "file": "../x.xxh3", "sha256": "0" * 64},
    ],
)
def test_malformed_block_entries_are_format_errors(tmp_path: Path, blocks: dict[str, object]) -> None:
    gl.write_stream(tmp_path / "ds", np.arange(100, dtype=np.uint16))
    doc = json.loads((tmp_path / "ds" / MANIFEST_NAME).read_text())
    doc["fields"]["tokens"]["files"][0]["blocks"] = blocks
    (tmp_path / "ds" / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(DatasetFormatError, match="blocks"):
        gl.open_stream(tmp_path / "ds")


def test_overwrite_removes_the_replaced_sidecars(tmp_path: Path) -> None:
    folder, _ = _big(tmp_path)
    old = {p.name for p in folder.iterdir() if p.suffix == ".xxh3"}
    assert old
    gl.write_stream(folder, np.arange(10, dtype=np.uint16), overwrite=True)
    assert not old & {p.name for p in folder.iterdir()}


@given(st.lists(st.integers(-(2**40), 2**40), max_size=200))
@settings(max_examples=200, deadline=None)
def test_distinct_is_np_unique(values: list[int]) -> None:
    a = np.asarray(values, dtype=np.int64)
    got = distinct(a)
    assert got.dtype == np.int64 and got.tolist() == np.unique(a).tolist()


def test_a_first_read_imports_no_masked_arrays(tmp_path: Path) -> None:
    """A new process's first checked read: ``np.unique`` would import ``numpy.ma`` (tens of ms
    on each process worker's first batch); the read path uses :func:`distinct`."""
    import subprocess
    import sys

    gl.write_stream(tmp_path / "s", [np.arange(4096, dtype=np.uint16)], dtype=np.uint16)
    code = (
        "import sys, numpy as np, torch, guideloom as gl\n"
        f"loader = gl.StatefulDataLoader.from_storage(gl.open_stream({str(tmp_path / 's')!r}), list, "
        "sequence_length=16, local_batch_size=4, shuffle=True, device=torch.device('cpu'))\n"
        "with loader:\n"
        "    next(iter(loader))\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_check_range_passes_whole_blocks_and_a_short_last_one() -> None:
    data = np.random.default_rng(0).integers(0, 256, 5 * 4096 + 100, dtype=np.uint8).tobytes()
    digests = block_digests(data, 4096)
    check_range(digests, 4096, 0, data)
    check_range(digests, 4096, 2 * 4096, data[2 * 4096 :])  # from block 2 to the short last one


def test_check_range_names_the_first_block_that_does_not_match() -> None:
    data = bytearray(np.random.default_rng(1).integers(0, 256, 6 * 4096, dtype=np.uint8).tobytes())
    digests = block_digests(bytes(data), 4096)
    data[3 * 4096 + 7] ^= 1
    data[5 * 4096] ^= 1
    with pytest.raises(BlockMismatch, match=r"block 3 \(bytes 12288-16383\)"):
        check_range(digests, 4096, 4096, memoryview(data)[4096:])


def test_check_range_hashes_each_block_with_the_gil_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A range's blocks are hashed by the one-shot digest: the hasher that drops the GIL once a
    block kept an event loop waiting for the GIL through the whole range."""
    data = bytes(range(256)) * 64  # 4 blocks of 4 KiB
    digests = block_digests(data, 4096)
    assert digest_held(data[:4096]) == int(digests[0]) == xxhash.xxh3_64(data[:4096]).intdigest()
    seen: list[int] = []

    def counted(view: object) -> int:
        seen.append(memoryview(view).nbytes)  # type: ignore[arg-type]
        return digest_held(view)

    def dropping(*_: object) -> None:
        raise AssertionError("the hasher object drops the GIL for each block")

    monkeypatch.setattr(_blocks, "digest_held", counted)
    monkeypatch.setattr(xxhash, "xxh3_64", dropping)
    check_range(digests, 4096, 0, data)
    assert seen == [4096] * 4
