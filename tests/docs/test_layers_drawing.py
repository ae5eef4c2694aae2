"""The layer drawing of the docs (docs/assets/layers.svg) names every package and module of
guideloom, so that a folder or module added or moved shows up there."""

from __future__ import annotations

import re
import xml.dom.minidom
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRAWING = ROOT / "docs" / "assets" / "layers.svg"


def _texts() -> str:
    dom = xml.dom.minidom.parse(str(DRAWING))
    return "\n".join(
        "".join(n.data for n in t.childNodes if n.nodeType == n.TEXT_NODE)
        for t in dom.getElementsByTagName("text")
    )


def test_the_layer_drawing_names_every_package_and_module() -> None:
    words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", _texts()))
    texts = _texts()
    package = ROOT / "guideloom"
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py":
            if path.parent != package and f"{path.parent.name}/" not in texts:
                missing.append(str(path.parent.relative_to(ROOT)) + "/")
            continue
        if path.stem not in words and path.stem.lstrip("_") not in words:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/assets/layers.svg does not show {missing}: add them to its layers"
