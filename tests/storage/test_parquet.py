"""Parquet read where it lies (``guideloom/storage/_parquet.py``): files written by real writers
(Hugging Face ``datasets``, pyarrow with several row-group sizes, codecs, dictionary encoding,
string and large_string, list and large_list) read back row for row; the loader over them with
the row-group-aware order, thread and process workers tokenizing; resume at any offset on
another world; packing and mixtures; and each kind of bad or changed input refused with a
message naming the file, the row group and the column."""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom as gl
from guideloom._core.group_order import GroupPermutation
from tests.support import ROOT
from tests.support.loader import roundtrip, take
from tests.support.processes import run_script

CPU = torch.device("cpu")
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]


def make_rows(n: int, seed: int = 0) -> tuple[list[list[int]], list[str]]:
    """Rows whose first token and first word are their own index (so a row names itself)."""
    rng = np.random.default_rng(seed)
    ids, texts = [], []
    for i in range(n):
        k = int(rng.integers(0, 30))
        ids.append([i, *rng.integers(0, 1000, k).tolist()])
        texts.append(f"r{i} " + " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), k)))
    return ids, texts


def write_files(
    folder: Path,
    ids: list[list[int]],
    texts: list[str],
    *,
    files: int = 3,
    row_group_size: int = 50,
    compression: str = "zstd",
    list_type: Any = None,
    string_type: Any = None,
    dictionary: bool = False,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cuts = np.array_split(np.arange(len(ids)), files)
    for f, rows in enumerate(cuts):
        table = pa.table(
            {
                "input_ids": pa.array([ids[i] for i in rows], list_type or pa.list_(pa.int32())),
                "text": pa.array([texts[i] for i in rows], string_type or pa.string()),
            }
        )
        pq.write_table(
            table,
            folder / f"train-{f:05d}-of-{files:05d}.parquet",
            row_group_size=row_group_size,
            compression=compression,
            use_dictionary=dictionary,
        )
    return folder


@pytest.fixture(scope="module")
def rows() -> tuple[list[list[int]], list[str]]:
    return make_rows(600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, rows: Any) -> Path:
    return write_files(tmp_path_factory.mktemp("pq") / "data", *rows)


def all_rows(storage: gl.ParquetStorage) -> list[Any]:
    return list(storage.read_many_sync(np.arange(len(storage), dtype=np.int64)))


def first_ids(samples: Sequence[np.ndarray]) -> list[int]:
    """Collate: each row's own index (its first token)."""
    return [int(s[0]) for s in samples]


def lengths(samples: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
    return [tuple(np.asarray(s).tolist()) for s in samples]


# -- reading what real writers wrote ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("compression", "row_group_size", "list_type", "string_type", "dictionary"),
    [
        ("zstd", 50, pa.list_(pa.int32()), pa.string(), False),
        ("snappy", 7, pa.large_list(pa.int64()), pa.large_string(), True),
        ("snappy", 1000, pa.list_(pa.uint16()), pa.string(), True),
        ("none", 1, pa.list_(pa.int32()), pa.large_string(), False),
    ],
)
def test_rows_read_back_as_written_for_each_writer_setting(
    tmp_path: Path,
    rows: Any,
    compression: str,
    row_group_size: int,
    list_type: Any,
    string_type: Any,
    dictionary: bool,
) -> None:
    ids, texts = rows[0][:200], rows[1][:200]
    folder = write_files(
        tmp_path,
        ids,
        texts,
        compression=compression,
        row_group_size=row_group_size,
        list_type=list_type,
        string_type=string_type,
        dictionary=dictionary,
    )
    tokens = gl.open_parquet(folder, "input_ids")
    assert len(tokens) == 200 and tokens.dtype == list_type.value_type.to_pandas_dtype()
    got = all_rows(tokens)
    assert all(isinstance(g, np.ndarray) and g.ndim == 1 for g in got)
    assert [g.tolist() for g in got] == ids
    assert all_rows(gl.open_parquet(folder, "text")) == texts
    assert tokens.num_row_groups == sum(
        -(-len(c) // row_group_size) for c in np.array_split(np.arange(200), 3)
    )


def test_rows_of_a_list_column_are_views_of_the_decoded_values(folder: Path) -> None:
    storage = gl.open_parquet(folder, "input_ids")
    a, b = storage.read_many_sync(np.asarray([3, 4], dtype=np.int64))
    assert a.base is not None and a.base is b.base  # one values buffer, no copy per row


@given(st.lists(st.integers(0, 599), max_size=120), st.booleans())
@settings(max_examples=40, deadline=None)
def test_a_read_in_any_order_over_many_row_groups_returns_each_row_in_place(
    folder: Path, rows: Any, picks: list[int], text: bool
) -> None:
    storage = gl.open_parquet(folder, "text" if text else "input_ids", max_decoded_bytes=2048)
    got = storage.read_many_sync(np.asarray(picks, dtype=np.int64))
    want = [rows[1][i] for i in picks] if text else [rows[0][i] for i in picks]
    assert [g if text else g.tolist() for g in got] == want


@given(st.lists(st.integers(0, 599), min_size=1, max_size=120))
@settings(max_examples=30, deadline=None)
def test_a_read_over_row_groups_decoded_already_cuts_each_row_in_place(
    folder: Path, rows: Any, picks: list[int]
) -> None:
    """A global shuffle's steady state: every row group a read touches is decoded already. The
    read cuts each row from its group's values as the first read did, decodes nothing again
    and records one use of each group it touches."""
    storage = gl.open_parquet(folder, "input_ids")
    index = np.asarray(picks, dtype=np.int64)
    first = [r.tolist() for r in storage.read_many_sync(index)]
    decodes = storage.figures()["parquet_row_group_decodes"]
    uses: list[int] = []
    storage._use_locked = uses.append  # type: ignore[method-assign]
    again = storage.read_many_sync(index)
    assert [r.tolist() for r in again] == first == [rows[0][i] for i in picks]
    assert all(r.base is not None for r in again)  # views of the decoded values, no copies
    assert storage.figures()["parquet_row_group_decodes"] == decodes
    groups = (np.searchsorted(storage._gstarts, index, side="right") - 1).tolist()
    assert sorted(uses) == sorted(set(groups))


def test_readers_of_a_row_group_being_decoded_wait_for_that_decode(folder: Path) -> None:
    """Concurrent reads of one row group (a loader's reads of a window) decode it once, and the
    bytes kept count it once: the bound is not used up by copies that are not kept."""
    import concurrent.futures
    import threading

    storage = gl.open_parquet(folder, "input_ids")
    start = threading.Barrier(4)

    def read(k: int) -> list[list[int]]:
        start.wait()
        return [r.tolist() for r in storage.read_many_sync(np.arange(k, 50, 4, dtype=np.int64))]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(read, range(4)))
    assert got == [[r.tolist() for r in storage.read_many_sync(np.arange(k, 50, 4))] for k in range(4)]
    assert storage.figures()["parquet_row_group_decodes"] == 1
    assert storage._decoded_bytes == sum(d.nbytes for d in storage._decoded.values())


def test_a_read_over_many_row_groups_refuses_a_damaged_one_by_its_place(tmp_path: Path) -> None:
    """A read that needs many row groups (a global shuffle's) and meets a damaged one refuses it
    by its place, every time it is asked: never delivered; the other row groups still read."""
    table = pa.table({"ids": pa.array([[i] * 5 for i in range(200)], pa.list_(pa.int32()))})
    path = tmp_path / "damaged.parquet"
    pq.write_table(table, path, row_group_size=20, compression="none", use_dictionary=False,
                   write_page_checksum=True)  # fmt: skip
    st = os.stat(path)
    c = pq.ParquetFile(path).metadata.row_group(9).column(0)
    with open(path, "r+b") as f:
        f.seek(c.data_page_offset + c.total_compressed_size // 2)
        f.write(b"\xff\x00\xfe\x13" * 4)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    storage = gl.open_parquet(path, "ids")
    for _ in range(3):
        with pytest.raises(gl.DatasetFormatError, match=r"damaged\.parquet: row group 9, column 'ids'"):
            storage.read_many_sync(np.arange(0, 200, 7))
    assert [r.tolist() for r in storage.read_many_sync(np.arange(0, 180, 7))] == [
        [i] * 5 for i in range(0, 180, 7)
    ]


def test_a_read_over_many_row_groups_checks_each_for_nulls_and_the_range(tmp_path: Path) -> None:
    ids = [[1, 2], [5], [], [3]] * 4 + [None]
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), tmp_path / "n.parquet",
                   row_group_size=3)  # fmt: skip
    strict = gl.open_parquet(tmp_path, "input_ids")
    assert [r.tolist() for r in strict.read_many_sync(np.asarray([15, 0, 5], dtype=np.int64))] == [
        [3],
        [1, 2],
        [5],
    ]
    for _ in range(2):  # the second time over row groups decoded already
        with pytest.raises(
            gl.DatasetFormatError, match=r"row group 5, column 'input_ids': row 1 \(document 16\)"
        ):
            strict.read_many_sync(np.asarray([0, 16, 4], dtype=np.int64))
    lenient = gl.open_parquet(tmp_path, "input_ids", on_null="empty")
    for n in (1, 2):
        assert [r.tolist() for r in lenient.read_many_sync(np.asarray([16, 1], dtype=np.int64))] == [[], [5]]
        assert lenient.counts["parquet_null_rows"] == n
    with pytest.raises(IndexError, match="outside"):
        strict.read_many_sync(np.asarray([0, 17], dtype=np.int64))


def test_files_written_by_hugging_face_datasets(tmp_path: Path, rows: Any) -> None:
    import datasets

    ids, texts = rows
    ds = datasets.Dataset.from_dict({"text": texts, "input_ids": ids})
    (tmp_path / "data").mkdir()
    for shard in range(2):
        ds.shard(2, shard, contiguous=True).to_parquet(
            str(tmp_path / "data" / f"train-{shard:05d}-of-00002.parquet")
        )
    storage = gl.open_parquet(tmp_path / "data/train-*.parquet", "text")
    assert all_rows(storage) == texts
    assert [r.tolist() for r in all_rows(gl.open_parquet(tmp_path, "input_ids"))] == ids


def test_folder_glob_file_and_list_name_the_same_rows_in_path_order(folder: Path, rows: Any) -> None:
    files = sorted(str(p) for p in folder.glob("*.parquet"))
    whole = gl.open_parquet(folder, "text")
    assert whole.files == files
    assert all_rows(gl.open_parquet(str(folder / "*.parquet"), "text")) == rows[1]
    assert all_rows(gl.open_parquet(files[1], "text")) == all_rows(whole)[200:400]
    assert all_rows(gl.open_parquet(files[::-1], "text"))[:200] == rows[1][400:]


def test_import_guideloom_does_not_import_pyarrow() -> None:
    code = "import sys, guideloom; assert 'pyarrow' not in sys.modules, 'pyarrow was imported'"
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are listed in /proc (Linux)")
def test_a_process_that_read_parquet_may_still_fork_its_workers_from_itself(folder: Path) -> None:
    """pyarrow's jemalloc starts a named background thread at import unless told not to; with
    it the loader could not fork process workers from the main process."""
    code = (
        "import os, sys, numpy as np, guideloom as gl\n"
        "from guideloom._runtime.processes.zygote import fork_is_safe\n"
        f"s = gl.open_parquet({str(folder)!r}, 'input_ids')\n"
        "s.read_many_sync(np.arange(len(s)))\n"
        "from guideloom._runtime.processes.zygote import _comm\n"
        "names = [(_comm(t) or '').strip() for t in os.listdir('/proc/self/task')]  # a thread may end\n"
        "assert 'jemalloc_bg_thd' not in names, names\n"
        "assert fork_is_safe()\n"
        "assert 'JE_ARROW_MALLOC_CONF' not in os.environ, 'the environment is left as it was'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JE_ARROW_MALLOC_CONF"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})


