"""``prepare --engine ray`` and the Ray datasink, on a real local Ray cluster (2 CPUs)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import guideloom as gl  # noqa: E402
from tests.cli.test_prepare_tasks import samples, write_corpus  # noqa: E402
from tests.support.cli import Run, manifest_of  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    # Ray Data's DataContext warns about its own deprecated fields when it builds itself
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]
Cli = Callable[..., Run]


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize(
    ("read_as", "options"), [("stream", ["--document-ids"]), ("documents", ["--kind", "documents"])]
)
@pytest.mark.slow
def test_ray_tasks_write_the_one_machine_dataset(
    cli: Cli, tmp_path: Path, read_as: str, options: list[str]
) -> None:
    corpus = write_corpus(
        tmp_path / "c", [("jsonl", list(range(0, 900, 2))), ("gz", [3, 0, 5]), ("txt", [9])]
    )
    common = ["--task-size", "2048", *options]
    assert cli("prepare", corpus, "--output", tmp_path / "one", "--quiet", *common).code == 0
    r = cli("prepare", corpus, "--output", tmp_path / "ray", "--engine", "ray", "--tasks", 5, *common)
    assert r.code == 0, r
    assert "with 5 Ray tasks" in r.out
    assert samples(tmp_path / "ray", read_as) == samples(tmp_path / "one", read_as)
    assert manifest_of(tmp_path / "ray")["info"]["parts"]["tasks"] == 5
    assert cli("verify", tmp_path / "ray", "--quiet").code == 0
    # run again: every part is finished, so no task prepares anything
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "ray" / "parts").rglob("*.bin")}
    r = cli(
        "prepare", corpus, "--output", tmp_path / "ray", "--engine", "ray", "--tasks", 5, "--quiet", *common
    )
    assert r.code == 0, r
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "ray" / "parts").rglob("*.bin")} == before


def test_ray_tasks_default_to_the_cluster_cpus(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(100)))])
    r = cli("prepare", corpus, "--output", tmp_path / "ray", "--engine", "ray", "--task-size", 512)
    assert r.code == 0, r
    assert sorted(p.name for p in (tmp_path / "ray" / "parts").iterdir()) == [
        "part-00000-of-00002",
        "part-00001-of-00002",
    ]


def test_bad_input_fails_the_run_with_its_message(cli: Cli, tmp_path: Path) -> None:
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "fine"}\n' * 50 + "{not json\n", encoding="utf-8")
    r = cli(
        "prepare", corpus, "--output", tmp_path / "ray", "--engine", "ray", "--tasks", 2, "--task-size", 256
    )
    assert r.code == 1
    assert "invalid JSON" in r.err and "--skip-invalid" in r.err
    assert not (tmp_path / "ray" / "manifest.json").exists()
    r = cli("prepare", corpus, "--output", tmp_path / "x", "--engine", "ray", "--task", 0, "--tasks", 2)
    assert r.code == 2 and "not --task" in r.err


def _rows(lengths: list[int]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(len(lengths))
    return [{"tokens": rng.integers(0, 60_000, n).astype(np.uint16).tolist()} for n in lengths]


@pytest.mark.parametrize("kind", ["stream", "documents"])
@pytest.mark.slow
def test_the_datasink_writes_one_manifest_over_its_parts(tmp_path: Path, kind: str) -> None:
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    rows = _rows([5, 0, 17, 3, 200, 1, 64, 9, 33])
    ds = ray.data.from_items(rows, override_num_blocks=4)
    manifest = gl.write_ray_dataset(ds, str(tmp_path / "ds"), dtype="uint16", kind=kind)
    assert manifest.extra["parts"]["tasks"] >= 2  # several write tasks, one manifest
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["manifest.json", "parts"]
    docs = [np.asarray(r["tokens"], dtype=np.uint16) for r in rows]
    if kind == "stream":
        gl.write_stream(tmp_path / "want", np.concatenate(docs))
    else:
        gl.write_documents(tmp_path / "want", docs)
    assert samples(tmp_path / "ds", kind, window=3) == samples(tmp_path / "want", kind, window=3)
    gl.verify_dataset(tmp_path / "ds")
    with pytest.raises(FileExistsError):
        gl.write_ray_dataset(ds, str(tmp_path / "ds"), dtype="uint16", kind=kind)


def test_the_datasink_names_a_missing_column(tmp_path: Path) -> None:
    ds = ray.data.from_items([{"ids": [1, 2]}])
    with pytest.raises(Exception, match="no column 'tokens'"):
        gl.write_ray_dataset(ds, str(tmp_path / "ds"), dtype="uint16")


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor``'s descendant (Linux: the parents in /proc)."""
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid == ancestor:
            return True
    return False


def _kill_a_running_task(stop: threading.Event) -> int | None:
    """SIGKILL the first Ray worker of this process's Ray seen running a prepare task (its
    process title is ``ray::_task`` while it runs one; another test process's Ray is left
    alone); its pid, or None if none was seen before ``stop``."""
    me = os.getpid()
    while not stop.is_set():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                title = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::_task") and _descends_from(int(entry.name), me):
                os.kill(int(entry.name), signal.SIGKILL)
                return int(entry.name)
        time.sleep(0.02)
    return None


@pytest.mark.parametrize("retries", [2, 0])
def test_a_task_whose_worker_dies_is_run_again(cli: Cli, tmp_path: Path, retries: int) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", [400 + i % 300 for i in range(6000)])])
    common = ["--task-size", "65536", "--kind", "documents"]
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        killer = pool.submit(_kill_a_running_task, stop)
        r = cli(
            "prepare", corpus, "--output", tmp_path / "ray", "--engine", "ray", "--tasks", 2,
            "--retries", retries, *common,
        )  # fmt: skip
        stop.set()
        killed = killer.result()
    assert killed is not None, "no task was seen running"
    if retries == 0:
        assert r.code == 1 and "a Ray task failed 1 time (" in r.err, r
        assert not (tmp_path / "ray" / "manifest.json").exists()
        return
    assert r.code == 0, r
    assert cli("prepare", corpus, "--output", tmp_path / "one", "--quiet", *common).code == 0
    assert samples(tmp_path / "ray", "documents") == samples(tmp_path / "one", "documents")
    assert cli("verify", tmp_path / "ray", "--quiet").code == 0
