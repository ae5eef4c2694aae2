"""``prepare --task I --tasks N`` and ``--merge``: the same dataset for any N, reruns, refusals."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._cli import _prepare_task
from guideloom._cli._inputs import InputFile, share_of
from guideloom._cli._parts import task_from_environment
from tests.support.cli import Run, field_of, manifest_of

Cli = Callable[..., Run]


def samples(dest: Path | str, kind: str, window: int = 7) -> list[Any]:
    """Everything a loader can read: every window of ``window`` tokens (all fields) of a stream,
    every document and the offsets of a document dataset, through the storage readers."""

    async def read() -> list[Any]:
        if kind == "stream":
            storage = gl.open_stream(str(dest))
            await storage.open()
            n = len(storage)
            out: list[Any] = []
            if n >= window:
                rows = await storage.read_many(np.arange(0, n - window + 1, dtype=np.int64), window)
                out = [r if isinstance(r, dict) else {"tokens": r} for r in rows]
            whole = await storage.read_many(np.zeros(1, np.int64), n) if n else []
            await storage.close()
            return [{k: np.asarray(v).tolist() for k, v in r.items()} for r in out] + [
                {k: np.asarray(v).tolist() for k, v in (r if isinstance(r, dict) else {"tokens": r}).items()}
                for r in whole
            ]
        docs = gl.open_documents(str(dest))
        await docs.open()
        n = len(docs)
        got = [d.tolist() for d in await docs.read_many(np.arange(n, dtype=np.int64))]
        offsets = (await docs.document_offsets(np.arange(n + 1, dtype=np.int64))).tolist()
        await docs.close()
        return [got, offsets]

    return asyncio.run(read())


def write_corpus(folder: Path, shape: list[tuple[str, list[int]]]) -> Path:
    """Files in order: ("jsonl" | "gz" | "txt", document lengths)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, (kind, lengths) in enumerate(shape):
        texts = [f"{k}-{i}:" + "abcdéf"[i % 6] * n for i, n in enumerate(lengths)]
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
        if kind == "jsonl":
            (folder / f"{k:03d}.jsonl").write_bytes(lines)
        elif kind == "gz":
            (folder / f"{k:03d}.jsonl.gz").write_bytes(gzip.compress(lines))
        else:
            (folder / f"{k:03d}.txt").write_text(texts[0] if texts else "", encoding="utf-8")
    return folder


def prepare_in_tasks(cli: Cli, corpus: Path, dest: Path, tasks: int, *options: Any) -> None:
    for i in range(tasks):
        r = cli("prepare", corpus, "--output", dest, "--task", i, "--tasks", tasks, "--quiet", *options)
        assert r.code == 0, r
    assert (dest / "manifest.json").exists()  # the last task merged


KINDS = {
    "stream": ("stream", ()),
    "ids": ("stream", ("--document-ids",)),
    "documents": ("documents", ("--kind", "documents")),
}

shapes = st.lists(
    st.tuples(st.sampled_from(["jsonl", "jsonl", "gz", "txt"]), st.lists(st.integers(0, 300), max_size=40)),
    min_size=1,
    max_size=5,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    shape=shapes,
    tasks=st.sampled_from([1, 2, 7, 64]),
    kind=st.sampled_from(sorted(KINDS)),
    task_size=st.sampled_from([512, 4096]),
)
@pytest.mark.slow
def test_any_number_of_tasks_writes_the_one_machine_dataset(
    cli: Cli, tmp_path_factory: pytest.TempPathFactory, shape: Any, tasks: int, kind: str, task_size: int
) -> None:
    tmp = tmp_path_factory.mktemp("tasks")
    corpus = write_corpus(tmp / "corpus", shape)
    read_as, options = KINDS[kind]
    common = ("--task-size", task_size, *options)
    r = cli("prepare", corpus, "--output", tmp / "one", "--quiet", *common)
    assert r.code == 0, r
    prepare_in_tasks(cli, corpus, tmp / "many", tasks, *common)
    assert samples(tmp / "many", read_as) == samples(tmp / "one", read_as)
    one, many = manifest_of(tmp / "one"), manifest_of(tmp / "many")
    assert many["num_elements"] == one["num_elements"]
    assert many.get("num_documents") == one.get("num_documents")
    for key in ("documents", "tokens", "source_files"):
        assert many["info"][key] == one["info"][key]
    part0 = manifest_of(tmp / "many" / "parts" / f"part-00000-of-{tasks:05d}")["info"]["part"]
    assert many["info"]["parts"] == {"tasks": tasks, "folder": "parts", "fingerprint": part0["fingerprint"]}
    # the merge names the parts' files where they are: no data file outside parts/
    assert sorted(p.name for p in (tmp / "many").iterdir()) == ["manifest.json", "parts"]
    assert cli("verify", tmp / "many", "--quiet").code == 0


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.slow
def test_the_same_dataset_for_1_2_7_and_64_tasks(cli: Cli, tmp_path: Path, kind: str) -> None:
    shape = [("jsonl", [i * 7 % 250 for i in range(120)]), ("gz", [5, 0, 40]), ("txt", [3]), ("jsonl", [])]
    corpus = write_corpus(tmp_path / "corpus", shape)
    read_as, options = KINDS[kind]
    common = ("--task-size", 1024, *options)
    assert cli("prepare", corpus, "--output", tmp_path / "one", "--quiet", *common).code == 0
    want = samples(tmp_path / "one", read_as)
    for tasks in (1, 2, 7, 64):
        prepare_in_tasks(cli, corpus, tmp_path / f"n{tasks}", tasks, *common)
        assert samples(tmp_path / f"n{tasks}", read_as) == want, tasks