def test_a_thousand_files_open_well_under_a_second(tmp_path: Path) -> None:
    table = pa.table({"input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32()))})
    for f in range(1000):
        pq.write_table(table, tmp_path / f"p-{f:04d}.parquet")
    storage = gl.open_parquet(tmp_path, "input_ids")  # the time is a benchmark's; this checks the index
    assert len(storage) == 2000 and storage.num_row_groups == 1000


# -- tokenizing ------------------------------------------------------------------------------------
def test_a_tokenizer_json_a_tokenizer_object_and_a_callable_encode_alike(
    folder: Path, tokenizer_json: str, rows: Any
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    want = [np.asarray(tok.encode(t, add_special_tokens=False).ids) for t in rows[1][:50]]
    eos, bos = tok.token_to_id("</s>"), tok.token_to_id("<s>")
    idx = np.arange(50, dtype=np.int64)
    by_path = gl.open_parquet(folder, "text", tokenizer=tokenizer_json, eos="</s>").read_many_sync(idx)
    by_object = gl.open_parquet(folder, "text", tokenizer=tok, bos="<s>", eos=eos).read_many_sync(idx)
    by_callable = gl.open_parquet(
        folder, "text", tokenizer=lambda t: tok.encode(t, add_special_tokens=False).ids
    ).read_many_sync(idx)
    for w, p, o, c in zip(want, by_path, by_object, by_callable, strict=True):
        assert p.tolist() == [*w.tolist(), eos]
        assert o.tolist() == [bos, *w.tolist(), eos]
        assert c.tolist() == w.tolist()


def test_a_tokenizer_that_pads_encodes_each_document_alone(tokenizer_json: str) -> None:
    """Padding would make a document's tokens depend on the other texts of its batch: the
    encoder encodes without it (on a copy: the caller's tokenizer still pads)."""
    from tokenizers import Tokenizer

    from guideloom.storage._text import TextEncoder

    padded = Tokenizer.from_file(tokenizer_json)
    padded.enable_padding(pad_id=0, pad_token="[UNK]")
    encoder = TextEncoder(padded, eos="</s>")
    texts = ["r1", "r1 r2 r3 r4 r5 r6"]
    alone = [encoder.encode_many([t])[0].tolist() for t in texts]
    assert [a.tolist() for a in encoder.encode_many(texts)] == alone
    assert len(alone[0]) < len(alone[1])
    assert padded.padding is not None


def test_a_copy_of_an_encoder_encodes_with_the_tokenizer_json_as_it_was_read(
    tokenizer_json: str, tmp_path: Path
) -> None:
    """A process worker that builds its own tokenizer (one started by the fork server) builds
    the one the main process read, even where the file changed since: the fingerprint says
    that one."""
    from guideloom.storage._text import TextEncoder

    path = tmp_path / "tokenizer.json"
    shutil.copy(tokenizer_json, path)
    encoder = TextEncoder(str(path), eos="</s>")
    want = encoder.encode_many(["r1 r2 r3"])[0].tolist()
    state = pickle.dumps(encoder)
    path.write_text("{}")  # the file is replaced after the loader read it
    code = (
        "import pickle, sys\n"
        "print(pickle.loads(sys.stdin.buffer.read()).encode_many(['r1 r2 r3'])[0].tolist())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=state, capture_output=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.stdout.decode().strip() == str(want)


def test_a_tokenizer_callable_must_return_integer_ids_the_dtype_holds() -> None:
    from guideloom.storage._text import TextEncoder

    with pytest.raises(ValueError, match=r"token id -1, outside uint32's range.*dtype="):
        TextEncoder(lambda t: np.asarray([1, -1], np.int64)).encode_many(["x"])
    with pytest.raises(TypeError, match="integer token ids"):
        TextEncoder(lambda t: [0.5]).encode_many(["x"])
    wide = TextEncoder(lambda t: [1, -1], dtype="int64").encode_many(["x"])
    assert wide[0].tolist() == [1, -1] and wide[0].dtype == np.int64


def test_a_process_forked_after_the_encoder_was_made_uses_its_tokenizer(tokenizer_json: str) -> None:
    """A process worker forked from the main process shares the tokenizer the main process
    built (its pages) instead of building its own from the pickled encoder."""
    import multiprocessing

    from guideloom.storage._text import TextEncoder

    encoder = TextEncoder(tokenizer_json, eos="</s>")
    assert pickle.loads(pickle.dumps(encoder))._tok is encoder._tok
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_tokenizer_address, args=(pickle.dumps(encoder), out))
    child.start()
    address, ids = out.get(timeout=30)
    child.join(30)
    assert address == id(encoder._tok)
    assert ids == encoder.encode_many(["r1 r2"])[0].tolist()
    other = TextEncoder(tokenizer_json, eos="</s>")
    state = pickle.dumps(other)
    del other  # gone before it is unpickled: the copy builds a tokenizer of its own
    copy = pickle.loads(state)
    assert copy._tok is None and copy.encode_many(["r1 r2"])[0].tolist() == ids


def _tokenizer_address(state: bytes, out: Any) -> None:  # pragma: no cover - in a forked child
    copy = pickle.loads(state)
    out.put((id(copy._tok), copy.encode_many(["r1 r2"])[0].tolist()))


def tokenized_loader(storage: Any, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    kw.setdefault("device", CPU)
    kw.setdefault("local_batch_size", 8)
    return gl.StatefulDataLoader.from_storage(storage, lengths, **kw)


@pytest.mark.parametrize(("method", "workers"), [("thread", 0), ("thread", 2), ("process", 2)])
def test_the_loader_tokenizes_where_it_collates_and_delivers_every_row_once(
    folder: Path, tokenizer_json: str, method: str, workers: int
) -> None:
    storage = gl.open_parquet(folder, "text", tokenizer=tokenizer_json, eos="</s>")
    want = sorted(tuple(t.tolist()) for t in all_rows(storage))
    loader = tokenized_loader(
        storage,
        num_workers=workers,
        parallel_method=method,
        shuffle=True,
        shuffle_block_size="auto",
        drop_last=False,
    )
    with loader:
        got = [row for batch in take(loader) for row in batch]
        # the loader reads texts and runs the tokenizer in its collate step
        assert type(loader.dataset.storage.read_many_sync(np.zeros(1, np.int64))[0]) is str
    assert sorted(got) == want


def test_process_workers_tokenize_texts_the_main_process_read(folder: Path, tokenizer_json: str) -> None:
    """Over texts the workers tokenize, the main process reads (one window of decoded row groups
    in one process, not one per worker) and the workers only tokenize; token columns are read by
    the workers themselves."""
    storage = gl.open_parquet(folder, "text", tokenizer=tokenizer_json, eos="</s>")
    assert not storage.deferred_step()[0].read_by_workers()  # type: ignore[index]
    assert gl.open_parquet(folder, "input_ids").read_by_workers()
    with tokenized_loader(storage, shuffle=True, shuffle_seed=2, shuffle_block_size="auto") as inline:
        want = take(inline)
    loader = tokenized_loader(
        storage,
        num_workers=2,
        parallel_method="process",
        collate_mode="workers",
        shuffle=True,
        shuffle_seed=2,
        shuffle_block_size="auto",
    )
    with loader:
        assert take(loader) == want
        stats = loader.stats()
    assert stats["collated_processes"] == len(want)
    # counted where the reads ran: here, each row group once in its window
    assert stats["parquet_row_group_decodes"] == storage.num_row_groups


# -- the row-group-aware order ---------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=30),
    window=st.integers(1, 5),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 3),
)
def test_group_order_is_a_bijection_whose_windows_hold_whole_groups(
    sizes: list[int], window: int, seed: int, epoch: int
) -> None:
    order = GroupPermutation(sizes, seed=seed, epoch=epoch, window=window)
    got = order.range(0, len(order))
    assert sorted(got.tolist()) == list(range(sum(sizes)))
    assert [order[i] for i in range(len(order))] == got.tolist()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    group_of = np.searchsorted(starts, got, side="right") - 1
    # consecutive windows of the order never share a group: each group's rows are in one window
    first_seen: dict[int, int] = {}
    win = np.searchsorted(order._wstarts, np.arange(len(order)), side="right") - 1
    for g, w in zip(group_of.tolist(), win.tolist(), strict=True):
        assert first_seen.setdefault(g, w) == w


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 2000), min_size=1, max_size=200),
    window=st.integers(1, 20),
    seed=st.integers(0, 2**31),
)
def test_group_order_finds_a_window_in_constant_steps_from_its_bucket(
    sizes: list[int], window: int, seed: int
) -> None:
    order = GroupPermutation(sizes, seed=seed, epoch=0, window=window)
    positions = np.arange(len(order), dtype=np.int64)
    truth = np.searchsorted(order._wstarts, positions, side="right") - 1
    first = order._first[positions // order._bucket]
    assert (first <= truth).all()
    # a lookup steps over the windows that start inside its bucket, between the bucket's start
    # and its position; with about as many buckets as windows that is at most 2 on average
    assert len(order._first) <= -(-len(sizes) // window) + 2
    if len(order):
        assert float(np.mean(truth - first)) <= 2.0


def test_the_auto_order_decodes_each_row_group_once_per_epoch(folder: Path) -> None:
    storage = gl.open_parquet(folder, "input_ids")
    loader = gl.StatefulDataLoader.from_storage(
        storage,
        first_ids,
        local_batch_size=16,
        shuffle=True,
        shuffle_block_size="auto",
        device=CPU,
        drop_last=False,
    )
    with loader:
        got = [i for batch in take(loader) for i in batch]
        stats = loader.stats()
    assert sorted(got) == list(range(600))
    assert stats["parquet_row_group_decodes"] == storage.num_row_groups == 12
    assert got != sorted(got)


def run_ranks(
    storage: Any, world: int, state: Any = None, steps: int | None = None, **kw: Any
) -> tuple[list[int], Any]:
    per_rank, saved = [], None
    for rank in range(world):
        loader = gl.StatefulDataLoader.from_storage(
            storage, first_ids, rank=rank, world_size=world, device=CPU, **kw
        )
        with loader:
            if state is not None:
                loader.load_state_dict(state)
            per_rank.append(take(loader, steps))
            saved = roundtrip(loader.state_dict())
    return [i for step in zip(*per_rank, strict=True) for batch in step for i in batch], saved


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> gl.ParquetStorage:
    """Files of uneven row groups (a short last one in each)."""
    ids, texts = make_rows(130, seed=3)
    folder = write_files(tmp_path_factory.mktemp("uneven"), ids, texts, files=3, row_group_size=9)
    return gl.open_parquet(folder, "input_ids")


@settings(max_examples=20, deadline=None)
@given(
    first=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    second=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    stop=st.integers(0, 12),
    window=st.integers(1, 4),
)
def test_resume_at_any_offset_on_another_world_and_batch_size_is_exact(
    uneven: gl.ParquetStorage, first: tuple[int, int], second: tuple[int, int], stop: int, window: int
) -> None:
    kw = {
        "shuffle": True,
        "shuffle_seed": 7,
        "drop_last": False,
        "shuffle_block_size": "auto",
        "shuffle_window": window,
    }
    (b1, w1), (b2, w2) = first, second
    stop = min(stop, (len(uneven) - 1) // (b1 * w1))
    expected, _ = run_ranks(uneven, 1, local_batch_size=1, **kw)
    assert sorted(expected) == list(range(len(uneven)))
    before, state = run_ranks(uneven, w1, steps=stop, local_batch_size=b1, **kw)
    after, _ = run_ranks(uneven, w2, state=state, local_batch_size=b2, **kw)
    assert before + after == expected


def test_the_checkpoint_records_the_row_group_blocks_and_the_files(folder: Path) -> None:
    storage = gl.open_parquet(folder, "input_ids")
    loader = gl.StatefulDataLoader.from_storage(
        storage, first_ids, local_batch_size=4, shuffle=True, shuffle_block_size="auto", device=CPU
    )
    with loader:
        take(loader, 2)
        state = roundtrip(loader.state_dict())
    assert state["shuffle_block_size"] == 50 and state["dataset"]["digest"].startswith("parquet-")
    assert state["dataset"]["digest"] == storage.content_digest()


def _block_loader(storage: gl.ParquetStorage, **kw: Any) -> gl.StatefulDataLoader[Any, Any]:
    return gl.StatefulDataLoader.from_storage(
        storage, first_ids, local_batch_size=4, shuffle=True, shuffle_seed=5, device=CPU, **kw
    )


def _saved(storage: gl.ParquetStorage, **kw: Any) -> tuple[Any, list[list[int]]]:
    """The state of a loader after its first batch, and the 3 batches it gives next."""
    with _block_loader(storage, **kw) as loader:
        it = iter(loader)
        next(it)
        state = roundtrip(loader.state_dict())
        return state, [next(it) for _ in range(3)]


def _resumed(storage: gl.ParquetStorage, state: Any, **kw: Any) -> tuple[list[list[int]], list[str]]:
    """The next batches of a loader that loads ``state``, and the warnings its load gave."""
    loader = _block_loader(storage, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state)
    with loader:
        return take(loader, 3), [str(w.message) for w in caught]


def test_a_resume_over_row_groups_tells_auto_from_the_size_it_records(folder: Path) -> None:
    """Over row groups, "auto" keeps them: an order that no size cuts, not even the mean size
    the checkpoint records (50). A resume with another setting warns, naming what each loader
    was given, and its advice resumes the saved order."""
    storage = gl.open_parquet(folder, "input_ids")
    state, rest = _saved(storage, shuffle_block_size="auto")
    assert state["shuffle_block_size"] == 50 and state["shuffle_block_auto"] is True
    assert _resumed(storage, state, shuffle_block_size="auto") == (rest, [])
    for option, shown in [(50, "50"), (None, "None (a global row shuffle)"), (8, "8")]:
        got, (warning,) = _resumed(storage, state, shuffle_block_size=option)
        assert got != rest
        assert (
            f"saved by a loader with shuffle_block_size='auto' (resolved to 50), this loader has "
            f"shuffle_block_size={shown};" in warning
        )
        assert "Construct the loader with shuffle_block_size='auto' to resume it exactly" in warning
    # the reverse: the mean size given, "auto" resuming
    state, rest = _saved(storage, shuffle_block_size=50)
    assert state["shuffle_block_auto"] is False
    got, (warning,) = _resumed(storage, state, shuffle_block_size="auto")
    assert got != rest
    assert (
        "with shuffle_block_size=50, this loader has shuffle_block_size='auto' (resolved to 50);" in warning
    )
    assert "Construct the loader with shuffle_block_size=50 to resume" in warning
    assert _resumed(storage, state, shuffle_block_size=50) == (rest, [])
    # a checkpoint from before "auto" was recorded: sizes compared only, as they were
    del state["shuffle_block_auto"]
    assert _resumed(storage, state, shuffle_block_size="auto")[1] == []


# -- packing and mixtures --------------------------------------------------------------------------
def test_pack_over_a_tokenized_text_column_holds_every_token_once(
    folder: Path, tokenizer_json: str, tmp_path: Path
) -> None:
    """Each row group cut on its own, the row groups' tails cut together last: in order, every
    row group's whole sequences, then the tails run's; every token once but the tails run's last
    (total % 32), as many sequences as the whole concatenation cut. The row groups' counts are
    kept in cache_dir as they are learned."""
    storage = gl.open_parquet(folder, "text", tokenizer=tokenizer_json, eos="</s>", cache_dir=tmp_path)
    rows = all_rows(storage)
    packed = gl.pack(storage, 32)
    loader = gl.StatefulDataLoader(
        packed, lambda rows: rows.block("tokens").copy(), local_batch_size=4, device=CPU, drop_last=False
    )
    with loader:
        got = np.concatenate([b.reshape(-1) for b in take(loader)])
    bounds = np.cumsum([0, *storage.row_group_sizes()])
    groups = [np.concatenate(rows[a:b]) for a, b in itertools.pairwise(bounds.tolist())]
    whole = [g[: len(g) // 32 * 32] for g in groups]
    tails = np.concatenate([g[len(g) // 32 * 32 :] for g in groups])
    want = np.concatenate([*whole, tails[: len(tails) // 32 * 32]])
    assert len(packed) == sum(map(len, groups)) // 32 == len(want) // 32
    assert np.array_equal(got, want)
    assert len(list(storage._length_folder().glob("group-*.npy"))) == storage.num_row_groups


def saved_group(folder: Path, group: int, lengths: np.ndarray) -> Path:
    """A row group's lengths as a build saves them: the digest of the file's bytes in its name."""
    buf = io.BytesIO()
    np.save(buf, lengths)
    path = folder / f"group-{group}-{hashlib.sha256(buf.getvalue()).hexdigest()[:32]}.npy"
    path.write_bytes(buf.getvalue())
    return path


def test_the_length_index_resumes_from_the_row_groups_already_done(folder: Path, tmp_path: Path) -> None:
    storage = gl.open_parquet(folder, "input_ids", cache_dir=tmp_path)
    part = storage._length_folder()
    part.mkdir()
    fake = np.full(50, 1, np.int32)  # a row group "already done": read back, not decoded again
    saved_group(part, 0, fake)
    offsets = storage.build_length_index()
    assert storage.figures()["parquet_row_group_decodes"] == storage.num_row_groups - 1
    assert np.array_equal(np.diff(offsets)[:50], fake)
    again = gl.open_parquet(folder, "input_ids", cache_dir=tmp_path)
    assert (
        np.array_equal(again.build_length_index(), offsets)
        and again.figures()["parquet_row_group_decodes"] == 0
    )


def test_a_packed_parquet_source_resumes_exactly(folder: Path) -> None:
    storage = gl.open_parquet(folder, "input_ids")
    packed = gl.pack(storage, 16, "best_fit")

    def run(state: Any = None, steps: int | None = None, bs: int = 4) -> tuple[list[Any], Any]:
        loader = gl.StatefulDataLoader(
            packed, rows_of, local_batch_size=bs, shuffle=True, shuffle_seed=3, device=CPU, drop_last=False
        )
        with loader:
            if state is not None:
                loader.load_state_dict(state)
            got = [r for b in take(loader, steps) for r in b]
            return got, roundtrip(loader.state_dict())

    whole, _ = run()
    before, state = run(steps=5)
    after, _ = run(state=state, bs=3)
    assert before + after == whole


def rows_of(rows: Any) -> list[tuple[int, ...]]:
    return [tuple(r.tolist()) for r in rows.block("tokens")]


def test_parquet_sources_mix_with_other_datasets(folder: Path) -> None:
    parquet = gl.open_parquet(folder, "input_ids")
    other = gl.MemoryDocumentStorage([np.asarray([10_000 + i], np.int32) for i in range(100)])
    mixture = gl.mix({"parquet": parquet, "other": other}, weights={"parquet": 0.5, "other": 0.5})
    loader = gl.StatefulDataLoader(mixture, first_ids, local_batch_size=10, device=CPU, shuffle=True)
    with loader:
        got = [i for batch in take(loader, 10) for i in batch]
    assert any(i >= 10_000 for i in got) and any(i < 600 for i in got)


@pytest.mark.parametrize(("method", "workers"), [("thread", 0), ("process", 2)])
def test_a_tokenized_text_source_of_a_mixture_gives_token_arrays(
    folder: Path, tokenizer_json: str, method: str, workers: int
) -> None:
    """A mixture's samples are its sources' finished samples: a text column read with a
    tokenizer is tokenized where the mixture reads it, given as storage or as a dataset."""
    storage = gl.open_parquet(folder, "text", tokenizer=tokenizer_json, eos="</s>")
    want = sorted(tuple(t.tolist()) for t in all_rows(storage))
    for source in (storage, gl.DocumentDataset(storage)):
        mixture = gl.mix({"text": source})
        loader = gl.StatefulDataLoader(
            mixture, list, local_batch_size=8, device=CPU, drop_last=False,
            num_workers=workers, parallel_method=method,
        )  # fmt: skip
        with loader:
            got = [row for batch in take(loader) for row in batch]
        assert all(isinstance(row, np.ndarray) and row.dtype == storage.dtype for row in got)
        assert sorted(tuple(row.tolist()) for row in got) == want


# -- bad and changing input ------------------------------------------------------------------------
def copy_of(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(folder, dest)
    return dest


def test_a_missing_column_names_the_file_and_the_columns(folder: Path) -> None:
    with pytest.raises(
        gl.DatasetFormatError,
        match=r"train-00000-of-00003\.parquet: no column 'tokens'; its columns are input_ids, text",
    ):
        gl.open_parquet(folder, "tokens")


def test_a_column_of_another_kind_in_one_file_is_refused(folder: Path, tmp_path: Path) -> None:
    dest = copy_of(folder, tmp_path)
    pq.write_table(pa.table({"input_ids": ["not", "tokens"]}), dest / "train-00009-extra.parquet")
    with pytest.raises(
        gl.DatasetFormatError,
        match=r"differs between files: lists of int32 in .*00000-of-00003.* strings in .*00009-extra",
    ):
        gl.open_parquet(dest, "input_ids")


def test_a_damaged_page_is_refused_by_its_row_group(tmp_path: Path) -> None:
    """A page damaged in place (size and modification time kept): refused by its checksum where
    the writer wrote one, and a text that is not UTF-8 is refused by its place, never read."""
    table = pa.table(
        {
            "t": [f"text number {i} " * 3 for i in range(100)],
            "ids": pa.array([[i] * 5 for i in range(100)], pa.list_(pa.int32())),
        }
    )
    for checksums in (True, False):
        path = tmp_path / f"damaged-{checksums}.parquet"
        pq.write_table(
            table, path, row_group_size=20, compression="none", use_dictionary=False,
            write_page_checksum=checksums,
        )  # fmt: skip
        st = os.stat(path)
        md = pq.ParquetFile(path).metadata
        with open(path, "r+b") as f:
            for col in (0, 1):
                c = md.row_group(2).column(col)
                f.seek(c.data_page_offset + c.total_compressed_size // 2)
                f.write(b"\xff\x00\xfe\x13" * 4)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        columns = ("t", "ids") if checksums else ("t",)  # without a checksum a number is a number
        for column in columns:
            storage = gl.open_parquet(path, column)
            assert len(storage.read_many_sync(np.arange(40))) == 40  # row groups 0 and 1 are whole
            with pytest.raises(
                gl.DatasetFormatError, match=rf"damaged-{checksums}\.parquet: row group 2, column '{column}'"
            ):
                storage.read_many_sync(np.arange(40, 60))


def test_a_damaged_footer_and_a_truncated_file_are_refused_by_name(folder: Path, tmp_path: Path) -> None:
    dest = copy_of(folder, tmp_path)
    victim = dest / "train-00001-of-00003.parquet"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        gl.DatasetFormatError, match=r"train-00001-of-00003\.parquet: damaged or not a Parquet file"
    ):
        gl.open_parquet(dest, "text")
    victim.write_bytes(data[:-12] + b"\x00" * 8 + data[-4:])  # the footer's bytes overwritten
    with pytest.raises(gl.DatasetFormatError, match=r"train-00001-of-00003\.parquet"):
        gl.open_parquet(dest, "text")


def test_a_file_changed_after_opening_is_refused_at_its_next_read(folder: Path, tmp_path: Path) -> None:
    dest = copy_of(folder, tmp_path)
    storage = gl.open_parquet(dest, "input_ids")
    ids, texts = make_rows(10, seed=9)
    write_files(dest, ids, texts, files=1)  # rewrites train-00000-of-00001: another file
    pq.write_table(
        pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "text": texts}),
        dest / "train-00002-of-00003.parquet",
    )
    with pytest.raises(
        gl.DatasetIntegrityError, match=r"train-00002-of-00003\.parquet: the file changed since"
    ):
        storage.read_many_sync(np.asarray([599], dtype=np.int64))
    assert gl.open_parquet(dest, "input_ids").content_digest() != storage.content_digest()


def test_a_checkpoint_over_changed_files_is_refused(folder: Path, tmp_path: Path) -> None:
    dest = copy_of(folder, tmp_path)
    loader = gl.StatefulDataLoader.from_storage(
        gl.open_parquet(dest, "input_ids"), first_ids, local_batch_size=4, device=CPU
    )
    with loader:
        take(loader, 1)
        state = roundtrip(loader.state_dict())
    os.utime(dest / "train-00000-of-00003.parquet", ns=(1, 1))
    again = gl.StatefulDataLoader.from_storage(
        gl.open_parquet(dest, "input_ids"), first_ids, local_batch_size=4, device=CPU
    )
    with again, pytest.raises(ValueError, match="this checkpoint was saved over another dataset: digest"):
        again.load_state_dict(state)


def test_null_rows_are_an_error_naming_the_row_group_or_empty_documents_counted(tmp_path: Path) -> None:
    ids = [[1, 2], None, [], [3]] * 5
    texts = ["a", None, "", "b"] * 5
    pq.write_table(
        pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "text": texts}),
        tmp_path / "n.parquet",
        row_group_size=4,
    )
    strict = gl.open_parquet(tmp_path, "input_ids")
    assert strict.read_many_sync(np.asarray([0, 2], dtype=np.int64))[1].tolist() == []  # empty: a document
    with pytest.raises(
        gl.DatasetFormatError,
        match=r"n\.parquet: row group 2, column 'input_ids': row 1 \(document 9\) is null; pass on_null=",
    ):
        strict.read_many_sync(np.asarray([9], dtype=np.int64))
    lenient = gl.open_parquet(tmp_path, "text", on_null="empty")
    loader = gl.StatefulDataLoader.from_storage(lenient, list, local_batch_size=20, device=CPU)
    with loader:
        (batch,) = take(loader)
        assert batch == ["a", "", "", "b"] * 5 and loader.stats()["parquet_null_rows"] == 5


def test_options_are_checked_dtype_without_a_tokenizer_too(folder: Path) -> None:
    with pytest.raises(ValueError, match=r"holds texts, read as texts without one: pass tokenizer= too"):
        gl.open_parquet(folder, "text", dtype="int16")


def test_options_are_checked(folder: Path, tokenizer_json: str) -> None:
    with pytest.raises(ValueError, match="on_null"):
        gl.open_parquet(folder, "text", on_null="skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds token ids already"):
        gl.open_parquet(folder, "input_ids", tokenizer=tokenizer_json)
    with pytest.raises(ValueError, match="no such token"):
        gl.open_parquet(folder, "text", tokenizer=tokenizer_json, eos="<eos>")
    with pytest.raises(FileNotFoundError):
        gl.open_parquet(folder / "nothing-*.parquet", "text")
    with pytest.raises(TypeError, match="pass tokenizer="):
        len(gl.pack(gl.open_parquet(folder, "text"), 8))


def test_the_storage_pickles_without_what_it_decoded(folder: Path) -> None:
    storage = gl.open_parquet(folder, "input_ids")
    storage.read_many_sync(np.arange(10, dtype=np.int64))
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.figures()["parquet_row_group_decodes"] == 0
    assert [r.tolist() for r in copy.read_many_sync(np.arange(10, dtype=np.int64))] == [
        r.tolist() for r in storage.read_many_sync(np.arange(10, dtype=np.int64))
    ]


def test_the_footer_index_in_cache_dir_is_reused_for_unchanged_files_only(
    folder: Path, tmp_path: Path
) -> None:
    dest = copy_of(folder, tmp_path)
    cache = tmp_path / "cache"
    first = gl.open_parquet(dest, "input_ids", cache_dir=cache)
    (index,) = cache.glob("parquet-index-*.json")
    victim = dest / "train-00001-of-00003.parquet"
    st = victim.stat()
    data = victim.read_bytes()
    victim.write_bytes(data[:-12] + b"\x00" * 8 + data[-4:])  # same size, a damaged footer
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the version the index holds
    again = gl.open_parquet(dest, "input_ids", cache_dir=cache)  # not read again: the index says
    assert len(again) == len(first) and index.exists()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # another version: read again
    with pytest.raises(gl.DatasetFormatError, match=r"train-00001-of-00003\.parquet"):
        gl.open_parquet(dest, "input_ids", cache_dir=cache)


@pytest.mark.parametrize("edit", ["key", "count"])
def test_a_damaged_footer_index_in_cache_dir_is_rebuilt_not_read(
    folder: Path, tmp_path: Path, edit: str
) -> None:
    cache = tmp_path / "cache"
    first = gl.open_parquet(folder, "input_ids", cache_dir=cache)
    want = [r.tolist() for r in first.read_many_sync(np.arange(len(first), dtype=np.int64))]
    (index,) = cache.glob("parquet-index-*.json")
    text = index.read_text()
    if edit == "key":  # a flipped bit in a key: a raw KeyError before
        text = text.replace('"footer"', '"fooler"', 1)
    else:  # a row count one smaller: rows dropped before
        text = text.replace('"rows": [', '"rows": [1', 1)
    index.write_text(text)
    again = gl.open_parquet(folder, "input_ids", cache_dir=cache)
    assert len(again) == len(first)
    assert [r.tolist() for r in again.read_many_sync(np.arange(len(again), dtype=np.int64))] == want
    assert gl.open_parquet(folder, "input_ids", cache_dir=cache).content_digest() == first.content_digest()


def test_the_fingerprint_follows_the_tokenizers_contents(
    folder: Path, tokenizer_json: str, tmp_path: Path
) -> None:
    """Another tokenizer, or the same tokenizer.json edited, is another dataset: a checkpoint
    over the old one is refused and the length index is not reused."""
    from tokenizers import Tokenizer

    def digest(tok: Any) -> str:
        return gl.open_parquet(folder, "text", tokenizer=tok, eos="</s>").content_digest()

    same = Tokenizer.from_file(tokenizer_json)
    assert digest(tokenizer_json) == digest(same)  # a path and the tokenizer it holds
    other = Tokenizer.from_file(tokenizer_json)
    other.add_tokens(["zzz-added"])
    assert digest(other) != digest(same)
    edited = tmp_path / "tokenizer.json"
    shutil.copy(tokenizer_json, edited)
    before = digest(str(edited))
    other.save(str(edited))  # edited in place, at the same path
    assert digest(str(edited)) != before


def test_a_null_element_inside_a_list_row_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], [3, None, 5]], pa.list_(pa.int64()))}), path)
    storage = gl.open_parquet(path, "input_ids")
    with pytest.raises(
        gl.DatasetFormatError, match=r"nulls.parquet.*row group 0.*input_ids.*row 1 holds a null"
    ):
        storage.read_many_sync(np.arange(2, dtype=np.int64))


def test_dtype_is_refused_for_a_list_column_and_a_file_named_twice(folder: Path) -> None:
    with pytest.raises(ValueError, match=r"holds token ids already.*lists of int32.*drop dtype="):
        gl.open_parquet(folder, "input_ids", dtype=np.uint16)
    files = sorted(str(p) for p in folder.glob("*.parquet"))
    with pytest.raises(ValueError, match="named twice"):
        gl.open_parquet([files[0], files[1], files[0]], "input_ids")
    given_order = gl.open_parquet([files[1], files[0]], "input_ids")
    first = pq.read_table(files[1], columns=["input_ids"]).column(0)[0].as_py()
    assert list(given_order.read_many_sync(np.array([0]))[0]) == first  # a list's own order


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("threads", 0, ValueError, "threads must be >= 1, got 0"),
        ("threads", -4, ValueError, "threads must be >= 1, got -4"),
        ("threads", 2.5, TypeError, "threads must be an int, got float 2.5"),
        ("threads", True, TypeError, "threads must be an int, got bool True"),
        ("max_decoded_bytes", 0, ValueError, "max_decoded_bytes must be >= 1, got 0"),
        ("max_decoded_bytes", -1, ValueError, "max_decoded_bytes must be >= 1, got -1"),
        ("max_decoded_bytes", 1e9, TypeError, "max_decoded_bytes must be an int, got float"),
        ("max_decoded_bytes", "512MiB", TypeError, "max_decoded_bytes must be an int, got str"),
    ],
)
def test_threads_and_max_decoded_bytes_must_be_positive_ints(
    folder: Path, option: str, value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        gl.open_parquet(folder, "input_ids", **{option: value})
    assert len(gl.open_parquet(folder, "input_ids", **{option: np.int64(1)})) == len(
        gl.open_parquet(folder, "input_ids")
    )


def test_explain_names_each_rows_file_row_group_and_row_without_a_length_index(
    folder: Path, tokenizer_json: str, rows: Any
) -> None:
    storage = gl.open_parquet(folder, "text", tokenizer=tokenizer_json)
    loader = gl.StatefulDataLoader.from_storage(
        storage, list, local_batch_size=4, shuffle=True, shuffle_seed=3, device=torch.device("cpu")
    )
    with loader:
        got = next(iter(loader))
        records = loader.explain(step=0, rank=0, epoch=0)
    assert storage._offsets is None  # no pass over every row for it
    files = sorted(folder.glob("*.parquet"))
    per_file = [pq.ParquetFile(f).metadata for f in files]
    for record, tokens in zip(records, got, strict=True):
        ((path, group, row),) = record["files"][0]
        f = [str(p) for p in files].index(path)
        g, r = int(group.removeprefix("row group ")), int(row.removeprefix("row "))
        before = sum(per_file[i].num_rows for i in range(f))
        before += sum(per_file[f].row_group(j).num_rows for j in range(g))
        assert before + r == record["index"]
        assert record["documents"] == [[record["index"], 0, len(tokens)]]


_ZYGOTE_AFTER_ARROW = """
import os, sys, torch
import numpy as np
import guideloom as gl

def first(samples):
    return [int(s[0]) for s in samples]

if __name__ == "__main__":
    storage = gl.open_parquet(sys.argv[1], "input_ids")
    storage.read_many_sync(np.arange(0, len(storage), 7))  # row groups decoded here: Arrow's threads
    def make(**kw):
        return gl.StatefulDataLoader.from_storage(
            storage, first, local_batch_size=8, shuffle=True, shuffle_seed=1,
            shuffle_block_size="auto", device=torch.device("cpu"), **kw,
        )
    with make() as inline:
        want = list(inline)
    with make(num_workers=2, parallel_method="process", collate_mode="workers") as loader:
        got = list(loader)
        print(type(loader._state.life.pool.ctx).__name__, got == want)
"""


def test_process_workers_fork_from_the_main_process_after_arrow_started_its_threads(
    folder: Path, tmp_path: Path
) -> None:
    """pyarrow's pools (its CPU threads, jemalloc's background thread) prepare for a fork
    themselves: workers forked after the main process decoded row groups read and decode their
    own, the same batches."""
    script = tmp_path / "arrow_zygote.py"
    script.write_text(_ZYGOTE_AFTER_ARROW)
    r = run_script(script, str(folder))
    assert r.stdout.split() == ["HereContext", "True"]


# -- footers that do not match their pages, names to skip, names with wildcards -----------------------
@pytest.mark.parametrize("reported", [77, 7_777])
@pytest.mark.parametrize("column", ["text", "input_ids"])
def test_a_footer_that_under_reports_its_rows_is_refused_by_its_row_group(
    tmp_path: Path, reported: int, column: str
) -> None:
    """A footer saying fewer rows than the column chunk's pages hold: the rest would be dropped
    silently; the chunk's own count of values says otherwise, and the row group is refused."""
    from tests.support.parquet_footer import set_num_rows

    n = 77_777
    ids = [[i] * (i % 3) for i in range(n)]  # empty rows too: each counts one value in its chunk
    path = tmp_path / "rows.parquet"
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "text": [f"t{i}" for i in range(n)]})
    pq.write_table(table, path, row_group_size=n)
    whole = gl.open_parquet(path, column)
    assert len(all_rows(whole)) == n and whole.num_row_groups == 1
    set_num_rows(path, 0, reported)
    assert pq.ParquetFile(path).read_row_group(0).num_rows == reported  # pyarrow drops the rest
    where = r"rows\.parquet: row group 0, column '" + column + r"'.*the column chunk holds"
    with pytest.raises(gl.DatasetIntegrityError, match=where):
        storage = gl.open_parquet(path, column)  # a text column: refused by its footer alone
        storage.read_many_sync(np.arange(reported, dtype=np.int64))


