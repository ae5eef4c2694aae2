"""``guideloom explain``: what one step of a run read, from its checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from guideloom._cli._common import CLIError, UsageError, add_count, int_at_least, require
from guideloom._cli._inspect import Storage, _preview, is_parquet, open_dataset
from guideloom._cli._tokenizers import tokenizer_for_decoding
from guideloom._core.checkpoint import _ORDER_KEYS, _check_position, _check_values
from guideloom._core.provenance import parse_history
from guideloom._core.text import plural
from guideloom._datasets import DatasetAbstract, DocumentDataset, StreamDataset
from guideloom._datasets.packing import pack
from guideloom.storage.base import DocumentStorageAbstract, StreamStorageAbstract

__all__ = ["add_parser"]

EXAMPLES = """\
examples:
  guideloom explain ds --checkpoint ckpt.pt --step 1200 --sequence-length 2048
  guideloom explain ds --checkpoint ckpt.pt --step 1200 --rank 3 --pack concat --sequence-length 2048 \\
      --tokenizer auto
  guideloom explain ds --checkpoint state.json --step 7 --json
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "explain",
        parents=[common],
        help="what one step of a run read: positions, samples, documents, files and byte ranges",
        description="Say what a step of a run read, from the run's loader checkpoint: each sample's "
        "position in the epoch's order, its index, the documents and element ranges it holds, and the "
        "files and byte ranges they are stored at. Nothing is replayed: the checkpoint's history of "
        "batch sizes and world sizes maps the step to its positions.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dataset", metavar="DEST", help="the dataset folder or URL the run read")
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="CKPT",
        help="the run's checkpoint: a torch.save file or a .json file holding the loader's state_dict() "
        "(at the top, or in a nested dict: the first one with an 'observation_offset')",
    )
    p.add_argument(
        "--step", required=True, type=int_at_least(0), metavar="S", help="the step (the epoch's batch)"
    )
    p.add_argument("--rank", type=int_at_least(0), default=0, metavar="R", help="the rank (default 0)")
    p.add_argument("--epoch", type=int_at_least(0), metavar="E", help="the epoch (default: the checkpoint's)")
    p.add_argument(
        "--sequence-length",
        type=int_at_least(1),
        metavar="L",
        help="elements per sample the run used (stream datasets, and --pack)",
    )
    p.add_argument("--pack", choices=("concat", "best_fit"), help="the run packed documents in this mode")
    p.add_argument(
        "--batch-size",
        type=int_at_least(1),
        metavar="B",
        help="local batch size for steps the checkpoint's history does not cover (default: its last)",
    )
    p.add_argument(
        "--world-size",
        type=int_at_least(1),
        metavar="W",
        help="world size for those steps (default: its last)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="bytes|PATH|auto",
        help="decode each sample's pieces with it ('auto': the tokenizer the dataset records)",
    )
    add_count(p, "--chars", 0, 120, "C", "show at most C characters of each piece")
    p.add_argument("--json", action="store_true", help="print the records as JSON lines")
    p.set_defaults(func=run_explain)


def _find_state(value: Any, depth: int = 0) -> Mapping[str, Any] | None:
    """The first dict holding ``observation_offset`` and ``epoch``, depth first, at most 6 levels down."""
    if not isinstance(value, Mapping) or depth > 6:
        return None
    if "observation_offset" in value and "epoch" in value:
        return value
    for child in value.values():
        found = _find_state(child, depth + 1)
        if found is not None:
            return found
    return None


_HOW = (
    "pass the file the run saved with torch.save({..., 'loader': loader.state_dict()}) or "
    "json.dump(loader.state_dict())"
)


def _load_reason(exc: Exception) -> str:
    """What ``torch.load`` or ``json`` found wrong with a file, in a few words."""
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if found:
        return f"it holds a Python object of {found.group(1)}, which is not unpickled: only plain values are"
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", text, re.S)
    if found:
        text = found.group(1)
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())
    return text[:120] or type(exc).__name__