def test_a_share_is_consecutive_pieces_and_all_shares_are_the_inputs() -> None:
    files = [
        InputFile(Path("a.jsonl"), "jsonl", None, 10_000),
        InputFile(Path("b.jsonl.gz"), "jsonl", "gzip", 3_000),
        InputFile(Path("c.txt"), "text", None, 10),
        InputFile(Path("d.jsonl"), "jsonl", None, 2_500),
    ]
    for tasks in (1, 2, 3, 7, 64):
        pieces = []
        for t in range(tasks):
            for f in share_of(files, task_bytes=1000, task=t, tasks=tasks):
                a, b = f.span or (0, f.size)
                pieces.append((str(f.path), a, b))
        covered: dict[str, list[tuple[int, int]]] = {}
        order = []
        for name, a, b in pieces:
            if not order or order[-1] != name:
                order.append(name)
            covered.setdefault(name, []).append((a, b))
        assert order == [str(f.path) for f in files]  # the inputs' order, each file's pieces together
        for f in files:
            spans = covered[str(f.path)]
            assert spans[0][0] == 0 and spans[-1][1] == f.size
            assert all(x[1] == y[0] for x, y in itertools.pairwise(spans))
            if f.compression is not None or f.format == "text":
                assert len(spans) == 1  # read whole: a compressed file cannot be cut unread