def test_names_starting_with_an_underscore_or_a_dot_are_skipped_at_any_level(
    folder: Path, tmp_path: Path, rows: Any
) -> None:
    """Spark's ``_temporary/`` attempts, ``_SUCCESS``-like files and hidden files are not rows of
    the data set, in a folder or under a glob (as pyarrow datasets, Spark and Hugging Face)."""
    dest = copy_of(folder, tmp_path)
    extra = pa.table({"input_ids": pa.array([[9_999]] * 10, pa.list_(pa.int32())), "text": ["x"] * 10})
    for name in (
        "_temporary/0/_temporary/attempt_0/part-00000.parquet",
        "_partial.parquet",
        ".hidden.parquet",
        "sub/.staging/part.parquet",
        "sub/_tmp/part.parquet",
    ):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(extra, dest / name)
    for source in (dest, str(dest / "**" / "*.parquet"), str(dest / "*.parquet")):
        storage = gl.open_parquet(source, "input_ids")
        assert len(storage) == 600 and [r.tolist() for r in all_rows(storage)] == rows[0]
    # a pattern or a list that names them reads them
    assert len(gl.open_parquet(str(dest / "_*.parquet"), "input_ids")) == 10
    assert len(gl.open_parquet([dest / ".hidden.parquet"], "input_ids")) == 10


