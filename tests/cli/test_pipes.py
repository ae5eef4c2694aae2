"""Output piped into a reader that stops early: the command ends quietly with 141 (128 + SIGPIPE,
as a shell reports for ``cat`` ended by the signal), with nothing on stderr; a broken pipe that
is not stdout's is still an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from guideloom._cli import EXIT_CLOSED_PIPE, _inspect

LONG = 1000  # characters of each sample shown: the output is far more than a pipe's buffer


def _guideloom(*args: object) -> list[str]:
    return [sys.executable, "-m", "guideloom", *map(str, args)]


def _env(*, buffered: bool) -> dict[str, str]:
    """A fresh interpreter that imports this checkout's guideloom, warnings as errors;
    ``buffered``: its stdout block-buffered, as a program's is when it writes to a pipe."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONWARNINGS": "error"}
    if buffered:
        env.pop("PYTHONUNBUFFERED", None)
    else:
        env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " + "x" * LONG for i in range(300)]}), path)
    return path


@pytest.mark.parametrize("buffered", [True, False])
def test_inspect_into_head_ends_quietly(texts: Path, buffered: bool) -> None:
    """``guideloom inspect ... | head -n 2``: head exits after two lines while inspect still
    writes (300 samples of 1,000 characters, several pipe buffers)."""
    args = _guideloom("inspect", texts, "--samples", "300", "--chars", LONG)
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(buffered=buffered)
    ) as writer:
        assert writer.stdout is not None and writer.stderr is not None
        head = subprocess.run(
            ["head", "-n", "2"], check=False, stdin=writer.stdout, capture_output=True, timeout=60
        )
        writer.stdout.close()  # head's end is the only reader left: it is gone
        err = writer.stderr.read().decode()
        status = writer.wait(timeout=60)
    lines = head.stdout.decode().splitlines()
    assert lines == [f"dataset:    {texts}", lines[1]] and lines[1].startswith("kind:       parquet")
    assert err == ""
    assert status == EXIT_CLOSED_PIPE == 141


@pytest.mark.parametrize("buffered", [True, False])
def test_a_pipe_closed_before_the_command_writes_ends_it_quietly(texts: Path, buffered: bool) -> None:
    """The reader gone before the first write, and the output (one sample) small enough to wait
    in stdout's buffer where it is buffered: the write fails at the flush, which would otherwise
    come at the interpreter's exit (``Exception ignored ... BrokenPipeError``, status 120)."""
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run(
            _guideloom("inspect", texts, "--samples", "1"),
            stdout=write,
            stderr=subprocess.PIPE,
            env=_env(buffered=buffered),
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert out.stderr.decode() == ""
    assert out.returncode == EXIT_CLOSED_PIPE


def test_a_broken_pipe_that_is_not_stdouts_is_an_error(
    cli, texts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def breaks(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe (a worker's)")

    monkeypatch.setattr(_inspect, "run_inspect", breaks)
    r = cli("inspect", texts)
    assert r.code == 1 and r.err == "guideloom: error: [Errno 32] Broken pipe (a worker's)\n", r
