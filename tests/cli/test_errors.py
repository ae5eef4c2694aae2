"""Bad input, existing destinations, interrupted runs, missing extras, exit codes."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import guideloom as gl
from guideloom._cli import _tokenizers
from tests.support.cli import byte_texts, manifest_of, write_jsonl


def _jsonl_with_bad_line(path: Path, bad_line: int, total: int = 40, compress: bool = False) -> list[str]:
    lines, good = [], []
    for i in range(1, total + 1):
        if i == bad_line:
            lines.append('{"text": "broken, no closing quote}')
        else:
            text = f"line {i} " + "z" * (i % 7)
            good.append(text)
            lines.append(json.dumps({"text": text}))
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return good


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("compress", [False, True])
def test_malformed_json_line_names_file_and_line(cli, tmp_path: Path, workers: str, compress: bool) -> None:
    # small tasks, so the bad line sits in a later task: its number must still be absolute
    name = "data.jsonl.gz" if compress else "data.jsonl"
    good = _jsonl_with_bad_line(tmp_path / name, bad_line=29, compress=compress)
    r = cli("prepare", tmp_path / name, "-o", tmp_path / "ds", "--workers", workers, "--task-size", "100")
    assert r.code == 1, r
    assert f"{tmp_path / name}:29: invalid JSON" in r.err
    assert "--skip-invalid" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "ds" / "manifest.json").exists()
    assert not list((tmp_path / "ds").glob("*.bin")), "a failed write leaves no data files"

    r = cli(
        "prepare",
        tmp_path / name,
        "-o",
        tmp_path / "ds",
        "--workers",
        workers,
        "--task-size",
        "100",
        "--skip-invalid",
    )
    assert r.code == 0, r
    assert "skipped 1 invalid line, row or file (--skip-invalid)" in r.out
    assert byte_texts(tmp_path / "ds") == good
    info = manifest_of(tmp_path / "ds")["info"]
    assert info["skipped_invalid"] == 1 and info["documents"] == len(good)


def test_lines_without_text_are_invalid(cli, tmp_path: Path) -> None:
    rows = [
        '{"text": "ok"}',
        '["a list"]',
        '{"body": "no text field"}',
        '{"text": 3}',
        '{"text": "\\ud800"}',
        "",
        "   ",
        '{"text": "fine"}',
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "ds")
    assert r.code == 1 and f"{tmp_path / 'd.jsonl'}:2: not a JSON object" in r.err
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "ds", "--skip-invalid")
    assert r.code == 0, r
    assert byte_texts(tmp_path / "ds") == ["ok", "fine"]  # blank lines are neither documents nor errors
    assert manifest_of(tmp_path / "ds")["info"]["skipped_invalid"] == 4
    (tmp_path / "s.jsonl").write_text('{"text": "ok"}\n{"text": "\\ud800 lone surrogate"}\n')
    r = cli("prepare", tmp_path / "s.jsonl", "-o", tmp_path / "ds2")
    assert r.code == 1 and f"{tmp_path / 's.jsonl'}:2: text that UTF-8 cannot encode" in r.err


def test_missing_field_message_suggests_field(cli, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"content": "x"}])
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "ds")
    assert r.code == 1 and "no 'text' field" in r.err and "--field" in r.err


def test_bad_utf8_text_file_and_parquet_nulls(cli, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("good")
    (tmp_path / "b.txt").write_bytes(b"bad \xff\xfe bytes")
    r = cli("prepare", tmp_path, "-o", tmp_path / "ds")
    assert r.code == 1 and f"{tmp_path / 'b.txt'}: not valid UTF-8 text (byte 4" in r.err
    assert "a binary file?" in r.err and "--include" in r.err and "--skip-invalid" in r.err
    r = cli("prepare", tmp_path / "a.txt", tmp_path / "b.txt", "-o", tmp_path / "ds", "--skip-invalid")
    assert r.code == 0 and byte_texts(tmp_path / "ds") == ["good"]

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "p.parquet")
    r = cli("prepare", tmp_path / "p.parquet", "-o", tmp_path / "pq")
    assert r.code == 1 and "row 1" in r.err and "null" in r.err
    r = cli("prepare", tmp_path / "p.parquet", "-o", tmp_path / "pq", "--field", "nope")
    assert r.code == 1 and "no column 'nope'" in r.err


def test_missing_inputs_are_usage_errors(cli, tmp_path: Path) -> None:
    r = cli("prepare", tmp_path / "nope.jsonl", "-o", tmp_path / "ds")
    assert r.code == 2 and "no such file" in r.err
    r = cli("prepare", str(tmp_path / "*.jsonl"), "-o", tmp_path / "ds")
    assert r.code == 2 and "matches no files" in r.err
    (tmp_path / "empty").mkdir()
    r = cli("prepare", tmp_path / "empty", "-o", tmp_path / "ds")
    assert r.code == 2 and "--include" in r.err
    r = cli("prepare", tmp_path / "empty")  # no --output: argparse's own usage error
    assert r.code == 2 and "--output" in r.err


def test_empty_output_is_a_usage_error(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an empty DEST would be the current folder: a mistake (an unset variable), not a wish
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for dest in ("", "file://"):
        r = cli("prepare", tmp_path / "a.txt", "-o", dest)
        assert r.code == 2, (dest, r)
        assert "argument -o/--output: " in r.err and "empty" in r.err and "Traceback" not in r.err
        assert list((tmp_path / "cwd").iterdir()) == [], "nothing is written to the current folder"
    r = cli("prepare", tmp_path / "a.txt", "-o", ".")  # the current folder, when meant, is "."
    assert r.code == 0, r
    assert (tmp_path / "cwd" / "manifest.json").exists()


def test_existing_destination_needs_overwrite(cli, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first")
    assert cli("prepare", tmp_path / "a.txt", "-o", tmp_path / "ds").code == 0
    old_files = sorted(p.name for p in (tmp_path / "ds").glob("*.bin"))
    (tmp_path / "a.txt").write_text("second")
    r = cli("prepare", tmp_path / "a.txt", "-o", tmp_path / "ds")
    assert r.code == 1 and "already exists" in r.err and "--overwrite" in r.err
    assert byte_texts(tmp_path / "ds") == ["first"]
    r = cli("prepare", tmp_path / "a.txt", "-o", tmp_path / "ds", "--overwrite")
    assert r.code == 0, r
    assert byte_texts(tmp_path / "ds") == ["second"]
    assert not set(old_files) & {p.name for p in (tmp_path / "ds").glob("*.bin")}, (
        "replaced files are removed"
    )
    (tmp_path / "file").write_text("x")
    r = cli("prepare", tmp_path / "a.txt", "-o", tmp_path / "file")
    assert r.code == 1 and "not a folder" in r.err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_interrupted_run_leaves_no_dataset_and_reruns(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: str
) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i} " * 20} for i in range(300)])
    calls = {"n": 0}
    real = _tokenizers.ByteTokenizer.encode_many

    def interrupting(self, texts):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, texts)

    # --workers 1 tokenizes in a thread of this process, where the patch applies; worker processes
    # do not see it, so with --workers 2 the interrupt comes from the main process's progress
    # callback, mid-write, instead
    monkeypatch.setattr(_tokenizers.ByteTokenizer, "encode_many", interrupting)
    if workers == "2":
        from guideloom._cli import _common

        updates = {"n": 0}
        real_update = _common.Progress.update

        def interrupting_update(self, nbytes, **counts):
            updates["n"] += 1
            if updates["n"] == 5:
                raise KeyboardInterrupt
            real_update(self, nbytes, **counts)

        monkeypatch.setattr(_common.Progress, "update", interrupting_update)
    r = cli(
        "prepare",
        tmp_path / "d.jsonl",
        "-o",
        tmp_path / "ds",
        "--task-size",
        "1KiB",
        "--shard-size",
        "2KiB",
        "--workers",
        workers,
    )
    assert r.code == 130, r
    assert "interrupted" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "ds" / "manifest.json").exists()
    assert not list((tmp_path / "ds").glob("*.bin"))
    with pytest.raises(FileNotFoundError):
        gl.open_stream(tmp_path / "ds")
    monkeypatch.undo()
    r = cli("prepare", tmp_path / "d.jsonl", "-o", tmp_path / "ds")  # no --overwrite needed
    assert r.code == 0, r
    assert len(byte_texts(tmp_path / "ds")) == 300


KILLED_RUN = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from guideloom._cli import _tokenizers, main

    real = _tokenizers.ByteTokenizer.encode_many
    calls = [0]

    def slow(self, texts):
        calls[0] += 1
        if calls[0] == 4:
            Path(sys.argv[1]).write_text("writing")
            time.sleep(60)  # killed here, with data files half written
        return real(self, texts)

    _tokenizers.ByteTokenizer.encode_many = slow
    sys.exit(main(sys.argv[2:]))
    """
)


