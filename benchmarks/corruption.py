"""The corruption fuzzer: damage a dataset, its caches or its parts, and check that no wrong sample
is ever delivered.

    python -m benchmarks faults --trials 2000 --seed 1          # 2,000 random trials, a table
    python -m benchmarks faults --seed 1 --only s3-stream,mid-epoch --trials 200
    python -m benchmarks faults --seed 1 --only local-stream/data/flip/mid-epoch --trial 17

A trial copies a small pristine dataset to a fresh place (a local folder, an S3 prefix on moto, a
folder nginx serves), opens it with the public API in one of the storage and cache modes of
:data:`MODES`, and damages one file of one target (:data:`TARGETS`: the data files, the
manifest, a part's manifest, the files of a cache) in one way (:data:`KINDS`: bit flips, a
truncation, the same bytes of another dataset of the same shape, an append, a deletion) at one
moment (:data:`MOMENTS`: before opening, between epochs, after some batches of an epoch, and for
prepared parts before ``guideloom prepare --merge``). Local files are damaged in place with their
modification time kept, as a disk's bit rot or a copy tool that keeps times would; an object on
S3 is put again. Every batch the loader delivers is compared with the batch at the same epoch
and position over the pristine copy (the order is a pure function of the seed, epoch and
offset). Each trial ends in one of :data:`OUTCOMES`:

- ``correct``: every delivered batch is the pristine one (the damage was never read);
- ``refused``: a guideloom error (``DatasetFormatError``, ``DatasetIntegrityError``,
  ``RemoteReadError``, ...) or ``FileNotFoundError``, with a message of one line, before any wrong
  batch (or the merge exited non-zero with a one-line message);
- ``WRONG``: a batch differed from the pristine one, or an epoch ended short or long: a failure;
- ``unclear``: another exception, or one whose message is not one clear line: a failure;
- ``hang``: the trial ran past its time limit; ``crash``: the process running it died;
- ``no-target``: the target had no file at that moment (a cache not written yet): not counted.

Trials run in child processes (``--jobs``), one trial at a time each, so that a hang or a crash
ends one trial only. Trial ``i`` of seed ``S`` is the same trial under the same ``--only``: its
combination is drawn from those ``--only`` keeps, its damage from ``(S, i)``; with a full
combination key (``mode/target/kind/moment``) as ``--only``, ``--trial i`` re-runs it exactly.
The table gives counts per mode, target, kind and moment; the failures are listed with the
command that re-runs each. The exit status is 1 when any trial failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import summary

ROOT = Path(__file__).resolve().parent.parent

KINDS = ("flip", "truncate", "replace", "append", "delete")
MOMENTS = ("before-open", "between-epochs", "mid-epoch", "before-merge")
OUTCOMES = ("correct", "refused", "WRONG", "unclear", "hang", "crash", "no-target")
FAILURES = ("WRONG", "unclear", "hang", "crash")
EPOCHS = 2
SEED = 3  # the loaders' shuffle seed


@dataclass(frozen=True)
class Mode:
    """One way of storing and opening a dataset: what it holds, where it lies, which cache."""

    name: str
    data: str  # "stream", "documents", "parquet", "pack" (Parquet packed), "prepared"
    place: str  # "local", "s3", "http"
    cache: str = ""  # "", "copy" (cache_dir), "chunks" (cache_dir + cache_max_bytes), "index" (Parquet)
    targets: tuple[str, ...] = ("data", "manifest")


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("local-stream", "stream", "local"),
        Mode("local-documents", "documents", "local"),
        Mode("s3-stream", "stream", "s3"),
        Mode("s3-documents", "documents", "s3"),
        Mode("http-stream", "stream", "http"),
        Mode("s3-stream-copy", "stream", "s3", "copy", ("data", "manifest", "cache")),
        Mode("http-documents-copy", "documents", "http", "copy", ("data", "manifest", "cache")),
        Mode("s3-stream-chunks", "stream", "s3", "chunks", ("data", "manifest", "cache")),
        Mode("s3-documents-chunks", "documents", "s3", "chunks", ("data", "manifest", "cache")),
        Mode("parquet-local", "parquet", "local", "", ("data",)),
        Mode("parquet-local-index", "parquet", "local", "index", ("data", "cache")),
        Mode("parquet-s3", "parquet", "s3", "", ("data",)),
        Mode("parquet-pack-local", "pack", "local", "index", ("data", "cache")),
        Mode("parquet-pack-s3", "pack", "s3", "index", ("data", "cache")),
        Mode("prepared-local", "prepared", "local", "", ("data", "manifest", "part-manifest")),
        Mode("prepared-s3", "prepared", "s3", "", ("data", "manifest", "part-manifest")),
    )
}
TARGETS = ("data", "manifest", "part-manifest", "cache")


def combinations(remote: set[str]) -> list[str]:
    """Every ``mode/target/kind/moment`` key a trial can be, over the places reachable here.

    Left out, as a new dataset rather than a damaged one: replacing a Parquet file before
    opening (another valid Parquet file, and nothing recorded the first but caches keyed by its
    identity), and deleting one from a local folder before opening it (the folder's files are
    the dataset: one fewer is a smaller dataset; a list of URLs names each file, so there a
    deletion is damage); and
    ``before-merge`` outside prepared parts (and for the merged manifest, which the merge writes).
    """
    keys = []
    for mode in MODES.values():
        if mode.place != "local" and mode.place not in remote:
            continue
        for target in mode.targets:
            for kind in KINDS:
                for moment in MOMENTS:
                    if moment == "before-merge" and (mode.data != "prepared" or target == "manifest"):
                        continue
                    if (
                        mode.data in ("parquet", "pack")
                        and target == "data"
                        and moment == "before-open"
                        and (kind == "replace" or (kind == "delete" and mode.place == "local"))
                    ):
                        continue
                    keys.append(f"{mode.name}/{target}/{kind}/{moment}")
    return keys


def select(keys: list[str], only: str) -> list[str]:
    """The keys that contain every comma-separated word of ``only`` (a full key selects itself)."""
    words = [w for w in only.split(",") if w]
    if len(words) == 1 and words[0] in keys:
        return [words[0]]
    return [k for k in keys if all(w in k for w in words)]


@dataclass(frozen=True)
class Trial:
    """One trial: its index, its combination and the seed of its damage."""

    index: int
    key: str
    seed: int


def trial(seed: int, index: int, keys: list[str]) -> Trial:
    """Trial ``index`` of a run seeded ``seed`` over ``keys``: a pure function of the three."""
    choice = np.random.default_rng([seed, index, 1]).integers(len(keys))
    damage = int(np.random.default_rng([seed, index, 2]).integers(2**62))
    return Trial(index, keys[int(choice)], damage)


# -- the pristine data --------------------------------------------------------------------------------
STREAM_TOKENS = 160_000  # shards of 96 KiB: mapped (a local file above 64 KiB is not read whole at open)
DOCUMENTS = 300
PARQUET_ROWS = 400


def build_data(root: Path) -> None:
    """Write every pristine dataset and its twin of the same shape with other tokens (``-alt``)."""
    import guideloom as gl

    lengths = np.random.default_rng(5).integers(1, 80, DOCUMENTS)
    for suffix, seed in (("", 1), ("-alt", 2)):
        rng = np.random.default_rng(seed)
        gl.write_stream(
            root / f"stream{suffix}",
            rng.integers(0, 60_000, STREAM_TOKENS, dtype=np.uint16),
            shard_bytes=96 * 1024,
        )
        mine = lengths if not suffix else rng.permutation(lengths)  # the same total, other offsets
        docs = [rng.integers(0, 60_000, int(n), dtype=np.uint16) for n in mine]
        gl.write_documents(root / f"documents{suffix}", docs, shard_bytes=8192)
        _write_parquet(root / f"parquet{suffix}", seed, root / "parquet" if suffix else None)
        _prepare(root / f"prepared{suffix}", root / f"text{suffix}", seed)


def _write_parquet(folder: Path, seed: int, like: Path | None) -> None:
    """Two files of 200 rows in row groups of 50, with page checksums; with ``like``, files of
    the same sizes as those (another seed is tried until they are)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    lengths = np.random.default_rng(6).integers(1, 60, PARQUET_ROWS)
    for attempt in range(200):
        _write_parquet_files(pa, pq, folder, seed + 1000 * attempt, lengths)
        if like is None or all((folder / p.name).stat().st_size == p.stat().st_size for p in like.iterdir()):
            return
    raise RuntimeError("no Parquet twin of the same size")