def test_slurm_array_ids_from_any_offset(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = write_corpus(tmp_path / "corpus", [("jsonl", list(range(0, 400, 7))), ("txt", [5])])
    assert cli("prepare", corpus, "--output", tmp_path / "one", "--quiet", "--task-size", 600).code == 0
    for task_id in (1, 2, 3, 4):  # sbatch --array=1-4
        env = {
            "SLURM_ARRAY_TASK_ID": str(task_id),
            "SLURM_ARRAY_TASK_MIN": "1",
            "SLURM_ARRAY_TASK_MAX": "4",
            "SLURM_ARRAY_TASK_COUNT": "4",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        r = cli("prepare", corpus, "--output", tmp_path / "many", "--quiet", "--task-size", 600)
        assert r.code == 0, r
        assert (tmp_path / "many" / "parts" / f"part-{task_id - 1:05d}-of-00004" / "manifest.json").exists()
    assert samples(tmp_path / "many", "stream") == samples(tmp_path / "one", "stream")


def test_slurm_arrays_that_are_not_one_range_are_refused() -> None:
    assert task_from_environment({}) is None
    ok = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "5", "SLURM_ARRAY_TASK_COUNT": "4"}
    slot = task_from_environment(ok)
    assert slot is not None and (slot.task, slot.tasks) == (2, 4)
    stepped = {**ok, "SLURM_ARRAY_TASK_MAX": "11"}  # --array=5-11:2: 4 tasks, ids 5 7 9 11
    with pytest.raises(Exception, match="not one contiguous range"):
        task_from_environment(stepped)


def test_options_that_do_not_go_together_are_refused(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", [3, 4])])
    r = cli("prepare", corpus, "--output", tmp_path / "x", "--tasks", 3)
    assert r.code == 2 and "--task I and --tasks N go together" in r.err
    r = cli("prepare", corpus, "--output", tmp_path / "x", "--task", 3, "--tasks", 3)
    assert r.code == 2 and "not one of the 3 tasks" in r.err
    r = cli("prepare", corpus, "--merge", tmp_path / "x")
    assert r.code == 2 and "takes no inputs" in r.err
    r = cli("prepare", "--merge", tmp_path / "x")
    assert r.code == 1 and "holds no prepared parts" in r.err


def test_a_rerun_prepares_only_the_unfinished_parts(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(300))), ("txt", [10])])
    dest = tmp_path / "ds"
    options = ("--task-size", 2048, "--kind", "documents")
    for i in (0, 1, 3):  # task 2 never ran; task 3 was interrupted (no manifest, a stray file)
        assert cli("prepare", corpus, "--output", dest, "--task", i, "--tasks", 4, *options).code == 0
    interrupted = dest / "parts" / "part-00003-of-00004"
    (interrupted / "manifest.json").unlink()
    (interrupted / "tokens-deadbeef-00000.bin").write_bytes(b"half")
    r = cli("prepare", "--merge", dest)
    assert r.code == 1 and "2 of the 4 parts are missing or unfinished (tasks 2, 3" in r.err
    assert not (dest / "manifest.json").exists()
    before = {p: p.stat().st_mtime_ns for p in (dest / "parts" / "part-00000-of-00004").iterdir()}
    for i in range(4):
        r = cli("prepare", corpus, "--output", dest, "--task", i, "--tasks", 4, *options)
        assert r.code == 0, r
        assert ("already prepared; skipped" in r.out) == (i in (0, 1))
    assert {p: p.stat().st_mtime_ns for p in (dest / "parts" / "part-00000-of-00004").iterdir()} == before
    assert not (interrupted / "tokens-deadbeef-00000.bin").exists()
    assert cli("prepare", corpus, "--output", tmp_path / "one", *options).code == 0
    assert samples(dest, "documents") == samples(tmp_path / "one", "documents")
    assert cli("prepare", "--merge", dest, "--quiet").code == 0  # merging again is harmless


def test_a_part_prepared_with_other_options_is_refused(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(100)))])
    dest = tmp_path / "ds"
    assert cli("prepare", corpus, "--output", dest, "--task", 0, "--tasks", 2, "--quiet").code == 0
    other = ("--task", 1, "--tasks", 2, "--dtype", "uint32", "--quiet")
    r = cli("prepare", corpus, "--output", dest, *other)
    assert r.code == 1, r  # the task writes its part; the merge it attempts says why it cannot
    assert "the parts are not merged yet" in r.err and "dtype: 'uint32' here, 'uint16' in part 0" in r.err
    r = cli("prepare", "--merge", dest)
    assert r.code == 1 and "prepared with other options or inputs than part 0" in r.err
    assert not (dest / "manifest.json").exists()
    # the same task again with part 0's options: refused, its part was prepared otherwise
    r = cli("prepare", corpus, "--output", dest, "--task", 1, "--tasks", 2)
    assert r.code == 1 and "--overwrite" in r.err
    r = cli("prepare", corpus, "--output", dest, "--task", 1, "--tasks", 2, "--overwrite", "--quiet")
    assert r.code == 0 and (dest / "manifest.json").exists()


def test_a_task_does_not_write_over_another_dataset(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", [5, 6])])
    dest = tmp_path / "ds"
    assert cli("prepare", corpus, "--output", dest, "--quiet").code == 0
    r = cli("prepare", corpus, "--output", dest, "--task", 0, "--tasks", 1)
    assert r.code == 1 and "already exists" in r.err
    r = cli("prepare", corpus, "--output", dest, "--task", 0, "--tasks", 1, "--overwrite", "--quiet")
    assert r.code == 0
    assert sorted(p.name for p in dest.iterdir()) == ["manifest.json", "parts"]  # old files removed


def test_verify_refuses_a_damaged_part(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(200)))])
    dest = tmp_path / "ds"
    prepare_in_tasks(cli, corpus, dest, 3, "--task-size", 1024, "--document-ids")
    assert cli("verify", dest, "--quiet").code == 0
    victim = dest / manifest_of(dest)["fields"]["doc_id"]["files"][-1]["path"]
    data = bytearray(victim.read_bytes())
    data[0] ^= 1
    victim.write_bytes(bytes(data))
    r = cli("verify", dest)
    assert r.code == 1 and "does not match its checksum" in r.err and "parts/part-00002-of-00003" in r.err