def test_killed_run_leaves_no_dataset_and_reruns(cli, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i} " * 50} for i in range(400)])
    ready = tmp_path / "ready"
    dest = tmp_path / "ds"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            KILLED_RUN,
            ready,
            "prepare",
            tmp_path / "d.jsonl",
            "-o",
            dest,
            "--task-size",
            "4KiB",
            "--shard-size",
            "4KiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)
        assert list(dest.glob("tokens-*.bin")), "the run should have started writing data files"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (dest / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="interrupted"):
        gl.open_stream(dest)
    r = cli("inspect", dest)
    assert r.code == 1 and "no dataset" in r.err
    r = cli("prepare", tmp_path / "d.jsonl", "-o", dest)
    assert r.code == 0, r
    assert len(byte_texts(dest)) == 400
    assert cli("verify", dest).code == 0


def test_missing_extra_names_the_pip_line(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # "not installed"
    r = cli("prepare", tmp_path / "d.jsonl.zst", "-o", tmp_path / "ds")
    assert r.code == 1 and 'pip install "guideloom[cli]"' in r.err and "zstandard" in r.err
    monkeypatch.setitem(sys.modules, "tqdm", None)
    (tmp_path / "a.txt").write_text("x")
    r = cli("prepare", tmp_path / "a.txt", "-o", tmp_path / "ds", "--progress")
    assert r.code == 1 and 'pip install "guideloom[cli]"' in r.err
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    (tmp_path / "tok.json").write_text("{}")
    r = cli(
        "prepare",
        tmp_path / "a.txt",
        "-o",
        tmp_path / "ds",
        "--tokenizer",
        tmp_path / "tok.json",
        "--eos",
        "1",
    )
    assert r.code == 1 and 'pip install "guideloom[tokenizers]"' in r.err
    assert "Traceback" not in r.err and "ModuleNotFoundError" not in r.err


def test_missing_pyarrow_and_tokenizers_name_their_extra(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "p.parquet")
    (tmp_path / "a.txt").write_text("hello")
    assert cli("prepare", tmp_path / "a.txt", "-o", tmp_path / "ds").code == 0
    (tmp_path / "tok.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    r = cli("prepare", tmp_path / "p.parquet", "-o", tmp_path / "pq")
    assert r.code == 1 and "'pyarrow' package" in r.err and 'pip install "guideloom[cli]"' in r.err
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    r = cli("inspect", tmp_path / "ds", "--tokenizer", tmp_path / "tok.json")
    assert r.code == 1 and 'pip install "guideloom[tokenizers]"' in r.err
    assert r.err.count("\n") == 1 and r.err.startswith("guideloom: error:")


def test_corrupt_compressed_input_is_a_data_error(cli, tmp_path: Path) -> None:
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-20])
    r = cli("prepare", tmp_path / "d.jsonl.gz", "-o", tmp_path / "ds")
    assert r.code == 1 and "d.jsonl.gz" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "ds" / "manifest.json").exists()