def test_a_file_whose_name_holds_wildcards_is_that_file(folder: Path, tmp_path: Path) -> None:
    dest = tmp_path / "odd"
    dest.mkdir()
    for name in ("part[x].parquet", "part*.parquet", "partx.parquet"):
        shutil.copy(folder / "train-00000-of-00003.parquet", dest / name)
    assert gl.open_parquet(dest / "part[x].parquet", "input_ids").files == [str(dest / "part[x].parquet")]
    assert gl.open_parquet(str(dest / "part*.parquet"), "input_ids").files == [str(dest / "part*.parquet")]
    assert len(gl.open_parquet(str(dest / "part?.parquet"), "input_ids").files) == 2  # a glob still
    with pytest.raises(FileNotFoundError, match=r"no file matches .*part\[y\]\.parquet.*wildcards"):
        gl.open_parquet(dest / "part[y].parquet", "input_ids")


def test_a_file_whose_footer_changed_under_the_same_size_and_time_is_refused(
    folder: Path, tmp_path: Path
) -> None:
    """Size and modification time are kept by copies (``cp -p``, ``rsync -t``): the footer's
    own bytes identify the file too, checked at its first read, from the footer index as well."""
    dest = copy_of(folder, tmp_path)
    victim = dest / "train-00002-of-00003.parquet"
    opened = gl.open_parquet(dest, "input_ids")
    cached = gl.open_parquet(dest, "input_ids", cache_dir=tmp_path / "cache")  # the footer index
    st = os.stat(victim)
    data = victim.read_bytes()
    assert data.count(b"parquet-cpp-arrow") == 1
    victim.write_bytes(data.replace(b"parquet-cpp-arrow", b"parquet-cpp-ARROW"))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    for storage in (opened, gl.open_parquet(dest, "input_ids", cache_dir=tmp_path / "cache")):
        assert first_ids(storage.read_many_sync(np.asarray([0], np.int64))) == [0]  # another file
        with pytest.raises(gl.DatasetIntegrityError, match=r"00002-of-00003\.parquet: the file changed"):
            storage.read_many_sync(np.asarray([599], np.int64))
    assert gl.open_parquet(dest, "input_ids").content_digest() != cached.content_digest()