def test_part_manifests_stay_datasets_of_their_own(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(60)))])
    dest = tmp_path / "ds"
    prepare_in_tasks(cli, corpus, dest, 2, "--task-size", 512, "--kind", "documents")
    merged = samples(dest, "documents")[0]
    parts = sorted((dest / "parts").iterdir())
    got = [d for p in parts for d in samples(p, "documents")[0]]
    assert got == merged
    assert os.path.getsize(dest / "manifest.json") < 64 * 1024


def test_a_bad_line_in_a_share_that_starts_inside_a_file_is_located(cli: Cli, tmp_path: Path) -> None:
    corpus = tmp_path / "c"
    corpus.mkdir()
    lines = [json.dumps({"text": f"line {i} " + "x" * (i % 37)}) for i in range(400)]
    lines[310] = "{broken"
    data = ("\n".join(lines) + "\n").encode()
    (corpus / "a.jsonl").write_bytes(data)
    r = cli("prepare", corpus, "--output", tmp_path / "one")
    assert r.code == 1 and "a.jsonl:311: invalid JSON" in r.err  # one machine: the file's line
    r = cli("prepare", corpus, "--output", tmp_path / "ds", "--task", 1, "--tasks", 2, "--task-size", 1000)
    assert r.code == 1, r
    after = int(r.err.split("starting after byte ")[1].split(" ")[0])
    starts = [0, *[i + 1 for i, b in enumerate(data) if b == ord("\n")][:-1]]
    first = next(k for k, s in enumerate(starts) if s >= after)
    assert f"line {310 - first + 1} of the lines starting after byte {after}" in r.err
    assert "invalid JSON" in r.err


def test_a_task_whose_inputs_changed_under_the_run_fails(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(200)))])
    dest = tmp_path / "ds"
    options = ("--tasks", 2, "--task-size", 1024, "--quiet")
    r = cli("prepare", corpus, "--output", dest, "--task", 0, *options)
    assert r.code == 0 and "not merged" not in r.err  # part 1 not finished yet: waits, exits 0
    write_corpus(corpus, [("jsonl", list(range(150)))])
    r = cli("prepare", corpus, "--output", dest, "--task", 1, *options)
    assert r.code == 1, r  # every part finished, and they disagree: a failed array element
    assert "the parts are not merged yet" in r.err and "prepared with other options or inputs" in r.err
    assert not (dest / "manifest.json").exists()
    # an --overwrite run may find an earlier run's parts its other tasks are preparing again
    r = cli("prepare", corpus, "--output", dest, "--task", 1, *options, "--overwrite")
    assert r.code == 0 and "the parts are not merged yet" in r.err
    r = cli("prepare", corpus, "--output", dest, "--task", 0, *options, "--overwrite")
    assert r.code == 0 and (dest / "manifest.json").exists()
    assert cli("verify", dest, "--quiet").code == 0


def test_a_single_prepare_over_a_merged_dataset_removes_its_parts(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(300)))])
    dest = tmp_path / "ds"
    prepare_in_tasks(cli, corpus, dest, 3, "--task-size", 1024)
    r = cli("prepare", corpus, "--output", dest, "--overwrite", "--quiet")
    assert r.code == 0, r
    assert not (dest / "parts").exists()
    good = (dest / "manifest.json").read_bytes()
    r = cli("prepare", "--merge", dest)
    assert r.code == 1 and "holds no prepared parts" in r.err
    assert (dest / "manifest.json").read_bytes() == good
    assert cli("verify", dest, "--quiet").code == 0


def test_a_single_prepare_does_not_write_over_parts_without_overwrite(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(100)))])
    dest = tmp_path / "ds"
    assert cli("prepare", corpus, "--output", dest, "--task", 0, "--tasks", 2, "--quiet").code == 0
    r = cli("prepare", corpus, "--output", dest)
    assert r.code == 1 and "holds the parts of a run of tasks" in r.err and "--overwrite" in r.err
    assert not (dest / "manifest.json").exists()