def _write_parquet_files(pa: Any, pq: Any, folder: Path, seed: int, lengths: np.ndarray) -> None:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 60_000, int(n)).astype(np.int32).tolist() for n in lengths]
    for k in range(2):
        table = pa.table({"input_ids": pa.array(rows[k * 200 : (k + 1) * 200], type=pa.list_(pa.int32()))})
        pq.write_table(
            table,
            folder / f"train-{k:05d}-of-00002.parquet",
            row_group_size=50,
            compression="none",
            use_dictionary=False,
            write_statistics=False,
            write_page_checksum=True,
        )


def _prepare(dest: Path, text: Path, seed: int) -> None:
    """``guideloom prepare --task I --tasks 2`` over four JSONL files (the last task merges), and
    a copy of the parts before the merge as ``<dest>-parts``."""
    rng = np.random.default_rng(seed)
    text.mkdir(parents=True)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ", dtype=np.uint8)
    line_lengths = np.random.default_rng(7).integers(10, 120, (4, 40))
    for f in range(4):
        lines = [
            json.dumps({"text": rng.choice(letters, int(n)).tobytes().decode()}) for n in line_lengths[f]
        ]
        (text / f"in-{f}.jsonl").write_text("\n".join(lines) + "\n")
    for task in range(2):
        _cli(
            "prepare",
            str(text),
            "--output",
            str(dest),
            "--task",
            str(task),
            "--tasks",
            "2",
            "--shard-size",
            "4096",
        )
    if not (dest / "manifest.json").exists():
        _cli("prepare", "--merge", str(dest))
    parts = dest.with_name(dest.name + "-parts")
    shutil.copytree(dest, parts)
    (parts / "manifest.json").unlink()


