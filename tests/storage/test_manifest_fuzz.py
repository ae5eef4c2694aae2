"""A few seconds of the manifest fuzzer (``python -m benchmarks fuzz`` runs it for an hour).

Whatever the bytes (valid manifests, structure-aware mutations of them, byte-level damage), the
reader gives a manifest that serialises back to itself or a ``DatasetFormatError`` naming the file.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings

from benchmarks.fuzz_manifest import any_case, check, check_valid, manifests, mutated_bytes, valid_bytes
from guideloom.storage._format._manifest import Manifest

_FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(manifests())
def test_every_manifest_a_writer_makes_parses_back_to_itself(manifest: Manifest) -> None:
    check_valid(manifest)


@_FAST
@given(any_case)
def test_any_bytes_give_a_manifest_or_a_format_error(data: bytes) -> None:
    assert check(data) in ("valid", "DatasetFormatError")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_bytes(valid_bytes))
def test_damaged_bytes_give_a_manifest_or_a_format_error(data: bytes) -> None:
    assert check(data) in ("valid", "DatasetFormatError")


@settings(max_examples=10, deadline=None)
@given(manifests())
def test_a_long_bad_field_name_is_cut_short_in_the_error(manifest: Manifest) -> None:
    data = json.loads(manifest.to_json_bytes())
    data["fields"]["9" * 5000] = data["fields"]["tokens"]
    assert check(json.dumps(data).encode()) == "DatasetFormatError"
