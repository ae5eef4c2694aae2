"""``guideloom prepare``: inputs, formats, tokenizers, parallel output, document ids."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import guideloom as gl
from guideloom._cli import _prepare_write
from tests.support.cli import BYTE_EOS, byte_texts, checksums, data_files, field_of, manifest_of, write_jsonl

TEXTS = [
    "Hello, world!",
    "naïve café — 東京 🚀",
    'quotes " and \\ backslashes\nand\ttabs',
    "",
    "x" * 5000,
    "the last one\n",
]


def test_txt_files_round_trip_in_sorted_order(cli, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    names = ["b.txt", "a/z.txt", "a.txt", "a/b/c.txt", "c.TXT", "skip.md", ".hidden.txt"]
    for i, name in enumerate(names):
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text(f"{name}: {TEXTS[i % len(TEXTS)]}", encoding="utf-8")
    r = cli("prepare", corpus, "--output", tmp_path / "ds")
    assert r.code == 0, r
    # sorted by path inside the folder; hidden files and unknown extensions are not read
    expected_order = ["a.txt", "a/b/c.txt", "a/z.txt", "b.txt", "c.TXT"]
    expected = [(corpus / n).read_text(encoding="utf-8") for n in expected_order]
    assert byte_texts(tmp_path / "ds") == expected
    m = manifest_of(tmp_path / "ds")
    assert m["kind"] == "stream" and m["dtype"] == "uint16"
    assert m["info"]["tokenizer"] == "bytes" and m["info"]["eos_id"] == BYTE_EOS
    assert m["info"]["vocab_size"] == 257
    assert m["info"]["source_files"] == 5 and m["info"]["documents"] == 5
    assert "wrote stream dataset" in r.out and "5 documents" in r.out


def test_inputs_keep_their_order_globs_are_sorted_and_files_are_read_once(cli, tmp_path: Path) -> None:
    for name in ["3.txt", "1.txt", "2.txt"]:
        (tmp_path / name).write_text(name)
    (tmp_path / "first.md").write_text("a file named directly is read whatever its extension")
    r = cli(
        "prepare", tmp_path / "first.md", str(tmp_path / "*.txt"), tmp_path / "1.txt", "-o", tmp_path / "ds"
    )
    assert r.code == 0, r
    assert byte_texts(tmp_path / "ds") == [
        "a file named directly is read whatever its extension",
        "1.txt",
        "2.txt",
        "3.txt",
    ]


def test_include_pattern_selects_files_in_folders(cli, tmp_path: Path) -> None:
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "mod.py").write_text("import os\n")
    (tmp_path / "src" / "setup.py").write_text("print('hi')\n")
    (tmp_path / "src" / "notes.txt").write_text("not python")
    r = cli("prepare", tmp_path / "src", "--include", "*.py", "-o", tmp_path / "ds")
    assert r.code == 0, r
    assert byte_texts(tmp_path / "ds") == ["import os\n", "print('hi')\n"]


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "parquet.gz", "ndjson.zst"])
def test_formats_give_the_same_tokens(cli, tmp_path: Path, fmt: str) -> None:
    rows = [{"id": i, "body": t} for i, t in enumerate(TEXTS)]
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / f"data.{fmt}"
    base = fmt.split(".", maxsplit=1)[0]
    if base in ("jsonl", "ndjson"):
        raw = write_jsonl(tmp_path / "raw.jsonl", rows).read_bytes()
    else:
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(
            pa.table({"id": [r["id"] for r in rows], "body": [r["body"] for r in rows]}),
            buf,
            row_group_size=2,
        )
        raw = buf.getvalue()
    if fmt.endswith(".gz"):
        raw = gzip.compress(raw)
    elif fmt.endswith(".zst"):
        import zstandard

        raw = zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(raw)
    r = cli("prepare", path, "--field", "body", "-o", tmp_path / "ds", "--task-size", "64")
    assert r.code == 0, r
    assert byte_texts(tmp_path / "ds") == TEXTS
    # and in a folder, the file's format comes from its extension
    r = cli("prepare", tmp_path / "in", "--field", "body", "-o", tmp_path / "ds2")
    assert r.code == 0, r
    assert byte_texts(tmp_path / "ds2") == TEXTS


def test_zstd_frames_skippable_frames_and_empty_files_read_whole(cli, tmp_path: Path) -> None:
    import zstandard

    # as `cat a.zst b.zst` makes, with a skippable frame (metadata that some tools write) between
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"text": t} for t in TEXTS]).read_bytes()
    cctx = zstandard.ZstdCompressor()
    skippable = (0x184D2A50).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"notes"
    half = len(raw) // 2
    (tmp_path / "d.jsonl.zst").write_bytes(cctx.compress(raw[:half]) + skippable + cctx.compress(raw[half:]))
    r = cli("prepare", tmp_path / "d.jsonl.zst", "-o", tmp_path / "ds", "--task-size", "64")
    assert r.code == 0, r
    assert byte_texts(tmp_path / "ds") == TEXTS
    (tmp_path / "e.txt.zst").write_bytes(b"")
    (tmp_path / "f.txt.zst").write_bytes(cctx.compress(b""))
    r = cli("prepare", tmp_path / "e.txt.zst", tmp_path / "f.txt.zst", "-o", tmp_path / "empty")
    assert r.code == 0, r
    assert byte_texts(tmp_path / "empty") == ["", ""]


def _mixed_corpus(root: Path) -> Path:
    rng = np.random.default_rng(0)
    words = ["alpha", "βeta", "gamma", "δ", "epsilon", "🙂", "\n", '"q"']
    corpus = root / "mixed"
    corpus.mkdir()
    for k in range(3):
        rows = [{"text": " ".join(rng.choice(words, size=int(rng.integers(0, 300))))} for _ in range(200)]
        write_jsonl(corpus / f"part-{k}.jsonl", rows)
    with gzip.open(corpus / "part-3.jsonl.gz", "wt", encoding="utf-8") as f:
        for _ in range(100):
            f.write(json.dumps({"text": " ".join(rng.choice(words[:5], size=50))}) + "\n")
    for k in range(20):
        (corpus / "txt" / f"{k:02d}.txt").parent.mkdir(exist_ok=True)
        (corpus / "txt" / f"{k:02d}.txt").write_text(" ".join(rng.choice(words, size=100)), encoding="utf-8")
    return corpus


@pytest.mark.parametrize("extra", [[], ["--document-ids"], ["--kind", "documents"]])
def test_workers_give_byte_identical_output(cli, tmp_path: Path, extra: list[str]) -> None:
    corpus = _mixed_corpus(tmp_path)
    common = ["prepare", corpus, "--task-size", "3KiB", "--shard-size", "50KiB", *extra]
    assert cli(*common, "-o", tmp_path / "w1", "--workers", "1").code == 0
    r = cli(*common, "-o", tmp_path / "w2", "--workers", "2")
    assert r.code == 0, r
    m1, m2 = manifest_of(tmp_path / "w1"), manifest_of(tmp_path / "w2")
    assert len(m1["fields"]["tokens"]["files"]) > 1, "the corpus should span several shards"
    assert checksums(tmp_path / "w1") == checksums(tmp_path / "w2")
    assert data_files(tmp_path / "w1") == data_files(tmp_path / "w2")
    assert m1["info"]["documents"] == m2["info"]["documents"] == 3 * 200 + 100 + 20
    assert m1["num_elements"] == m2["num_elements"] > 0


def test_parallel_output_is_the_input_text_in_order(cli, tmp_path: Path) -> None:
    rows = [{"text": f"document {i}: " + "é" * (i % 17)} for i in range(500)]
    write_jsonl(tmp_path / "a.jsonl", rows[:250])
    write_jsonl(tmp_path / "b.jsonl", rows[250:])
    r = cli(
        "prepare",
        tmp_path / "a.jsonl",
        tmp_path / "b.jsonl",
        "-o",
        tmp_path / "ds",
        "--workers",
        "2",
        "--task-size",
        "1KiB",
    )
    assert r.code == 0, r
    assert byte_texts(tmp_path / "ds") == [row["text"] for row in rows]


def test_kind_documents(cli, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    r = cli(
        "prepare", tmp_path / "d.jsonl", "--kind", "documents", "-o", tmp_path / "docs", "--task-size", "100"
    )
    assert r.code == 0, r
    m = manifest_of(tmp_path / "docs")
    assert m["kind"] == "documents" and m["num_documents"] == len(TEXTS) and m["dtype"] == "uint16"
    storage = gl.open_documents(tmp_path / "docs")
    assert len(storage) == len(TEXTS)

    import asyncio

    async def read() -> list[np.ndarray]:
        async with storage:
            return list(await storage.read_many(np.arange(len(TEXTS), dtype=np.int64)))

    for doc, text in zip(asyncio.run(read()), TEXTS, strict=True):
        assert doc[-1] == BYTE_EOS
        assert bytes(doc[:-1].astype(np.uint8)).decode() == text


def test_no_eos(cli, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "cd"}])
    r = cli("prepare", tmp_path / "d.jsonl", "--no-eos", "--dtype", "uint8", "-o", tmp_path / "ds")
    assert r.code == 0, r
    assert bytes(field_of(tmp_path / "ds")) == b"abcd"
    assert manifest_of(tmp_path / "ds")["dtype"] == "uint8"


def test_dtype_too_small_for_the_vocabulary_is_a_usage_error(cli, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    r = cli("prepare", tmp_path / "a.txt", "--dtype", "uint8", "-o", tmp_path / "ds")
    assert r.code == 2
    assert "guideloom: error:" in r.err and "uint8" in r.err and "uint16" in r.err
    assert not (tmp_path / "ds").exists()


def test_explicit_dtype(cli, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("xyz")
    assert cli("prepare", tmp_path / "a.txt", "--dtype", "int32", "-o", tmp_path / "ds").code == 0
    assert manifest_of(tmp_path / "ds")["dtype"] == "int32"
    assert field_of(tmp_path / "ds").tolist() == [ord("x"), ord("y"), ord("z"), BYTE_EOS]


@pytest.mark.parametrize("small_blocks", [False, True])
def test_document_ids(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_blocks: bool) -> None:
    if small_blocks:  # exercise the metadata generators' block and chunk boundaries
        monkeypatch.setattr(_prepare_write, "_META_CHUNK", 7)
        monkeypatch.setattr(_prepare_write, "_LENGTHS_BLOCK", 3)
    texts = ["a" * n for n in [5, 0, 12, 1, 30, 2, 9, 0, 0, 17]]
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    r = cli("prepare", tmp_path / "d.jsonl", "--document-ids", "-o", tmp_path / "ds", "--task-size", "40")
    assert r.code == 0, r
    tokens = field_of(tmp_path / "ds")
    doc_id = field_of(tmp_path / "ds", "doc_id")
    doc_pos = field_of(tmp_path / "ds", "doc_pos")
    expected_id = np.concatenate([np.full(len(t) + 1, i) for i, t in enumerate(texts)])
    expected_pos = np.concatenate([np.arange(len(t) + 1) for t in texts])
    assert len(doc_id) == len(doc_pos) == len(tokens) == sum(len(t) + 1 for t in texts)
    np.testing.assert_array_equal(doc_id, expected_id)
    np.testing.assert_array_equal(doc_pos, expected_pos)
    assert np.all(np.diff(doc_id.astype(np.int64)) >= 0)
    # every position 0 starts a document, and the token before it ends one
    starts = np.flatnonzero(doc_pos == 0)
    assert np.all(tokens[starts[1:] - 1] == BYTE_EOS)
    m = manifest_of(tmp_path / "ds")
    assert m["fields"]["doc_id"]["dtype"] == "uint32" and m["fields"]["doc_pos"]["dtype"] == "uint32"

    import torch

    def collate(samples):
        assert all(isinstance(s, dict) for s in samples)
        return {k: torch.from_numpy(np.stack([s[k] for s in samples]).astype(np.int64)) for k in samples[0]}

    loader = gl.StatefulDataLoader.from_storage(
        gl.open_stream(tmp_path / "ds"),
        collate,
        sequence_length=8,
        local_batch_size=2,
        device=torch.device("cpu"),
    )
    with loader:
        batches = list(loader)
    assert batches and set(batches[0]) == {"tokens", "doc_id", "doc_pos"}
    seen = torch.cat([b["doc_id"].reshape(-1) for b in batches]).numpy()
    np.testing.assert_array_equal(seen, expected_id[: len(seen)])


def test_document_ids_need_a_stream(cli, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    r = cli("prepare", tmp_path / "a.txt", "--kind", "documents", "--document-ids", "-o", tmp_path / "ds")
    assert r.code == 2 and "--document-ids" in r.err


def _train_tokenizer(path: Path) -> object:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran", "the end ."], trainer=trainer)
    tok.save(str(path))
    return tok


def test_tokenizer_json(cli, tmp_path: Path) -> None:
    tok = _train_tokenizer(tmp_path / "tokenizer.json")
    texts = ["the cat sat", "a dog ran on the mat", "unknown words here", "the end ."]
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    for workers in ("1", "2"):
        r = cli(
            "prepare",
            tmp_path / "d.jsonl",
            "--tokenizer",
            tmp_path / "tokenizer.json",
            "--eos",
            "[EOS]",
            "-o",
            tmp_path / f"ds{workers}",
            "--workers",
            workers,
            "--task-size",
            "16",
        )
        assert r.code == 0, r
    eos = tok.token_to_id("[EOS]")
    expected = [i for t in texts for i in [*tok.encode(t, add_special_tokens=False).ids, eos]]
    assert field_of(tmp_path / "ds1").tolist() == expected
    assert data_files(tmp_path / "ds1") == data_files(tmp_path / "ds2")
    m = manifest_of(tmp_path / "ds1")
    assert m["dtype"] == "uint8"  # a tiny vocabulary: the smallest dtype that holds it
    assert m["info"]["eos_id"] == eos and m["info"]["vocab_size"] == tok.get_vocab_size()
    assert m["info"]["tokenizer"] == str((tmp_path / "tokenizer.json").resolve())

    r = cli("inspect", tmp_path / "ds1", "--tokenizer", tmp_path / "tokenizer.json")
    assert r.code == 0, r
    assert "the cat sat" in r.out and "a dog ran on the mat" in r.out
    r = cli("inspect", tmp_path / "ds1", "--tokenizer", "auto")
    assert r.code == 0 and "the cat sat" in r.out


def test_tokenizer_json_eos_by_id_and_errors(cli, tmp_path: Path) -> None:
    tok = _train_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text("the cat")
    eos = tok.token_to_id("[EOS]")
    r = cli(
        "prepare",
        tmp_path / "a.txt",
        "--tokenizer",
        tmp_path / "tokenizer.json",
        "--eos",
        eos,
        "-o",
        tmp_path / "ds",
    )
    assert r.code == 0, r
    assert field_of(tmp_path / "ds")[-1] == eos
    r = cli("prepare", tmp_path / "a.txt", "--tokenizer", tmp_path / "tokenizer.json", "-o", tmp_path / "x")
    assert r.code == 2 and "--eos" in r.err
    r = cli(
        "prepare",
        tmp_path / "a.txt",
        "--tokenizer",
        tmp_path / "tokenizer.json",
        "--eos",
        "</nope>",
        "-o",
        tmp_path / "x",
    )
    assert r.code == 2 and "</nope>" in r.err
    r = cli("prepare", tmp_path / "a.txt", "--tokenizer", tmp_path / "missing.json", "-o", tmp_path / "x")
    assert r.code == 2 and "missing.json" in r.err
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    r = cli(
        "prepare",
        tmp_path / "a.txt",
        "--tokenizer",
        tmp_path / "bad.json",
        "--eos",
        "1",
        "-o",
        tmp_path / "x",
    )
    assert r.code == 2 and "bad.json" in r.err
    assert not (tmp_path / "x").exists()


def test_stdlib_sources_as_a_real_corpus(cli, tmp_path: Path) -> None:
    import sysconfig

    package = Path(sysconfig.get_paths()["stdlib"]) / "json"
    files = sorted(package.rglob("*.py"), key=lambda p: p.relative_to(package).as_posix())
    assert len(files) >= 4
    r = cli(
        "prepare",
        package,
        "--include",
        "*.py",
        "-o",
        tmp_path / "std",
        "--workers",
        "2",
        "--document-ids",
        "--task-size",
        "8KiB",
    )
    assert r.code == 0, r
    assert byte_texts(tmp_path / "std") == [f.read_text(encoding="utf-8") for f in files]
    r = cli("inspect", tmp_path / "std", "--tokenizer", "bytes", "--samples", "2")
    assert r.code == 0, r
    first = files[0].read_text(encoding="utf-8")
    assert repr(first[:50])[:-1] in r.out
    assert cli("verify", tmp_path / "std").code == 0
    r = cli("bench", tmp_path / "std", "--sequence-length", "256", "--batch-size", "4", "--batches", "5")
    assert r.code == 0, r
    assert "tokens/s" in r.out


def test_empty_input_writes_an_empty_dataset(cli, tmp_path: Path) -> None:
    (tmp_path / "e.jsonl").write_text("\n\n")
    r = cli("prepare", tmp_path / "e.jsonl", "-o", tmp_path / "ds")
    assert r.code == 0, r
    m = manifest_of(tmp_path / "ds")
    assert m["num_elements"] == 0 and m["info"]["documents"] == 0


def test_python_dash_m_runs_the_same_command_line() -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "guideloom", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("guideloom ")


def test_counts_of_one_are_written_in_the_singular(cli, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a", encoding="utf-8")
    r = cli("prepare", tmp_path / "a.txt", "--output", tmp_path / "ds", "--no-eos")
    assert r.code == 0, r
    assert ": 1 token (uint8), 1 document from 1 file, 1 data file (" in r.out
    r = cli("bench", tmp_path / "ds", "--sequence-length", 4)
    assert r.code == 1 and "the stream holds 1 token, fewer than one sample" in r.err
    r = cli("prepare", tmp_path / "a.txt", "--output", tmp_path / "x", "--task", 1, "--tasks", 1)
    assert r.code == 2 and "is not one of the 1 task (0 to 0)" in r.err
