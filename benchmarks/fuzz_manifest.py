"""Fuzz the manifest reader: whatever the bytes, a valid Manifest or a DatasetFormatError.

    python -m benchmarks fuzz                 # an hour of cases
    python -m benchmarks fuzz --minutes 3     # a short run

Cases come from hypothesis, three ways: valid manifests (every kind, dtype, field and file
count), valid manifests with structure-aware mutations (a node replaced by another JSON value,
a hostile integer or string, deleted, wrapped, a file entry duplicated), and the serialised bytes
of either with byte-level mutations (truncated, bytes flipped, hostile snippets spliced in: a
5000-digit integer, 100,000 open brackets, lone surrogates, NaN). The only allowed outcomes are a
:class:`~guideloom.Manifest`-like result that serialises back to itself, or a
:class:`~guideloom.DatasetFormatError` that names the file; :func:`read_manifest_file` adds
``FileNotFoundError`` and the size bound. Anything else is a bug, shrunk by hypothesis and
printed. ``tests/storage/test_manifest_fuzz.py`` runs the same properties for a few seconds.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks._internals import (
    MANIFEST_NAME,
    SUPPORTED_DTYPES,
    ArraySpec,
    FileSpec,
    Kind,
    Manifest,
    parse_manifest,
    storage_dtype,
)
from guideloom import DatasetFormatError

WHERE = f"fuzz/{MANIFEST_NAME}"
_HEX = "0123456789abcdef"

# -- valid manifests --------------------------------------------------------------------------------
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def _array(draw: st.DrawFn, name: str, dtype: str, total: int | None = None) -> ArraySpec:
    """An array of ``dtype`` in 0-4 files; ``total`` elements when given (split at random)."""
    dt = storage_dtype(dtype)
    if total is None:
        counts = draw(st.lists(st.integers(0, 2**40), max_size=4))
    elif total == 0:
        counts = draw(st.lists(st.just(0), max_size=2))
    else:
        cuts = sorted(draw(st.lists(st.integers(0, total), max_size=3)))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    files = tuple(
        FileSpec(
            path=f"{name}-{draw(st.text(_HEX, min_size=8, max_size=8))}-{i:05d}.bin",
            elements=n,
            nbytes=n * dt.itemsize,
            sha256=draw(st.text(_HEX, min_size=64, max_size=64)),
        )
        for i, n in enumerate(counts)
    )
    return ArraySpec(dtype=dt, files=files)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    """A self-consistent manifest of either kind, as the writers would produce."""
    kind: Kind = draw(st.sampled_from(["stream", "documents"]))
    tokens = draw(_array("tokens", draw(st.sampled_from(SUPPORTED_DTYPES))))
    fields = {"tokens": tokens}
    offsets, num_documents = None, 0
    if kind == "stream":
        for name in draw(st.lists(st.from_regex(r"[a-z_][a-z0-9_.-]{0,12}", fullmatch=True), max_size=3)):
            if name != "tokens":
                fields[name] = draw(_array(name, draw(st.sampled_from(SUPPORTED_DTYPES)), tokens.length))
    else:
        num_documents = draw(st.integers(0, 2**40))
        offsets = draw(_array("offsets", "int64", num_documents + 1))
    info = draw(st.dictionaries(st.text(max_size=10), json_values, max_size=4))
    manifest = Manifest(kind=kind, fields=fields, offsets=offsets, num_documents=num_documents, extra=info)
    # Distinct names: the random parts could collide (a real writer's never do).
    paths = [f.path for _, _, f in manifest.all_files()]
    if len(set(paths)) != len(paths):
        return Manifest(kind=kind, fields={"tokens": ArraySpec(tokens.dtype, ())}, extra=info)
    return manifest


# -- mutations -----------------------------------------------------------------------------------------
HOSTILE_VALUES: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    1,
    2**63,
    2**64 + 1,
    -(2**63),
    10**300,
    1e308,
    float("inf"),
    float("nan"),
    -0.0,
    "",
    "/etc/passwd",
    "../escape.bin",
    "a/../../b",
    "C:\\x.bin",
    "x\x00y",
    "\ud800",
    "\n",
    "manifest.json",
    "uint16",
    "<u2",
    "u2",
    "S5",
    "(2)i4",
    "i4,i4",
    "object",
    "datetime64[ns]",
    "x" * 5000,
    [],
    {},
    [[[]]],
    {"dtype": "uint8", "files": []},
    {"names": ["a"], "formats": ["i4"]},
    {"names": 1},
]
HOSTILE_SNIPPETS = [
    b"9" * 5000,
    b"-" + b"1" * 4400,
    b"[" * 100_000,
    b"{" * 50_000,
    b'{"a":' * 20_000,
    b'"\\ud800"',
    b'"\\udfff\\ud800"',
    b"NaN",
    b"-Infinity",
    b"1e999999",
    b"\xff\xfe",
    b"\xef\xbb\xbf",
    b"\x00",
    b'"' + b"\\" * 1001 + b'"',
    b"0." + b"0" * 5000 + b"1",
    b"[" * 70 + b"]" * 70,
]


def _slots(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key-or-index) of a parsed JSON document, walked without recursion."""
    out: list[tuple[Any, Any]] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else ()
        for k in keys:
            out.append((node, k))
            stack.append(node[k])
    return out