def test_the_merge_refuses_part_manifests_whose_data_is_gone(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(300)))])
    dest = tmp_path / "ds"
    prepare_in_tasks(cli, corpus, dest, 3, "--task-size", 1024, "--kind", "documents")
    good = (dest / "manifest.json").read_bytes()
    part = manifest_of(dest / "parts" / "part-00001-of-00003")
    (dest / "parts" / "part-00001-of-00003" / part["fields"]["tokens"]["files"][0]["path"]).unlink()
    r = cli("prepare", "--merge", dest)
    assert r.code == 1, r
    assert "1 data file named by the part manifests is missing (parts/part-00001-of-00003/run-" in r.err
    assert (dest / "manifest.json").read_bytes() == good  # the dataset there is left as it was


@pytest.mark.slow
def test_an_overwrite_run_of_another_n_removes_the_old_runs_parts(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(300)))])
    dest = tmp_path / "ds"
    prepare_in_tasks(cli, corpus, dest, 3, "--task-size", 1024)
    (dest / "parts" / "part-00007-of-00009").mkdir()  # an interrupted task of another run
    run = ("prepare", corpus, "--output", dest, "--tasks", 2, "--task-size", 1024, "--overwrite")
    r = cli(*run, "--task", 1)
    assert r.code == 0, r
    assert sorted(p.name for p in (dest / "parts").iterdir()) == ["part-00001-of-00002"]
    r = cli(*run, "--task", 0)
    assert r.code == 0, r  # task 0 of the same N keeps task 1's part, and merges
    assert sorted(p.name for p in (dest / "parts").iterdir()) == [f"part-0000{i}-of-00002" for i in (0, 1)]
    assert cli("verify", dest, "--quiet").code == 0
    assert cli("prepare", corpus, "--output", tmp_path / "one", "--quiet").code == 0
    assert samples(dest, "stream") == samples(tmp_path / "one", "stream")


def test_half_a_task_inside_a_slurm_array_says_so(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", [3, 4])])
    r = cli("prepare", corpus, "--output", tmp_path / "x", "--tasks", 2)
    assert r.code == 2 and "outside a Slurm array, name both" in r.err
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    r = cli("prepare", corpus, "--output", tmp_path / "x", "--tasks", 2)
    assert r.code == 2 and "inside a Slurm array, name neither" in r.err and "outside" not in r.err


@pytest.mark.parametrize(
    "other",
    [
        ("--task", 0, "--tasks", 1),  # another number of tasks
        ("--task", 1, "--tasks", 3),
        ("--task", 0, "--tasks", 2, "--dtype", "uint32"),  # the same N, other options
        ("--task", 1, "--tasks", 2, "--kind", "documents"),
    ],
)
def test_a_task_of_another_run_does_not_replace_a_merged_dataset(
    cli: Cli, tmp_path: Path, other: tuple[Any, ...]
) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(300)))])
    dest = tmp_path / "ds"
    prepare_in_tasks(cli, corpus, dest, 2, "--task-size", 1024)
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    others = write_corpus(tmp_path / "o", [("jsonl", [3, 4, 5])])
    for inputs in (corpus, others):
        r = cli("prepare", inputs, "--output", dest, "--task-size", 1024, *other)
        assert r.code == 1, r
        assert f"a dataset already exists at {str(dest)!r} (merged from 2 parts of another run" in r.err
        assert "pass --overwrite to replace it" in r.err
        assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before  # nothing altered
    # the inputs changed, the same command: another run too
    r = cli("prepare", others, "--output", dest, "--task-size", 1024, "--task", 0, "--tasks", 2)
    assert r.code == 1 and "of another run" in r.err
    # a rerun of the run that made it: its parts are finished, it merges them again
    r = cli("prepare", corpus, "--output", dest, "--task-size", 1024, "--task", 1, "--tasks", 2)
    assert r.code == 0 and "already prepared; skipped" in r.out, r
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before
    r = cli("prepare", others, "--output", dest, "--task-size", 1024, *other, "--overwrite", "--quiet")
    assert r.code == 0, r


def test_a_task_tells_its_run_by_part_0_where_the_merge_did_not_record_it(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(100)))])
    dest = tmp_path / "ds"
    prepare_in_tasks(cli, corpus, dest, 2, "--task-size", 1024)
    manifest = manifest_of(dest)
    del manifest["info"]["parts"]["fingerprint"]  # as a merge that did not record it wrote it
    (dest / "manifest.json").write_text(json.dumps(manifest))
    r = cli("prepare", corpus, "--output", dest, "--task-size", 1024, "--task", 0, "--tasks", 2)
    assert r.code == 0, r
    r = cli(
        "prepare",
        corpus,
        "--output",
        dest,
        "--task-size",
        1024,
        "--task",
        0,
        "--tasks",
        2,
        "--dtype",
        "uint32",
    )
    assert r.code == 1 and "of another run" in r.err