def test_a_file_written_over_in_place_while_open_is_refused_whatever_its_times(
    folder: Path, tmp_path: Path
) -> None:
    """A write keeps neither the status change time nor, always, the bytes: one over a file the
    storage reads from (its size and modification time kept, as bit rot or a copy tool would) is
    refused before a row of it is read after the write."""
    dest = copy_of(folder, tmp_path)
    storage = gl.open_parquet(dest, "input_ids")
    assert first_ids(storage.read_many_sync(np.asarray([0], np.int64))) == [0]
    victim = dest / "train-00000-of-00003.parquet"
    st = os.stat(victim)
    with open(victim, "r+b") as fh:
        fh.write(victim.read_bytes())
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(gl.DatasetIntegrityError, match=r"00000-of-00003\.parquet: the file changed"):
        storage.read_many_sync(np.arange(len(storage), dtype=np.int64))


def test_a_first_read_over_several_row_groups_imports_no_masked_arrays(tmp_path: Path) -> None:
    """``np.unique`` would import ``numpy.ma`` (tens of ms) in a new process's first read of
    rows from several row groups (a batch of a global shuffle); nor does importing guideloom."""
    table = pa.table({"ids": pa.array([[i, i + 1] for i in range(40)], pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=10)
    code = (
        "import sys, numpy as np, guideloom as gl\n"
        "assert 'numpy.ma' not in sys.modules\n"
        f"storage = gl.open_parquet({str(tmp_path)!r}, 'ids')\n"
        "rows = storage.read_many_sync(np.array([35, 3, 17, 3], dtype=np.int64))\n"
        "assert [r.tolist() for r in rows] == [[35, 36], [3, 4], [17, 18], [3, 4]], rows\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dictionary", [True, False])
def test_a_text_row_group_decoded_in_slices_reads_as_the_whole_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dictionary: bool
) -> None:
    """A text row group is decoded ``TEXT_BATCH_ROWS`` rows at a time and joined: the same rows,
    null rows where they were (read as empty, or refused by their place), the same row count
    checked against the footer."""
    from guideloom.storage._parquet import _files
    from guideloom.storage._parquet._decode import _Decoded

    monkeypatch.setattr(_files, "TEXT_BATCH_ROWS", 7)
    texts = [None if i % 13 == 5 else f"row {i} " + "é" * (i % 5) for i in range(100)]
    pq.write_table(
        pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=50, use_dictionary=dictionary
    )
    parts: list[int] = []
    joined = _Decoded.joined

    def spy(slices: list[_Decoded]) -> _Decoded:
        parts.append(len(slices))
        return joined(slices)

    monkeypatch.setattr(_Decoded, "joined", staticmethod(spy))
    lenient = gl.open_parquet(tmp_path, "text", on_null="empty")
    assert list(lenient.read_many_sync(np.arange(100))) == [t or "" for t in texts]
    assert parts == [8, 8]  # 50 rows in slices of 7, in each row group
    assert lenient.counts["parquet_null_rows"] == sum(t is None for t in texts)
    strict = gl.open_parquet(tmp_path, "text")
    with pytest.raises(
        gl.DatasetFormatError, match=r"row group 0, column 'text': row 5 \(document 5\) is null"
    ):
        strict.read_many_sync(np.arange(10))