def _cli(*argv: str) -> None:
    """The ``guideloom`` command, as a user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "guideloom", *argv], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"guideloom {' '.join(argv)} failed: {out.stderr.strip()}")


# -- where a dataset lies ----------------------------------------------------------------------------
class LocalPlace:
    """Files under a local folder, damaged in place with their times kept (as bit rot would)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def write(self, name: str, data: bytes) -> None:
        path = self.root / name
        st = path.stat()
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate(len(data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    def delete(self, name: str) -> None:
        (self.root / name).unlink()


class S3Place:
    """Objects under an S3 prefix: damaged by putting the object again."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix

    def upload(self, folder: Path) -> None:
        """One PUT a file (small files: boto3's transfer manager would start threads for each)."""
        for name in LocalPlace(folder).names():
            self.write(name, (folder / name).read_bytes())

    def names(self) -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + "/"
        ):
            out += [o["Key"][len(self.prefix) + 1 :] for o in page.get("Contents", [])]
        return sorted(out)

    def read(self, name: str) -> bytes:
        body: bytes = self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")["Body"].read()
        return body

    def write(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}", Body=data)

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")

    def clear(self) -> None:
        """Every object under the prefix deleted, in one request a thousand."""
        names = self.names()
        for i in range(0, len(names), 1000):
            keys = [{"Key": f"{self.prefix}/{n}"} for n in names[i : i + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})


# -- damage ------------------------------------------------------------------------------------------
def _is_manifest(name: str) -> bool:
    return name.rsplit("/", 1)[-1] == "manifest.json"


def target_files(names: list[str], target: str) -> list[str]:
    """The files of ``names`` (a dataset's, or a cache's) that ``target`` damages."""
    if target == "data":
        return [n for n in names if not _is_manifest(n)]
    if target == "manifest":
        return [n for n in names if n == "manifest.json"]
    if target == "part-manifest":
        return [n for n in names if n.startswith("parts/") and _is_manifest(n)]
    return [n for n in names if not n.endswith(".lock")]  # a cache: every file but its lock


class Twins:
    """The same-size counterpart of a file in the twin dataset (other tokens, the same shape)."""

    def __init__(self, original: Path, twin: Path) -> None:
        mine = [n for n in LocalPlace(original).names() if not _is_manifest(n)]
        theirs = [n for n in LocalPlace(twin).names() if not _is_manifest(n)]
        self.twin = twin
        self.by_base = {a.rsplit("/", 1)[-1]: b for a, b in zip(mine, theirs, strict=True)}
        # the twin's manifests name the twin's files: renamed to the original's, same length
        self.renames = {b.rsplit("/", 1)[-1]: a.rsplit("/", 1)[-1] for a, b in zip(mine, theirs, strict=True)}
        # folders named per run (a prepared part's run-<id>/): the original's name for the twin's
        self.folders: dict[str, str] = {}
        for a, b in zip(mine, theirs, strict=True):
            for x, y in zip(a.split("/")[:-1], b.split("/")[:-1], strict=False):
                if x != y:
                    self.folders[x] = y
                    self.renames[y] = x

    def of(self, name: str) -> bytes | None:
        """The twin of file ``name`` (a dataset's path, or a cache file named like a data file)."""
        base = name.rsplit("/", 1)[-1]
        if base in self.by_base:
            return (self.twin / self.by_base[base]).read_bytes()
        theirs = "/".join(self.folders.get(part, part) for part in name.split("/"))
        if base == "manifest.json" and (self.twin / theirs).exists():
            text = (self.twin / theirs).read_text()
            for theirs, mine in self.renames.items():
                text = text.replace(theirs, mine)
            return text.encode()
        return None


def mutate(kind: str, old: bytes, rng: np.random.Generator, twin: bytes | None) -> tuple[bytes, str]:
    """The damaged bytes of a file and what was done."""
    n = len(old)
    if kind == "flip" or (n == 0 and kind in ("truncate", "replace")):
        if n == 0:
            return bytes([int(rng.integers(256))]), "a byte written into an empty file"
        buf = bytearray(old)
        bits = sorted({int(b) for b in rng.integers(0, 8 * n, int(rng.integers(1, 4)))})
        for b in bits:
            buf[b // 8] ^= 1 << (b % 8)
        return bytes(buf), f"bits {bits} flipped"
    if kind == "truncate":
        keep = int(rng.integers(0, n))
        return old[:keep], f"cut from {n} to {keep} bytes"
    if kind == "append":
        extra = rng.bytes(int(rng.integers(1, 65)))
        return old + extra, f"{len(extra)} bytes appended"
    # replace: the twin's bytes, or a plausible same-size edit of the file itself
    if twin is not None and len(twin) == n and twin != old:
        return twin, "replaced by its twin of another dataset"
    digits = [i for i, c in enumerate(old) if 48 <= c <= 57]
    if old[:1] in (b"{", b"[") and digits:  # JSON: one digit for another, still JSON
        at = digits[int(rng.integers(len(digits)))]
        buf = bytearray(old)
        buf[at] = 48 + (old[at] - 48 + int(rng.integers(1, 10))) % 10
        return bytes(buf), f"digit at {at} replaced"
    word = 8 if n >= 16 else 1
    words = [old[i : i + word] for i in range(0, n - n % word, word)]
    for _ in range(64):
        a, b = (int(x) for x in rng.integers(0, len(words), 2))
        if words[a] != words[b]:
            buf = bytearray(old)
            buf[a * word : (a + 1) * word], buf[b * word : (b + 1) * word] = words[b], words[a]
            return bytes(buf), f"{word}-byte words {a} and {b} swapped"
    return mutate("flip", old, rng, None)


# -- one trial ---------------------------------------------------------------------------------------
class Wrong(Exception):
    """A delivered batch that is not the pristine one, or an epoch of another length."""


def _samples(samples: Sequence[Any]) -> list[np.ndarray]:
    return [np.array(s, copy=True) for s in samples]


def _rows(rows: Any) -> np.ndarray:
    return np.array(rows.block("tokens"), copy=True)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def clear_message(exc: BaseException) -> bool:
    """A refusal a user can act on: guideloom's own error (or a missing file), one line."""
    import guideloom as gl

    text = str(exc)
    return (
        isinstance(exc, gl.GuideloomError | FileNotFoundError)
        and bool(text.strip())
        and "\n" not in text.strip()
        and "Traceback" not in text
        and len(text) < 2000
    )


@dataclass
class Outcome:
    index: int
    key: str
    seed: int
    outcome: str
    damage: str = ""
    detail: str = ""
    seconds: float = 0.0


class Worker:
    """Runs trials in this process: the pristine batches of each dataset once, then each trial."""

    def __init__(self, data: Path, env: dict[str, Any]) -> None:
        self.data, self.env = data, env
        self.count = 0
        self.told: Callable[[str], object] = lambda damage: None
        self.client: Any = None
        self.s3: dict[str, Any] = env.get("s3") or {}
        if self.s3:
            import boto3

            self.client = boto3.client(
                "s3",
                endpoint_url=self.s3["endpoint"],
                aws_access_key_id=self.s3["access_key_id"],
                aws_secret_access_key=self.s3["secret_access_key"],
                region_name=self.s3["region"],
            )
            os.environ.update(env.get("s3_env") or {})  # for the merge of the command line
        twin_of = {"prepared-parts": "prepared-alt-parts"}
        self.twins = {
            kind: Twins(data / kind, data / twin_of.get(kind, f"{kind}-alt"))
            for kind in ("stream", "documents", "parquet", "prepared", "prepared-parts")
        }
        self.expected = {
            kind: self._pristine(kind) for kind in ("stream", "documents", "parquet", "pack", "prepared")
        }

    def _pristine(self, data: str) -> list[list[Any]]:
        folder = self.data / ("parquet" if data == "pack" else data)
        with self._loader(data, self._open(data, str(folder), {})) as loader:
            return [list(loader) for _ in range(EPOCHS)]

    def _open(self, data: str, location: str | list[str], options: dict[str, Any]) -> Any:
        import guideloom as gl

        if data in ("stream", "prepared"):
            return gl.open_stream(location, **options)  # type: ignore[arg-type]
        if data == "documents":
            return gl.open_documents(location, **options)  # type: ignore[arg-type]
        return gl.open_parquet(location, "input_ids", **options)

    def _loader(self, data: str, storage: Any) -> Any:
        import torch

        import guideloom as gl

        common = {"shuffle": True, "shuffle_seed": SEED, "device": torch.device("cpu")}
        if data == "pack":
            return gl.StatefulDataLoader(gl.pack(storage, 32), _rows, local_batch_size=4, **common)
        if data in ("stream", "prepared"):
            length, batch = (256, 16) if data == "stream" else (64, 8)
            return gl.StatefulDataLoader.from_storage(
                storage, _samples, sequence_length=length, local_batch_size=batch, **common
            )
        return gl.StatefulDataLoader.from_storage(storage, _samples, local_batch_size=8, **common)

    def run(self, t: Trial) -> Outcome:
        t0 = time.perf_counter()
        out = Outcome(t.index, t.key, t.seed, "correct")
        work = Path(tempfile.mkdtemp(prefix=f"trial-{t.index}-", dir=self.data.parent))
        cleanup: list[Callable[[], None]] = [lambda: shutil.rmtree(work, ignore_errors=True)]
        try:
            self._trial(t, work, out, cleanup)
        except Wrong as exc:
            out.outcome, out.detail = "WRONG", str(exc)
        except _Refused as exc:
            out.outcome, out.detail = "refused", str(exc)
        except BaseException as exc:
            out.outcome = "refused" if clear_message(exc) else "unclear"
            out.detail = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"[:600]
            if out.outcome == "unclear":
                out.detail += " | " + " / ".join(traceback.format_exc().strip().splitlines()[-6:])[:600]
        finally:
            for f in reversed(cleanup):
                with contextlib.suppress(Exception):
                    f()
        out.seconds = round(time.perf_counter() - t0, 3)
        return out

    def _trial(self, t: Trial, work: Path, out: Outcome, cleanup: list[Callable[[], None]]) -> None:
        mode_name, target, kind, moment = t.key.split("/")
        mode = MODES[mode_name]
        rng = np.random.default_rng(t.seed)
        data = mode.data
        source = "parquet" if data == "pack" else data
        if moment == "before-merge":
            source = "prepared-parts"
        twins = self.twins[source]
        self.count += 1
        name = f"t{os.getpid()}-{self.count}"
        # the dataset where it lies
        place: LocalPlace | S3Place
        if mode.place == "s3":
            place = S3Place(self.client, self.s3["bucket"], name)
            cleanup.append(place.clear)
            place.upload(self.data / source)
            location: str | list[str] = f"s3://{self.s3['bucket']}/{name}"
            options = {k: v for k, v in self.s3.items() if k != "bucket"}
        else:
            folder = (Path(self.env["www"]) / name) if mode.place == "http" else (work / "dataset")
            shutil.copytree(self.data / source, folder)
            if mode.place == "http":
                cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
            place = LocalPlace(folder)
            location = f"{self.env['http']}/{name}" if mode.place == "http" else str(folder)
            options = {}
        if data in ("parquet", "pack") and mode.place != "local":
            location = [f"{location}/{n}" for n in place.names()]
        cache = work / "cache"
        if mode.cache == "copy":
            options["cache_dir"] = cache
        elif mode.cache == "chunks":
            limit = 65_536 if data == "stream" else 16_384  # a part of the dataset, in 4 chunks
            options.update(cache_dir=cache, cache_max_bytes=limit, cache_chunk_bytes=limit // 4)
        elif mode.cache == "index":
            options["cache_dir"] = cache
        expected = self.expected[data]
        damaged = place if target != "cache" else LocalPlace(cache)

        def damage() -> None:
            files = target_files(damaged.names(), target)
            if not files:
                raise _NoTarget
            victim = files[int(rng.integers(len(files)))]
            if kind == "delete":
                out.damage = f"{victim}: deleted"
                self.told(out.damage)
                damaged.delete(victim)
                return
            new, what = mutate(kind, damaged.read(victim), rng, twins.of(victim))
            out.damage = f"{victim}: {what}"
            self.told(out.damage)  # before the write: a crash after it still says what was done
            damaged.write(victim, new)

        try:
            if mode.cache and moment == "before-open":  # a cache a previous run left
                self._epochs(data, location, options, expected, 1, None)
                if target == "cache":
                    self._settle(cache, mode.cache)
            if moment in ("before-open", "before-merge"):
                damage()
            if moment == "before-merge":
                self._merge(location if isinstance(location, str) else "")
            k = int(rng.integers(1, len(expected[0]))) if moment == "mid-epoch" else -1
            hooks = {(0, k): damage} if moment == "mid-epoch" else {}
            if moment == "between-epochs":
                hooks[(1, 0)] = lambda: (
                    self._settle(cache, mode.cache) if target == "cache" else None,
                    damage(),
                )
            self._epochs(data, location, options, expected, EPOCHS, hooks)
        except _NoTarget:
            out.outcome = "no-target"

    def _merge(self, location: str) -> None:
        """``guideloom prepare --merge``: a refusal is a non-zero exit with one line of message.
        It runs as ``python -m guideloom`` does, in this process (the trial's damage hooks and
        oracle stay here)."""
        err = io.StringIO()
        argv = sys.argv
        sys.argv = ["guideloom", "prepare", "--merge", location]
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                runpy.run_module("guideloom", run_name="__main__")
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        finally:
            sys.argv = argv
        if status:
            message = err.getvalue().strip()
            if message and "\n" not in message and "Traceback" not in message:
                raise _Refused(f"prepare --merge exited {status}: {message}")
            raise RuntimeError(f"prepare --merge exited {status} with: {message!r}")

    def _settle(self, cache: Path, how: str) -> None:
        """Wait (a little) until a whole copy is complete, or a chunk cache holds a chunk."""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            names = LocalPlace(cache).names()
            if how == "copy" and any(_is_manifest(n) and ".partial" not in n for n in names):
                return
            if how != "copy" and any(not n.endswith(".lock") for n in names):
                return
            time.sleep(0.02)

    def _epochs(
        self,
        data: str,
        location: str | list[str],
        options: dict[str, Any],
        expected: list[list[Any]],
        epochs: int,
        hooks: dict[tuple[int, int], Callable[[], object]] | None,
    ) -> None:
        """Open, run ``epochs`` epochs and check every batch; ``hooks[(epoch, j)]`` runs before
        batch ``j`` of that epoch is taken (``j == 0``: before the epoch starts)."""
        hooks = hooks or {}
        storage = self._open(data, location, options)
        with self._loader(data, storage) as loader:
            for epoch in range(epochs):
                if (epoch, 0) in hooks:
                    hooks[(epoch, 0)]()
                n = 0
                for n, batch in enumerate(loader, 1):
                    want = expected[epoch]
                    if n > len(want):
                        raise Wrong(f"epoch {epoch}: a batch {n} beyond the {len(want)} of the epoch")
                    if not _same(batch, want[n - 1]):
                        raise Wrong(f"epoch {epoch}, batch {n - 1}: not the pristine batch")
                    if (epoch, n) in hooks:
                        hooks[(epoch, n)]()
                if n != len(expected[epoch]):
                    raise Wrong(f"epoch {epoch} ended after {n} of {len(expected[epoch])} batches, silently")


class _NoTarget(Exception):
    """The target has no file at this moment."""


class _Refused(Exception):
    """The command line refused with a clear message."""


def child_main(data: Path) -> None:
    """The trial process: reads trials as JSON lines on stdin, answers one JSON line each."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else prints goes to stderr, not into the answers
    import warnings

    warnings.simplefilter("ignore")
    worker = Worker(data, json.loads(os.environ["GUIDELOOM_FAULTS_ENV"]))

    def told(damage: str) -> None:
        answers.write("damage " + damage + "\n")
        answers.flush()

    worker.told = told
    answers.write("ready\n")
    answers.flush()
    for line in sys.stdin:
        t = Trial(**json.loads(line))
        answers.write(json.dumps(asdict(worker.run(t))) + "\n")
        answers.flush()


# -- the runner --------------------------------------------------------------------------------------
class Child:
    """A trial process; started again after a hang or a crash."""

    def __init__(self, data: Path, env: dict[str, Any], log: Path) -> None:
        self.data, self.env, self.log = data, env, log
        self.proc: subprocess.Popen[str] | None = None
        self._pending: dict[int, bytes] = {}  # what each process answered past its last line

    def _start(self) -> subprocess.Popen[str]:
        environ = dict(os.environ)
        environ["GUIDELOOM_FAULTS_ENV"] = json.dumps(self.env)
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p)
        with open(self.log, "a") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.corruption", "--child", str(self.data)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=ROOT,
                env=environ,
                text=True,
            )
        if self._line(proc, 300) != "ready":
            self._stop(proc)
            tail = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"the trial process did not start:\n{tail}")
        return proc

    def _line(self, proc: subprocess.Popen[str], timeout: float) -> str | None:
        """The next line the process answers, ``""`` at its end, or None after ``timeout`` seconds.

        Read from the descriptor into a buffer of this runner's own: two answers that arrive in
        one read (a damage line and a fast refusal) are two lines, where a buffered ``readline``
        would keep the second in its buffer while ``select`` waits on the empty pipe."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        pending = self._pending.setdefault(proc.pid, b"")
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in pending:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self._pending[proc.pid] = pending
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._pending.pop(proc.pid, None)
                    return pending.decode().strip()
                pending += chunk
        line, _, rest = pending.partition(b"\n")
        self._pending[proc.pid] = rest
        return line.decode().strip()

    @staticmethod
    def _stop(proc: subprocess.Popen[str]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def run(self, t: Trial, timeout: float) -> Outcome:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(json.dumps(asdict(t)) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        damage = ""
        line = self._line(self.proc, timeout)
        while line and line.startswith("damage "):
            damage = line[len("damage ") :]
            line = self._line(self.proc, max(1.0, timeout - (time.perf_counter() - t0)))
        if line:
            return Outcome(**json.loads(line))
        alive = line is None  # no answer in time; "": the process ended
        self._stop(self.proc)
        code = self.proc.returncode
        self.proc = None
        seconds = round(time.perf_counter() - t0, 3)
        if alive:
            return Outcome(
                t.index, t.key, t.seed, "hang", damage, f"no answer after {timeout:.0f} s", seconds
            )
        return Outcome(t.index, t.key, t.seed, "crash", damage, f"the process exited {code}", seconds)

    def close(self) -> None:
        if self.proc is not None:
            self._stop(self.proc)
            self.proc = None


def run_trials(
    trials: list[Trial],
    data: Path,
    env: dict[str, Any],
    *,
    jobs: int = 1,
    timeout: float = 60.0,
    progress: Callable[[Outcome], object] | None = None,
) -> list[Outcome]:
    """Run ``trials`` in ``jobs`` trial processes; the outcomes in trial order."""
    pending = list(reversed(trials))
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(k: int) -> None:
        child = Child(data, env, data.parent / f"trials-{k}.log")
        try:
            while True:
                with lock:
                    if not pending or errors:
                        return
                    t = pending.pop()
                o = child.run(t, timeout)
                with lock:
                    outcomes.append(o)
                    if progress is not None:
                        progress(o)
        except BaseException as exc:
            errors.append(exc)
        finally:
            child.close()

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(max(1, jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return sorted(outcomes, key=lambda o: o.index)


@dataclass
class Servers:
    """The places a run reaches besides local folders: moto's S3 and, if installed, nginx."""

    env: dict[str, Any] = field(default_factory=dict)
    stops: list[Callable[[], None]] = field(default_factory=list)

    @property
    def remote(self) -> set[str]:
        return {p for p in ("s3", "http") if self.env.get(p)}


@contextlib.contextmanager
def servers(root: Path, *, s3: bool = True, http: bool = True) -> Iterator[Servers]:
    """Start moto (and nginx over ``root/www``) on 127.0.0.1 for one run."""
    from guideloom_dev.servers import MotoS3, Nginx, nginx_binary

    out = Servers()
    try:
        if s3:
            moto = MotoS3()
            out.stops.append(moto.stop)
            moto.create_bucket("faults")
            out.env["s3"] = {**moto.options(), "bucket": "faults"}
            out.env["s3_env"] = moto.env()
        if http and nginx_binary() is not None:
            www = root / "www"
            www.mkdir(parents=True, exist_ok=True)
            nginx = Nginx(www)
            out.stops.append(nginx.stop)
            out.env.update(http=nginx.url, www=str(www))
        yield out
    finally:
        for stop in reversed(out.stops):
            stop()


def env_for(s3: Any = None, bucket: str = "", nginx: Any = None, www: Path | None = None) -> dict[str, Any]:
    """The trial processes' environment from servers already running (the test suite's)."""
    env: dict[str, Any] = {}
    if s3 is not None:
        env["s3"] = {**s3.options(), "bucket": bucket}
        env["s3_env"] = s3.env()
    if nginx is not None and www is not None:
        env.update(http=nginx.url, www=str(www))
    return env


# -- the report --------------------------------------------------------------------------------------
def table(outcomes: list[Outcome], by: Callable[[str], str], title: str) -> str:
    """Counts of each outcome per group of keys."""
    counts: dict[str, Counter[str]] = {}
    for o in outcomes:
        counts.setdefault(by(o.key), Counter())[o.outcome] += 1
    width = max([len(title), *(len(k) for k in counts)]) + 2
    lines = [f"{title:<{width}}" + "".join(f"{c:>10}" for c in OUTCOMES)]
    for k in sorted(counts):
        lines.append(f"{k:<{width}}" + "".join(f"{counts[k][c]:>10}" for c in OUTCOMES))
    return "\n".join(lines)


def report(outcomes: list[Outcome], seed: int, only: str, *, failures: int = 40) -> str:
    """The tables, the failing combinations and the command that re-runs each failure."""
    parts = [
        table(outcomes, lambda k: k.split("/")[0], "mode"),
        table(outcomes, lambda k: "/".join(k.split("/")[2:]), "kind/moment"),
        table(outcomes, lambda k: "/".join(k.split("/")[:2]), "mode/target"),
    ]
    bad = [o for o in outcomes if o.outcome in FAILURES]
    if bad:
        parts.append(table(bad, lambda k: k, "failing mode/target/kind/moment"))
        lines = [f"failures (the first {min(failures, len(bad))} of {len(bad)}):"]
        for o in bad[:failures]:
            lines.append(
                f"  {o.outcome} trial {o.index} {o.key}: {o.damage}; {o.detail}\n"
                f"    python -m benchmarks faults --seed {seed} --only {o.key} --trial {o.index}"
            )
        parts.append("\n".join(lines))
    total = Counter(o.outcome for o in outcomes)
    parts.append(
        f"{len(outcomes)} trials: "
        + ", ".join(f"{total[c]} {c}" for c in OUTCOMES if total[c])
        + f" (seed {seed}{', only ' + only if only else ''})"
    )
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks faults", description=summary(__doc__))
    ap.add_argument("--trials", type=int, default=300, help="how many trials (default 300)")
    ap.add_argument(
        "--seed", type=int, default=0, help="the run's seed: trial i of a seed is always the same"
    )
    ap.add_argument(
        "--only",
        default="",
        help="keep combinations mode/target/kind/moment holding every comma-separated word",
    )
    ap.add_argument("--trial", type=int, action="append", help="run only trial I (repeatable)")
    ap.add_argument("--jobs", type=int, default=2, help="trial processes at once (default 2)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a trial may take (default 60)")
    ap.add_argument("--json", type=Path, help="also write every outcome to this file")
    ap.add_argument("--no-s3", action="store_true", help="leave out the S3 modes (no moto)")
    ap.add_argument("--no-http", action="store_true", help="leave out the http modes (no nginx)")
    ap.add_argument("--list", action="store_true", help="print the combinations --only keeps and stop")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="guideloom-faults-") as tmp:
        root = Path(tmp)
        with servers(root, s3=not args.no_s3, http=not args.no_http) as srv:
            keys = select(combinations(srv.remote), args.only)
            if args.list or not keys:
                print("\n".join(keys) or f"no combination holds {args.only!r}")
                raise SystemExit(0 if keys else 2)
            indices = args.trial if args.trial else range(args.trials)
            trials = [trial(args.seed, i, keys) for i in indices]
            data = root / "data"
            data.mkdir()
            t0 = time.perf_counter()
            build_data(data)
            print(f"{len(keys)} combinations; data written in {time.perf_counter() - t0:.1f} s", flush=True)
            done = [0]

            def progress(o: Outcome) -> None:
                done[0] += 1
                if o.outcome in FAILURES and len(trials) <= 20:
                    print(f"  {o.outcome} {o.index} {o.key}: {o.damage}; {o.detail}", flush=True)
                if done[0] % 100 == 0:
                    print(f"  {done[0]} / {len(trials)} trials, {time.perf_counter() - t0:.0f} s", flush=True)

            outcomes = run_trials(
                trials, data, srv.env, jobs=args.jobs, timeout=args.timeout, progress=progress
            )
    print(report(outcomes, args.seed, args.only))
    print(f"{time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    raise SystemExit(1 if any(o.outcome in FAILURES for o in outcomes) else 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(Path(sys.argv[2]))
    else:
        main()