def race(corpus: Path, dest: Path | str, runs: int, env: dict[str, str] | None = None) -> list[Any]:
    """``runs`` processes of the same task (task 0 of 2) started at once, as a requeued array
    element runs beside the one still running: their exit codes and output."""
    cmd = [sys.executable, "-m", "guideloom", "prepare", str(corpus), "--output", str(dest)]
    cmd += ["--task", "0", "--tasks", "2", "--task-size", "64KiB"]
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(Path(__file__).parents[2])}
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(runs)
    ]
    return [(p.wait(timeout=100), *p.communicate()) for p in procs]


def check_race(results: list[Any], dest: Path | str) -> None:
    """At most one run prepared the part; each other one either failed saying another run
    finished it first, or started after it was finished and skipped it."""
    prepared = [r for r in results if r[0] == 0 and "already prepared; skipped" not in r[1]]
    assert len(prepared) <= 1, results
    for code, _out, err in results:
        if code != 0:
            assert code == 1 and "another run of task 0 of 2 prepared this part at the same time" in err, (
                results
            )
            assert err.count("\n") == 1 and "Traceback" not in err, results
    assert any(code == 0 for code, _, _ in results), results  # someone prepared the part


@pytest.mark.slow
def test_runs_of_one_task_at_once_leave_one_whole_part(cli: Cli, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", [n % 4000 for n in range(0, 6_000_000, 3001)])] * 3)
    assert cli("prepare", corpus, "--output", tmp_path / "one", "--quiet", "--task-size", "64KiB").code == 0
    raced = 0
    for round in range(8):  # until runs met in the act at least once (most rounds they do)
        dest = tmp_path / f"ds{round}"
        results = race(corpus, dest, 3)
        check_race(results, dest)
        raced += any(code != 0 for code, _, _ in results)
        part = dest / "parts" / "part-00000-of-00002"
        winner = manifest_of(part)["fields"]["tokens"]["files"][0]["path"].split("/")[0]
        assert sorted(p.name for p in part.iterdir()) == ["manifest.json", winner]  # losers' copies gone
        r = cli("prepare", corpus, "--output", dest, "--task", 1, "--tasks", 2, "--task-size", "64KiB", "-q")
        assert r.code == 0, r
        assert cli("verify", dest, "--quiet").code == 0
        assert np.array_equal(field_of(dest), field_of(tmp_path / "one"))
        if raced and round >= 1:
            break
    assert raced


def test_a_run_that_finishes_second_removes_its_copy_and_fails(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(300)))])
    dest = tmp_path / "ds"
    command = ("prepare", corpus, "--output", dest, "--task", 0, "--tasks", 2, "--task-size", 1024)
    original = _prepare_task.prepare_files
    other: list[Run] = []
    racing: list[bool] = []

    def first_another_run(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        if not racing:  # while this run writes, another run of the task does the whole task
            racing.append(True)
            other.append(cli(*command, "--quiet"))
        return made

    monkeypatch.setattr(_prepare_task, "prepare_files", first_another_run)
    r = cli(*command)
    assert other[0].code == 0, other
    assert r.code == 1 and "another run of task 0 of 2 prepared this part at the same time" in r.err, r
    part = dest / "parts" / "part-00000-of-00002"
    winner = manifest_of(part)["fields"]["tokens"]["files"][0]["path"].split("/")[0]
    assert sorted(p.name for p in part.iterdir()) == ["manifest.json", winner]
    # also with --overwrite: the part the other run left stays whole
    other.clear()
    racing.clear()
    r = cli(*command, "--overwrite")
    assert r.code == 1 and "finished first" in r.err, r
    assert other[0].code == 0, other
    again = manifest_of(part)["fields"]["tokens"]["files"][0]["path"].split("/")[0]
    assert again != winner and sorted(p.name for p in part.iterdir()) == ["manifest.json", again]
    assert cli(*command[:-4], "--task", 1, "--tasks", 2, "--task-size", 1024, "-q").code == 0
    assert cli("verify", dest, "--quiet").code == 0
    assert cli("prepare", corpus, "--output", tmp_path / "one", "--task-size", 1024, "-q").code == 0
    assert samples(dest, "stream") == samples(tmp_path / "one", "stream")