def _read_checkpoint(file: Path) -> Any:
    """The file's contents: JSON by its suffix, otherwise ``torch.load`` with ``weights_only``
    (plain values only: nothing in the file is run). Anything else, a random file, a pickle of
    other objects, a structure nested too deep to read, is a :class:`CLIError`."""
    try:
        if file.suffix == ".json":
            return json.loads(file.read_text(encoding="utf-8"))
        torch = require("torch", "reading a torch.save checkpoint")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its warnings of a file it then refuses: the error says it
            return torch.load(file, weights_only=True, map_location="cpu")
    except CLIError:
        raise
    except RecursionError:
        reason = "it is nested too deep to be a checkpoint"
    except OSError as exc:
        raise CLIError(f"--checkpoint {file}: cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:  # torch.load and json raise many kinds for a file that is neither
        reason = _load_reason(exc)
    kind = "a JSON file" if file.suffix == ".json" else "a torch.save file of plain values"
    raise CLIError(f"--checkpoint {file} is not {kind} ({reason}); {_HOW}")


def _plain(value: Any) -> Any:
    """A one-element tensor or numpy value as its Python value; anything else as it is."""
    numel = getattr(value, "numel", None)
    count = numel() if callable(numel) else getattr(value, "size", None)
    return value.item() if count == 1 and hasattr(value, "item") else value


def _load_state(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise CLIError(f"--checkpoint {path}: no such file")
    raw = _read_checkpoint(file)
    state = _find_state(raw)
    if state is None:
        raise CLIError(
            f"--checkpoint {path} holds no loader state (a dict with 'epoch' and 'observation_offset', "
            f"at most 6 dicts deep); {_HOW}"
        )
    out = {str(k): _plain(v) for k, v in state.items()}
    try:  # checked before a loader is made of them: a damaged value is named, not run into
        _check_position(out["epoch"], out["observation_offset"])
        _check_values(out, _ORDER_KEYS, "")
    except ValueError as exc:
        raise CLIError(f"--checkpoint {path}: {exc}") from None
    return out


def _dataset(args: argparse.Namespace, storage: Storage) -> DatasetAbstract[Any]:
    if isinstance(storage, StreamStorageAbstract):
        if args.sequence_length is None:
            raise UsageError("a stream dataset's samples need --sequence-length (the run's sequence_length)")
        if args.pack:
            raise UsageError("--pack packs documents; this is a stream dataset")
        return StreamDataset(storage, args.sequence_length)
    assert isinstance(storage, DocumentStorageAbstract)
    if args.pack:
        if args.sequence_length is None:
            raise UsageError("--pack needs --sequence-length (the run's sequence_length)")
        return pack(storage, args.sequence_length, args.pack)
    if args.sequence_length is not None:
        raise UsageError("--sequence-length of a document dataset means packing: add --pack concat|best_fit")
    return DocumentDataset(storage)


def _geometry(state: Mapping[str, Any], args: argparse.Namespace) -> tuple[int, int]:
    segments = parse_history(state.get("history", "")).segments
    b = args.batch_size or (segments[-1].local_batch_size if segments else None)
    w = args.world_size or (segments[-1].world_size if segments else None)
    if b is None or w is None:
        raise UsageError(
            "the checkpoint has no history of batch sizes (saved before any step): pass --batch-size "
            "and --world-size"
        )
    return b, w


def _explain(
    args: argparse.Namespace, state: dict[str, Any], dataset: DatasetAbstract[Any]
) -> list[dict[str, Any]]:
    from guideloom.pytorch import StatefulDataLoader

    if state.get("shuffle") and state.get("shuffle_seed") is None:
        raise CLIError(
            "the run shuffled with shuffle_seed=None (a random order per run): its order cannot be remade"
        )
    b, w = _geometry(state, args)
    block = state.get("shuffle_block_size")
    loader = StatefulDataLoader(
        dataset,
        collate_fn=list,
        device="cpu",  # type: ignore[arg-type]
        local_batch_size=b,
        world_size=w,
        shuffle=bool(state.get("shuffle", False)),
        shuffle_seed=state.get("shuffle_seed"),
        drop_last=bool(state.get("drop_last", True)),
        shuffle_block_size=block,
        shuffle_window=int(state.get("shuffle_window", 16)),
    )
    with loader, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the run's own values: nothing to warn about
        loader.load_state_dict(state)  # type: ignore[arg-type]
        try:
            return loader.explain(args.step, rank=args.rank, epoch=args.epoch)
        except IndexError as exc:
            raise CLIError(str(exc)) from None


async def _pieces(storage: Storage, records: list[dict[str, Any]]) -> list[list[np.ndarray[Any, Any]]]:
    """Each record's element ranges, read."""
    await storage.open()
    try:
        out = []
        for rec in records:
            ranges = rec.get("elements", [])
            if isinstance(storage, StreamStorageAbstract):
                got = [await storage.read_many(np.asarray([a], dtype=np.int64), b - a) for a, b in ranges]
                out.append([np.asarray(g[0]["tokens"] if isinstance(g[0], Mapping) else g[0]) for g in got])
            else:
                starts = np.asarray([a for a, _ in ranges], dtype=np.int64)
                stops = np.asarray([b for _, b in ranges], dtype=np.int64)
                spans = await storage.read_spans(starts, stops) if len(ranges) else []
                out.append([np.asarray(s) for s in spans])
        return out
    finally:
        await storage.close()


def _lines(records: list[dict[str, Any]], texts: list[list[str]] | None) -> list[str]:
    if not records:
        return ["no samples: this rank's block lies past the end of the epoch's last, partial batch"]
    head = records[0]
    lines = [
        f"epoch {head['epoch']} step {head['step']} rank {head['rank']}: {plural(len(records), 'sample')}"
    ]
    for i, rec in enumerate(records):
        where = f"  [{i}] position {rec['position']:,}  index {rec['index']:,}"
        if "source" in rec:
            where += f"  source {rec['source']} #{rec['source_index']:,}"
        lines.append(where)
        pieces = rec.get("documents") or [None] * len(rec.get("elements", []))
        files = rec.get("files") or [[] for _ in pieces]
        for k, (doc, (a, b)) in enumerate(zip(pieces, rec.get("elements", []), strict=True)):
            what = f"document {doc[0]:,} [{doc[1]:,}, {doc[2]:,})" if doc is not None else "elements"
            lines.append(f"      {what}  elements [{a:,}, {b:,})")
            for path, lo, hi in files[k]:
                lines.append(f"        {path}  bytes [{lo:,}, {hi:,})")
            if texts is not None:
                lines.append(f"        {texts[i][k]}")
    return lines


def run_explain(args: argparse.Namespace) -> int:
    if is_parquet(args.dataset):
        raise ValueError(
            f"{args.dataset} holds Parquet files, which a run reads with gl.open_parquet: explain "
            "that run's steps from Python, with loader.explain(step=..., rank=...) on a loader over "
            "the same files (each row's file, row group and row); this command reads datasets "
            "guideloom wrote"
        )
    state = _load_state(args.checkpoint)
    manifest, storage = open_dataset(args.dataset)
    records = _explain(args, state, _dataset(args, storage))
    if args.json:
        for rec in records:
            print(json.dumps(rec))
        return 0
    texts = None
    if args.tokenizer:
        tokenizer = tokenizer_for_decoding(args.tokenizer, manifest.extra if manifest is not None else {})
        pieces = asyncio.run(_pieces(storage, records))
        texts = [[_preview(tokenizer, p, args.chars) for p in rec] for rec in pieces]
    print("\n".join(_lines(records, texts)))
    return 0
