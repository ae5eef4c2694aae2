"""``guideloom explain``: what a step of a run read, from the run's checkpoint file."""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import guideloom as gl
from tests.support.cli import Run


def run_and_save(dest: Path, ckpt: Path) -> gl.StatefulDataLoader[object, object]:
    """Two stretches of a run over packed documents (batches of 3 on 2 ranks, then of 5 on 1),
    the checkpoint saved with torch.save inside a training checkpoint."""

    def make(b: int, w: int) -> gl.StatefulDataLoader[object, object]:
        ds = gl.pack(gl.open_documents(dest), 12, "concat")  # type: ignore[arg-type]
        return gl.StatefulDataLoader(
            ds,
            list,
            device=torch.device("cpu"),
            local_batch_size=b,
            world_size=w,
            shuffle=True,
            shuffle_seed=4,
        )

    first = make(3, 2)
    with first:
        it = iter(first)
        for _ in range(3):
            next(it)
        it.close()
        state = first.state_dict()
    second = make(5, 1)
    with second:
        second.load_state_dict(state)
        it = iter(second)
        for _ in range(2):
            next(it)
        it.close()
        torch.save({"model": {}, "loader": second.state_dict()}, ckpt)
    return second


def test_explain_prints_what_the_loader_explains(tmp_path: Path, cli: Callable[..., Run]) -> None:
    text = [f"document number {i} ".encode() * (1 + i % 3) for i in range(80)]
    gl.write_documents(tmp_path / "ds", [np.frombuffer(t, dtype=np.uint8).astype(np.uint16) for t in text])
    loader = run_and_save(tmp_path / "ds", tmp_path / "ckpt.pt")
    args = ["explain", tmp_path / "ds", "--checkpoint", tmp_path / "ckpt.pt", "--pack", "concat"]
    for step, rank in ((1, 1), (4, 0)):  # a step of each stretch
        run = cli(*args, "--sequence-length", 12, "--step", step, "--rank", rank, "--json")
        assert run.code == 0, run
        got = [json.loads(line) for line in run.out.splitlines()]
        assert got == json.loads(json.dumps(loader.explain(step, rank=rank)))
    run = cli(*args, "--sequence-length", 12, "--step", 4, "--tokenizer", "bytes")
    assert run.code == 0, run
    first = loader.explain(4)[0]
    doc, a, b = first["documents"][0]
    assert "epoch 0 step 4 rank 0: 5 samples" in run.out
    assert f"document {doc} [{a}, {b})" in run.out
    assert repr(text[doc][a:b].decode()) in run.out  # decoded as inspect decodes
    assert "shard" in run.out or str(tmp_path / "ds") in run.out  # the file it lies in


def test_explain_refuses_what_it_cannot_answer(tmp_path: Path, cli: Callable[..., Run]) -> None:
    gl.write_stream(tmp_path / "s", np.arange(400, dtype=np.uint16))
    (tmp_path / "state.json").write_text(
        json.dumps(
            {"epoch": 0, "observation_offset": 8, "shuffle": False, "shuffle_seed": None, "drop_last": True}
        )
    )
    base = ["explain", tmp_path / "s", "--checkpoint", tmp_path / "state.json", "--step", 3]
    run = cli(*base)
    assert run.code == 2 and "--sequence-length" in run.err
    run = cli(*base, "--sequence-length", 10)
    assert run.code == 2 and "--batch-size and --world-size" in run.err
    run = cli(*base, "--sequence-length", 10, "--batch-size", 4, "--world-size", 1)
    assert run.code == 0, run
    assert "position 12" in run.out and "elements [120, 130)" in run.out
    run = cli(*base[:-1], 99, "--sequence-length", 10, "--batch-size", 4, "--world-size", 1)
    assert run.code == 1 and "outside epoch 0" in run.err
    run = cli("explain", tmp_path / "s", "--checkpoint", tmp_path / "none.pt", "--step", 0)
    assert run.code == 1 and "no such file" in run.err


class _Runs:
    """An object whose unpickling would create a file: what a checkpoint must never do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (self.marker,))


def _nested_pickle(depth: int) -> bytes:
    """A torch.save file whose pickle is a list nested ``depth`` deep, written by hand (pickling
    one would recurse as deep)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b".")
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")
    return buf.getvalue()


def test_explain_refuses_a_file_that_is_no_checkpoint_in_one_line(
    tmp_path: Path, cli: Callable[..., Run]
) -> None:
    gl.write_stream(tmp_path / "s", np.arange(400, dtype=np.uint16))
    state = {"epoch": 0, "observation_offset": 8, "shuffle": False, "shuffle_seed": None, "drop_last": True}
    marker = tmp_path / "ran"
    files: dict[str, tuple[bytes | str | object, str]] = {
        "random.pt": (np.random.default_rng(0).bytes(4096), "is not a torch.save file of plain values"),
        "objects.pt": ({"loader": state, "x": _Runs(marker)}, "holds a Python object of"),
        "pickled.pt": (pickle.dumps({"loader": state}), "is not a torch.save file of plain values"),
        "deep.pt": (_nested_pickle(100_000), "holds no loader state"),
        "deep.json": ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        "deep-dict.json": ('{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deep"),
        "text.json": ("not json", "is not a JSON file"),
        "empty.json": ("{}", "holds no loader state"),
        "list-epoch.pt": ({"loader": {**state, "epoch": [[[[1]]]]}}, "epoch must be an int >= 0"),
        "tensor-epoch.pt": ({"loader": {**state, "epoch": torch.arange(3)}}, "epoch must be an int >= 0"),
        "seed.json": (
            json.dumps({**state, "shuffle_seed": [1] * 5}),
            "'shuffle_seed' must be an int or None",
        ),
        "history.json": (
            json.dumps({**state, "history": "0:0:0:2:1;0:4:1:2:1"}),
            r"history[1].step is 1, expected 2",
        ),
        "huge-history.json": (
            json.dumps({**state, "history": ";".join(["0:0:0:1:1"] * 10**6)}),
            "characters long, more than the 256 entries",
        ),
    }
    for name, (content, message) in files.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            torch.save(content, path)
        run = cli("explain", tmp_path / "s", "--checkpoint", path, "--step", 0, "--sequence-length", 10)
        assert run.code == 1, (name, run)
        assert message in run.err and "Traceback" not in run.err, (name, run)
        assert len(run.err.strip().splitlines()) == 1 and run.err.startswith("guideloom: error: "), (
            name,
            run,
        )
    assert not marker.exists()  # nothing in a checkpoint file is run
