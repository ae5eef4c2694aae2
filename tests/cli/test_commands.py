"""``inspect``, ``verify``, ``bench``, progress bars, ``--help``, and the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import guideloom as gl
from tests.support.cli import manifest_of, write_jsonl

TEXTS = [f"document number {i}: " + "lorem ipsum " * (i % 13) for i in range(200)]


@pytest.fixture
def stream_ds(cli, tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "stream", "--shard-size", "8KiB")
    assert r.code == 0, r
    return tmp_path / "stream"


@pytest.fixture
def docs_ds(cli, tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "docs", "--kind", "documents")
    assert r.code == 0, r
    return tmp_path / "docs"


def test_inspect_stream(cli, stream_ds: Path) -> None:
    m = manifest_of(stream_ds)
    r = cli("inspect", stream_ds)
    assert r.code == 0, r
    assert "kind:       stream" in r.out and "dtype:      uint16" in r.out
    assert f"elements:   {m['num_elements']:,} tokens" in r.out
    assert "documents:  200" in r.out
    for f in m["fields"]["tokens"]["files"]:
        assert f["path"] in r.out
    assert f"files:      {len(m['fields']['tokens']['files'])} " in r.out
    assert "samples" not in r.out  # decoding only when a tokenizer is given
    r = cli("inspect", stream_ds, "--tokenizer", "bytes", "--samples", "3", "--chars", "1000")
    assert r.code == 0, r
    for text in TEXTS[:3]:
        assert repr(text) in r.out
    assert repr(TEXTS[3]) not in r.out


def test_inspect_documents(cli, docs_ds: Path) -> None:
    r = cli("inspect", docs_ds, "--tokenizer", "auto", "--samples", "2", "--chars", "10")
    assert r.code == 0, r
    assert "kind:       documents" in r.out and "documents:  200" in r.out and "offsets" in r.out
    assert repr(TEXTS[1][:10]) + "..." in r.out


@pytest.mark.parametrize("fixture", ["stream_ds", "docs_ds"])
def test_inspect_counts_are_checked_by_the_parser(cli, fixture: str, request: pytest.FixtureRequest) -> None:
    ds = request.getfixturevalue(fixture)
    for option in ("--samples", "--chars"):
        r = cli("inspect", ds, "--tokenizer", "bytes", option, "-1")
        assert r.code == 2, (option, r)
        assert f"argument {option}: must be at least 0, got -1" in r.err and "Traceback" not in r.err
        assert r.err.startswith("usage: guideloom inspect"), r
    r = cli("inspect", ds, "--tokenizer", "bytes", "--samples", "0")
    assert r.code == 0, r
    assert "samples (first 0 documents" in r.out and "[0]" not in r.out
    r = cli("inspect", ds, "--tokenizer", "bytes", "--samples", "1", "--chars", "0")
    assert r.code == 0, r
    assert "  [0] " in r.out and "[1]" not in r.out


def test_verify_ok_then_detects_corruption(cli, stream_ds: Path) -> None:
    r = cli("verify", stream_ds)
    assert r.code == 0 and r.out.startswith("ok:") and "sha256" in r.out
    shard = stream_ds / manifest_of(stream_ds)["fields"]["tokens"]["files"][1]["path"]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01  # same size, one bit flipped: only the checksum can tell
    shard.write_bytes(bytes(data))
    r = cli("verify", stream_ds)
    assert r.code == 1 and shard.name in r.err and "checksum" in r.err
    shard.write_bytes(bytes(data[:-2]))
    r = cli("verify", stream_ds)
    assert r.code == 1 and shard.name in r.err and "bytes" in r.err


def test_verify_adds_block_digests_after_a_full_check(cli, stream_ds: Path) -> None:
    """A dataset written without block digests gets them from ``verify --add-block-digests``,
    only once every file matched its checksum; reads then check each block."""
    doc = manifest_of(stream_ds)
    for spec in doc["fields"].values():
        for f in spec["files"]:
            del f["blocks"]
    (stream_ds / "manifest.json").write_text(json.dumps(doc))
    shard = stream_ds / doc["fields"]["tokens"]["files"][0]["path"]
    good = shard.read_bytes()
    shard.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    r = cli("verify", stream_ds, "--add-block-digests")
    assert r.code == 1 and shard.name in r.err and "checksum" in r.err
    assert "blocks" not in (stream_ds / "manifest.json").read_text()  # nothing added to a damaged one
    shard.write_bytes(good)
    r = cli("verify", stream_ds, "--add-block-digests")
    assert r.code == 0 and "added block digests" in r.out, r
    assert gl.open_stream(stream_ds).manifest.has_blocks
    r = cli("verify", stream_ds)
    assert r.code == 0 and "block digests match" in r.out, r
    shard.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(gl.DatasetIntegrityError, match=f"{shard.name}"):
        gl.open_stream(stream_ds).read_many_sync(np.zeros(1, dtype=np.int64), 4)


def test_verify_and_inspect_missing_dataset(cli, tmp_path: Path) -> None:
    for command in ("verify", "inspect", "bench"):
        r = cli(command, tmp_path / "nothing")
        assert r.code == 1 and "no dataset" in r.err, (command, r)


def test_bench_stream(cli, stream_ds: Path) -> None:
    r = cli(
        "bench",
        stream_ds,
        "--sequence-length",
        "64",
        "--batch-size",
        "4",
        "--batches",
        "10",
        "--shuffle",
        "--num-workers",
        "2",
        "--prefetch",
        "2",
    )
    assert r.code == 0, r
    assert "batches:              10 (40 samples, 2,560 tokens)" in r.out
    for key in ("samples/s:", "tokens/s:", "time to first batch:"):
        assert key in r.out
    # fewer batches than asked for: stops at the end of the epoch
    n = manifest_of(stream_ds)["num_elements"] // 64 // 4
    r = cli("bench", stream_ds, "--sequence-length", "64", "--batch-size", "4", "--batches", "100000")
    assert r.code == 0 and f"batches:              {n:,} " in r.out


def test_bench_documents_and_metadata_streams(cli, docs_ds: Path, tmp_path: Path) -> None:
    r = cli("bench", docs_ds, "--batch-size", "8", "--batches", "3")
    assert r.code == 0, r
    lengths = [len(t.encode()) + 1 for t in TEXTS[:24]]
    assert f"batches:              3 (24 samples, {sum(lengths):,} tokens)" in r.out
    assert cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "ids", "--document-ids").code == 0
    r = cli(
        "bench",
        tmp_path / "ids",
        "--sequence-length",
        "32",
        "--batch-size",
        "2",
        "--batches",
        "2",
        "--num-workers",
        "1",
        "--parallel-method",
        "process",
    )
    assert r.code == 0, r
    assert "batches:              2 (4 samples, 128 tokens)" in r.out


def test_bench_too_small_dataset_is_a_data_error(cli, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("tiny")
    assert cli("prepare", tmp_path / "a.txt", "-o", tmp_path / "ds").code == 0
    r = cli("bench", tmp_path / "ds", "--sequence-length", "2048")
    assert r.code == 1 and "guideloom: error:" in r.err


def test_bench_blames_the_sequence_length_or_the_batch_size(cli, stream_ds: Path) -> None:
    """No batch at all: the message names the argument that is too large."""
    tokens = manifest_of(stream_ds)["num_elements"]
    r = cli("bench", stream_ds, "--sequence-length", str(tokens + 1))
    assert r.code == 1, r
    assert f"fewer than one sample of --sequence-length {tokens + 1:,}" in r.err
    assert f"use a --sequence-length of at most {tokens:,}" in r.err and "batch-size" not in r.err
    samples = tokens // 64
    r = cli("bench", stream_ds, "--sequence-length", "64", "--batch-size", str(samples + 1))
    assert r.code == 1, r
    assert f"{samples:,} samples of --sequence-length 64, fewer than one batch of --batch-size" in r.err
    assert f"use --batch-size {samples} or less" in r.err


def test_bench_does_not_report_a_rate_it_cannot_measure(cli, stream_ds: Path, docs_ds: Path) -> None:
    """Too few batches after the first: no samples/s, and a warning saying what to change."""
    tokens = manifest_of(stream_ds)["num_elements"]
    batch = tokens // 64 // 3  # three batches in the epoch
    r = cli("bench", stream_ds, "--sequence-length", "64", "--batch-size", str(batch))
    assert r.code == 0, r
    assert "samples/s:            not measured: 2 batches after the first" in r.out
    assert "too few to measure a rate" in r.err
    assert f"use a --batch-size of at most {3 * batch // 11}" in r.err and "--sequence-length" in r.err
    r = cli("bench", stream_ds, "--sequence-length", "64", "--batch-size", "2", "--batches", "4")
    assert r.code == 0 and "not measured: 3 batches after the first" in r.out
    assert "use --batches 11 or more" in r.err
    r = cli("bench", docs_ds, "--batch-size", "50")  # 200 documents: 4 batches
    assert "not measured" in r.out and "sequence-length" not in r.err
    r = cli("bench", stream_ds, "--sequence-length", "64", "--batch-size", "2", "--batches", "4", "-q")
    assert r.code == 0 and r.out == r.err == ""
    r = cli("bench", stream_ds, "--sequence-length", "64", "--batch-size", "2", "--batches", "12")
    assert "samples/s:            not measured" not in r.out and "(after the first batch)" in r.out
    assert r.err == ""


def test_collate_functions() -> None:
    from guideloom._cli._bench import collate_documents, collate_stream

    out = collate_documents([np.array([1, 2, 3], np.uint16), np.array([4], np.uint16)])
    assert out["tokens"].tolist() == [[1, 2, 3], [4, 0, 0]] and out["lengths"].tolist() == [3, 1]
    assert out["tokens"].dtype == torch.int64
    s = collate_stream([np.array([1, 2], np.uint16), np.array([3, 4], np.uint16)])
    assert s.dtype == torch.int64 and s.tolist() == [[1, 2], [3, 4]]


def test_progress_bar_only_when_asked_or_interactive(cli, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "a")
    assert r.code == 0 and r.err == ""  # stderr is not a terminal here: quiet
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "b", "--progress")
    assert r.code == 0, r
    assert "prepare" in r.err and "docs" in r.err and "tokens" in r.err and "/s" in r.err
    r = cli("verify", tmp_path / "b", "--progress")
    assert r.code == 0 and "verify" in r.err and "100%" in r.err
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "c", "--progress", "--quiet")
    assert r.code == 0 and r.out == "" and r.err == ""


@pytest.mark.parametrize("command", ["prepare", "inspect", "verify", "bench"])
def test_help_on_every_subcommand_has_examples(cli, command: str) -> None:
    r = cli(command, "--help")
    assert r.code == 0
    assert (
        f"usage: guideloom {command}" in r.out and "examples:" in r.out and f"guideloom {command} " in r.out
    )


def test_top_level_help(cli) -> None:
    r = cli("--help")
    assert r.code == 0 and all(c in r.out for c in ("prepare", "inspect", "verify", "bench"))
    assert cli().code == 2


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("guideloom")
    if not script.exists():
        pytest.skip("the guideloom console script is not installed next to this Python")
    return [str(script)]


@pytest.mark.slow
def test_installed_console_script_end_to_end(tmp_path: Path) -> None:
    """prepare -> inspect -> verify -> bench through the installed script, then the loader."""
    cmd = _console_script()
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    env = {**os.environ, "PYTHONWARNINGS": "error"}

    def run(*args: object) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [*cmd, *map(str, args)], capture_output=True, text=True, env=env, timeout=100, check=False
        )
        assert out.returncode == 0, out
        return out

    out = run(
        "prepare", tmp_path / "d.jsonl", "--output", tmp_path / "ds", "--workers", "2", "--task-size", "2KiB"
    )
    assert "wrote stream dataset" in out.stdout and out.stderr == ""
    assert "documents:  200" in run("inspect", tmp_path / "ds", "--tokenizer", "bytes").stdout
    assert run("verify", tmp_path / "ds").stdout.startswith("ok:")
    assert "tokens/s" in run("bench", tmp_path / "ds", "--sequence-length", "128", "--batch-size", "2").stdout

    def collate(samples):
        return torch.from_numpy(np.stack(samples).astype(np.int64))

    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(tmp_path / "ds"),
        collate,
        sequence_length=16,
        local_batch_size=4,
        device=torch.device("cpu"),
    )
    with loader:
        batches = list(loader)
    tokens = torch.cat([b.reshape(-1) for b in batches]).numpy()
    expected = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 256) for t in TEXTS])
    np.testing.assert_array_equal(tokens, expected[: len(tokens)])
    assert len(tokens) == len(expected) // 64 * 64
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["info"]["documents"] == 200


def test_inspect_a_parquet_folder_shows_rows_files_row_groups_columns_and_samples(
    cli, tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "data"
    folder.mkdir()
    for f in range(2):
        rows = range(f * 100, f * 100 + 100)
        table = pa.table(
            {"n": list(rows), "text": [TEXTS[i] for i in rows], "input_ids": [[i, 7, 8] for i in rows]}
        )
        pq.write_table(table, folder / f"train-{f:05d}-of-00002.parquet", row_group_size=30)
    r = cli("inspect", folder, "--samples", "2", "--chars", "15")
    assert r.code == 0, r
    assert "rows:       200" in r.out and "files:      2" in r.out
    assert "row groups: 8 (rows each: min 10, mean 25, max 30)" in r.out
    assert "columns:    n (int64), text (string), input_ids (list<element: int64>)" in r.out
    assert "column:     text (text)" in r.out and "train-00001-of-00002.parquet" in r.out
    assert f"  [1] {len(TEXTS[1])} chars: {TEXTS[1][:15]!r}..." in r.out and "[2]" not in r.out
    r = cli("inspect", folder / "train-00001-*.parquet", "--column", "input_ids", "--samples", "1")
    assert r.code == 0, r
    assert "rows:       100" in r.out and "  [0] 3 tokens: [100, 7, 8]" in r.out
    r = cli("inspect", folder, "--column", "missing")
    assert r.code != 0 and "no column 'missing'" in r.err
    # verify and explain read datasets guideloom wrote: over Parquet they say where to go instead
    r = cli("verify", folder)
    assert r.code != 0 and "holds Parquet files" in r.err and "guideloom inspect" in r.err
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps({"epoch": 0, "observation_offset": 0}))
    r = cli("explain", folder, "--checkpoint", ckpt, "--step", "0")
    assert r.code != 0 and "holds Parquet files" in r.err and "loader.explain" in r.err


def test_inspect_shows_null_rows_as_null_instead_of_failing(cli, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a", None, "", None, "tail"]}), folder / "texts.parquet")
    r = cli("inspect", folder, "--samples", "4")
    assert r.code == 0, r
    assert "\n  [0] 1 char: 'a'\n  [1] null\n  [2] 0 chars: ''\n  [3] null\n" in r.out  # "" is not null
    assert "samples (first 4 rows of 'text'):" in r.out
    assert "texts.parquet  5 rows  1 row group  " in r.out  # columns as wide as their entries
    (nulls,) = [line for line in r.out.splitlines() if line.startswith("nulls:")]
    assert nulls.startswith("nulls:      2 of the 4 rows shown are null:")
    assert "on_null='empty'" in nulls and "--skip-invalid" in nulls  # for Python, for prepare
    r = cli("inspect", folder, "--samples", "1")
    assert r.code == 0 and "samples (first 1 row of 'text'):" in r.out and "nulls:" not in r.out, r

    ids = pa.array([[5], None, [1, 2, 3]], pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "ids.parquet")
    r = cli("inspect", tmp_path / "ids.parquet", "--samples", "3")
    assert r.code == 0, r
    assert "\n  [0] 1 token: [5]\n  [1] null\n  [2] 3 tokens: [1, 2, 3]\n" in r.out
    assert "nulls:      1 of the 3 rows shown is null:" in r.out and "--skip-invalid" not in r.out


def test_counts_of_one_are_in_the_singular(cli, stream_ds: Path, tmp_path: Path) -> None:
    gl.write_stream(tmp_path / "one", np.arange(1, dtype=np.uint16))
    r = cli("inspect", tmp_path / "one")
    assert r.code == 0 and "elements:   1 token\n" in r.out and "uint16               1 element " in r.out, r
    r = cli("verify", tmp_path / "one")
    assert r.code == 0 and ": 1 file, 2 B," in r.out and "(stream, 1 uint16 token)" in r.out, r
    r = cli("verify", stream_ds)
    files = len(manifest_of(stream_ds)["fields"]["tokens"]["files"])
    assert r.code == 0 and f": {files} files, " in r.out and " uint16 tokens)" in r.out, r
    r = cli("bench", stream_ds, "--sequence-length", "64", "--batch-size", "2", "--batches", "1")
    assert r.code == 0 and "not measured: 0 batches after the first" in r.out, r
    assert "guideloom: warning: 1 batch in all, 0 after the first" in r.err, r
    r = cli("bench", stream_ds, "--sequence-length", "64", "--batch-size", "2", "--batches", "2")
    assert r.code == 0 and "not measured: 1 batch after the first" in r.out, r
    assert "guideloom: warning: 2 batches in all, 1 after the first" in r.err, r
