"""The loader reference's parameter table is the constructor's: every parameter once, with its
default as the signature has it."""

from __future__ import annotations

import inspect
import re

from tests.support.docs import DOCS


def _rows() -> list[list[str]]:
    text = (DOCS / "reference" / "loader.md").read_text()
    table = text[text.index("| Name | Type | Description | Default |") :].split("\n\n")[0]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in table.splitlines()[2:]]


def test_the_table_names_every_parameter_once() -> None:
    import guideloom as gl

    names = [re.fullmatch(r"`(\w+)`", row[0]).group(1) for row in _rows()]  # type: ignore[union-attr]
    init = [p for p in inspect.signature(gl.StatefulDataLoader.__init__).parameters if p != "self"]
    from_storage = inspect.signature(gl.StatefulDataLoader.from_storage).parameters
    assert len(names) == len(set(names)), f"a parameter is listed twice: {names}"
    assert set(names) == set(init) | {"sequence_length"}
    assert "sequence_length" in from_storage


def test_the_defaults_are_the_signatures() -> None:
    import guideloom as gl

    signature = inspect.signature(gl.StatefulDataLoader.__init__).parameters
    for row in _rows():
        name, default = row[0].strip("`"), row[-1]
        if name not in signature or not default.startswith("`"):
            continue  # sequence_length (from_storage's), the device (a factory), "required"
        assert default == f"`{signature[name].default!r}`".replace("'", '"'), name