def _zstd_frames(data: bytes, pieces: int) -> bytes:
    """``data`` as ``pieces`` consecutive zstd frames (as ``cat a.zst b.zst`` makes)."""
    import zstandard

    step = -(-len(data) // pieces)
    cctx = zstandard.ZstdCompressor()
    return b"".join(cctx.compress(data[i : i + step]) for i in range(0, len(data), step))


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("name", ["d.jsonl.zst", "d.txt.zst", "d.parquet.zst"])
@pytest.mark.parametrize("cut", ["half", "last byte", "second frame"])
def test_truncated_zstd_input_is_a_data_error(cli, tmp_path: Path, name: str, cut: str, workers: str) -> None:
    # zstandard's stream reader ends quietly where a cut file ends: the frame must be seen to end
    if name.startswith("d.parquet"):
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(2000)]}), buf)
        raw = buf.getvalue()
    else:
        raw = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(2000)).encode()
    whole = _zstd_frames(raw, 2)
    first = len(_zstd_frames(raw, 2)) - len(_zstd_frames(raw[-(-len(raw) // 2) :], 1))
    size = {"half": first // 2, "last byte": len(whole) - 1, "second frame": first + 10}[cut]
    (tmp_path / name).write_bytes(whole[:size])
    r = cli("prepare", tmp_path / name, "-o", tmp_path / "ds", "--workers", workers, "--task-size", "4096")
    assert r.code == 1, r
    assert r.err.startswith("guideloom: error:") and str(tmp_path / name) in r.err, r
    message = r.err.replace(str(tmp_path), "")
    assert "truncated" in message and "Traceback" not in r.err and r.err.count("\n") == 1, r
    assert not (tmp_path / "ds" / "manifest.json").exists()
    # the whole file reads
    (tmp_path / name).write_bytes(whole)
    r = cli("prepare", tmp_path / name, "-o", tmp_path / "ok", "--workers", workers)
    assert r.code == 0, r
    assert manifest_of(tmp_path / "ok")["info"]["documents"] == (1 if "txt" in name else 2000)


@pytest.mark.parametrize("name", ["d.jsonl.zst", "d.txt.zst", "d.parquet.zst"])
@pytest.mark.parametrize("content", ["plain text", "zstd then junk"])
def test_input_that_is_not_zstd_is_a_data_error(cli, tmp_path: Path, name: str, content: str) -> None:
    plain = b'{"text": "not compressed at all"}\n' * 50
    data = plain if content == "plain text" else _zstd_frames(plain, 1) + b"junk after the frame" * 3
    (tmp_path / name).write_bytes(data)
    r = cli("prepare", tmp_path / name, "-o", tmp_path / "ds")
    assert r.code == 1, r
    assert r.err.startswith("guideloom: error:") and str(tmp_path / name) in r.err, r
    assert "zstd" in r.err.replace(str(tmp_path), ""), r
    assert "Traceback" not in r.err and r.err.count("\n") == 1, r
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_console_script_errors_have_no_traceback(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("guideloom")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "guideloom"]
    out = subprocess.run(
        [*cmd, "prepare", str(tmp_path / "missing"), "-o", str(tmp_path / "ds")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("guideloom: error:") and "Traceback" not in out.stderr
    out = subprocess.run([*cmd, "verify", str(tmp_path)], capture_output=True, text=True, check=False)
    assert out.returncode == 1 and "no dataset" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([*cmd, "frobnicate"], capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_binary_input_is_one_error_line_in_a_fresh_process(tmp_path: Path, workers: str) -> None:
    # A fresh interpreter: with one worker no process pool is ever made, so the error path must
    # not rely on concurrent.futures.process having been imported by someone else.
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 8)
    args = ["prepare", str(tmp_path / "blob.bin"), "-o", str(tmp_path / "ds"), "--workers", workers]
    out = subprocess.run(
        [sys.executable, "-m", "guideloom", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=False,
        timeout=60,
    )
    assert out.returncode == 1, out
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"guideloom: error: {tmp_path / 'blob.bin'}: not valid UTF-8 text (byte 128")
    assert "a binary file?" in lines[0] and "--skip-invalid" in lines[0]
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_non_utf8_json_line_and_byte_order_mark(cli, tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n{"text": "fine"}\n')
    r = cli("prepare", tmp_path / "bad.jsonl", "-o", tmp_path / "ds")
    assert r.code == 1 and f"{tmp_path / 'bad.jsonl'}:2: invalid JSON" in r.err
    r = cli("prepare", tmp_path / "bad.jsonl", "-o", tmp_path / "ds", "--skip-invalid")
    assert r.code == 0 and byte_texts(tmp_path / "ds") == ["ok", "fine"]
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    r = cli("prepare", tmp_path / "bom.jsonl", "-o", tmp_path / "bom")
    assert r.code == 0, r
    assert byte_texts(tmp_path / "bom") == ["first", "second"]


@pytest.mark.parametrize(
    "damage", [b"[" * 100_000, b'{"format": "guideloom-dataset", "format_version": ' + b"7" * 5000 + b"}"]
)
def test_verify_and_inspect_of_a_hostile_manifest_are_one_error_line(
    cli, tmp_path: Path, damage: bytes
) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "manifest.json").write_bytes(damage)
    for command in ("verify", "inspect"):
        r = cli(command, tmp_path / "ds")
        assert r.code == 1, r
        assert (
            r.err.startswith(f"guideloom: error: {tmp_path / 'ds' / 'manifest.json'}")
            and r.err.count("\n") == 1
        )
        assert "Traceback" not in r.err and "RecursionError" not in r.err