@st.composite
def mutated_docs(draw: st.DrawFn) -> Any:
    """A valid manifest's JSON with 1-4 structure-aware edits."""
    doc = json.loads(draw(manifests()).to_json_bytes())
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(doc)
        if not slots:
            break
        node, key = draw(st.sampled_from(slots))
        op = draw(st.sampled_from(["hostile", "random", "delete", "wrap", "deep", "duplicate", "add"]))
        if op == "hostile":
            node[key] = copy.deepcopy(draw(st.sampled_from(HOSTILE_VALUES)))  # later edits must not reach it
        elif op == "random":
            node[key] = draw(json_values)
        elif op == "delete":
            del node[key]
        elif op == "wrap":
            node[key] = draw(st.sampled_from([[node[key]], {"x": node[key]}]))
        elif op == "deep":
            value: Any = node[key]
            for _ in range(draw(st.integers(1, 60))):  # json.dumps must not hit the recursion limit
                value = [value]
            node[key] = value
        elif op == "duplicate" and isinstance(node, list):
            node.append(node[key])
        elif isinstance(node, dict):
            node[draw(st.sampled_from(["extra", "format", "kind", "offsets", "num_documents", "info"]))] = (
                copy.deepcopy(draw(st.sampled_from(HOSTILE_VALUES)))
            )
    return doc


@st.composite
def mutated_bytes(draw: st.DrawFn, source: st.SearchStrategy[bytes]) -> bytes:
    """``source``'s bytes, truncated, flipped or with hostile snippets spliced in."""
    data = bytearray(draw(source))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["truncate", "flip", "splice", "replace", "random"]))
        if op == "truncate":
            del data[at:]
        elif op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "splice":
            data[at:at] = draw(st.sampled_from(HOSTILE_SNIPPETS))
        elif op == "replace":
            width = draw(st.integers(1, 40))
            data[at : at + width] = draw(st.sampled_from(HOSTILE_SNIPPETS))
        else:
            data[at:at] = draw(st.binary(max_size=16))
    return bytes(data)


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()


valid_bytes = manifests().map(lambda m: m.to_json_bytes())
mutated_doc_bytes = mutated_docs().map(_dumps)
any_case = st.one_of(
    valid_bytes,
    mutated_doc_bytes,
    mutated_bytes(valid_bytes),
    mutated_bytes(mutated_doc_bytes),
    st.binary(max_size=64),
)


# -- the oracle ------------------------------------------------------------------------------------------
def check(data: bytes) -> str:
    """Parse ``data``: ``"valid"`` or the kind of refusal; an unexpected outcome raises."""
    try:
        manifest = parse_manifest(data, WHERE)
    except DatasetFormatError as exc:
        message = str(exc)
        assert message.startswith(WHERE), f"the error does not name the file: {message!r}"
        assert len(message) < 2000, f"an error message of {len(message)} characters"
        return "DatasetFormatError"
    again = manifest.to_json_bytes()
    assert parse_manifest(again, WHERE).to_json_bytes() == again, "a parsed manifest does not round-trip"
    return "valid"


def check_valid(manifest: Manifest) -> None:
    """A manifest the writers could produce parses back to itself."""
    data = manifest.to_json_bytes()
    assert check(data) == "valid"
    parsed = parse_manifest(data, WHERE)
    assert parsed.to_json_bytes() == data  # info compared as bytes: NaN != NaN
    assert dataclasses.replace(parsed, extra={}) == dataclasses.replace(manifest, extra={})


# -- the run ------------------------------------------------------------------------------------------------
def run(minutes: float, batch: int = 500) -> dict[str, Any]:
    """Run the properties until ``minutes`` have passed; return the totals."""
    outcomes: Counter[str] = Counter()
    deadline = time.monotonic() + minutes * 60
    started = time.monotonic()
    fuzz_settings = settings(
        max_examples=batch,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    @fuzz_settings
    @given(any_case)
    def cases(data: bytes) -> None:
        outcomes[check(data)] += 1

    @fuzz_settings
    @given(manifests())
    def valid(manifest: Manifest) -> None:
        check_valid(manifest)
        outcomes["valid (generated)"] += 1

    rounds = 0
    while time.monotonic() < deadline:
        (valid if rounds % 5 == 4 else cases)()
        rounds += 1
        total = sum(outcomes.values())
        elapsed = time.monotonic() - started
        print(
            f"  {elapsed / 60:5.1f} min: {total:,} cases ({total / elapsed:,.0f}/s): "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(outcomes.items())),
            flush=True,
        )
    elapsed = time.monotonic() - started
    total = sum(outcomes.values())
    return {"cases": total, "seconds": elapsed, "cases_per_s": total / elapsed, "outcomes": dict(outcomes)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--minutes", type=float, default=60.0, help="how long to run (default 60)")
    args = ap.parse_args(argv)
    print(f"fuzzing the manifest reader for {args.minutes:g} min ...", flush=True)
    out = run(args.minutes)
    print(
        f"done: {out['cases']:,} cases in {out['seconds'] / 60:.1f} min ({out['cases_per_s']:,.0f} cases/s), "
        "no outcome other than a valid manifest or DatasetFormatError: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(out["outcomes"].items()))
    )


if __name__ == "__main__":
    main(sys.argv[1:])
