"""``prepare --task I --tasks N`` to object storage (a real S3 server on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guideloom._cli import main
from guideloom_dev.servers import MotoS3
from tests.cli.test_prepare_tasks import check_race, race, samples, write_corpus
from tests.support.remote import BUCKET, unique


@pytest.mark.parametrize("kind", ["ids", "documents"])
@pytest.mark.slow
def test_tasks_upload_their_parts_and_the_last_merges(
    s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    corpus = write_corpus(
        tmp_path / "c", [("jsonl", list(range(0, 500, 3))), ("gz", [4, 0, 9]), ("txt", [7])]
    )
    options = ["--task-size", "1024", *(["--document-ids"] if kind == "ids" else ["--kind", "documents"])]
    read_as = "stream" if kind == "ids" else "documents"
    url = f"s3://{BUCKET}/{unique('tasks')}"
    assert main(["prepare", str(corpus), "--output", str(tmp_path / "one"), "--quiet", *options]) == 0
    for i in (0, 2):
        assert (
            main(["prepare", str(corpus), "--output", url, "--task", str(i), "--tasks", "3", "-q", *options])
            == 0
        )
    capsys.readouterr()
    assert main(["prepare", "--merge", url]) == 1
    assert "1 of the 3 parts is missing or unfinished (task 1," in capsys.readouterr().err
    assert main(["prepare", str(corpus), "--output", url, "--task", "1", "--tasks", "3", "-q", *options]) == 0
    assert main(["verify", url, "--quiet"]) == 0
    assert samples(url, read_as) == samples(tmp_path / "one", read_as)
    # a rerun of a finished task skips it
    capsys.readouterr()
    assert main(["prepare", str(corpus), "--output", url, "--task", "0", "--tasks", "3", *options]) == 0
    assert "already prepared; skipped" in capsys.readouterr().out
    assert main(["prepare", "--merge", url, "--quiet"]) == 0
    manifest = json.loads(
        s3.client().get_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/manifest.json")["Body"].read()
    )
    assert all(f["path"].startswith("parts/part-") for f in manifest["fields"]["tokens"]["files"])


def test_an_overwrite_removes_the_parts_it_replaces(
    s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    corpus = write_corpus(tmp_path / "c", [("jsonl", list(range(0, 300, 2)))])
    url = f"s3://{BUCKET}/{unique('overwrite')}"
    prefix = url.split("/", 3)[3]

    def folders() -> set[str]:
        listing = s3.client().get_paginator("list_objects_v2")
        pages = listing.paginate(Bucket=BUCKET, Prefix=f"{prefix}/parts/")
        return {
            o["Key"].split("/")[-3 if "/run-" in o["Key"] else -2]
            for page in pages
            for o in page.get("Contents", [])
        }

    run = ["prepare", str(corpus), "--output", url, "--task-size", "1024", "-q"]
    for i in range(3):
        assert main([*run, "--task", str(i), "--tasks", "3"]) == 0
    assert folders() == {f"part-0000{i}-of-00003" for i in range(3)}
    assert main([*run, "--task", "1", "--tasks", "2", "--overwrite"]) == 0
    assert folders() == {"part-00001-of-00002"}  # another N's parts go; this run's stay
    assert main([*run, "--task", "0", "--tasks", "2", "--overwrite"]) == 0
    assert folders() == {"part-00000-of-00002", "part-00001-of-00002"}
    assert main(["verify", url, "--quiet"]) == 0
    assert main([*run, "--overwrite"]) == 0  # one machine replaces the merged dataset
    assert folders() == set()
    capsys.readouterr()
    assert main(["prepare", "--merge", url]) == 1
    assert "holds no prepared parts" in capsys.readouterr().err
    assert main(["verify", url, "--quiet"]) == 0


@pytest.mark.slow
def test_runs_of_one_task_at_once_leave_one_whole_part_in_a_bucket(s3: MotoS3, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", [("jsonl", [n % 4000 for n in range(0, 3_000_000, 3001)])] * 2)
    assert (
        main(["prepare", str(corpus), "--output", str(tmp_path / "one"), "-q", "--task-size", "64KiB"]) == 0
    )
    raced = 0
    for round in range(8):  # until runs met in the act at least once
        url = f"s3://{BUCKET}/{unique('race')}"
        results = race(corpus, url, 3, env=s3.env())
        check_race(results, url)
        raced += any(code != 0 for code, _, _ in results)
        prefix = url.split("/", 3)[3]
        listing = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/parts/")
        keys = {o["Key"][len(prefix) + 1 :] for o in listing.get("Contents", [])}
        part = json.loads(
            s3.client()
            .get_object(Bucket=BUCKET, Key=f"{prefix}/parts/part-00000-of-00002/manifest.json")["Body"]
            .read()
        )
        files = part["fields"]["tokens"]["files"]
        named = {f"parts/part-00000-of-00002/{f['path']}" for f in files}
        # the block digests of a large file lie beside it (named in its entry)
        named |= {
            f"parts/part-00000-of-00002/{f['blocks']['file']}"
            for f in files
            if isinstance(f.get("blocks"), dict) and "file" in f["blocks"]
        }
        winner = next(iter(named)).split("/")[2]
        # the winner's files, its manifest and its run's own: the losers' copies are gone
        assert keys - named == {
            "parts/part-00000-of-00002/manifest.json",
            f"parts/part-00000-of-00002/{winner}/manifest.json",
        }
        task1 = [
            "prepare",
            str(corpus),
            "--output",
            url,
            "--task",
            "1",
            "--tasks",
            "2",
            "--task-size",
            "64KiB",
        ]
        with pytest.MonkeyPatch.context() as mp:
            for k, v in s3.env().items():
                mp.setenv(k, v)
            assert main([*task1, "-q"]) == 0
            assert main(["verify", url, "--quiet"]) == 0
            assert samples(url, "stream", window=10**9) == samples(tmp_path / "one", "stream", window=10**9)
        if raced and round >= 1:
            break
    assert raced
