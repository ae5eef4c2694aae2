"""The home page is the map of the site: it links every page of the nav, and the checkpoint keys
it lists are those a loader's ``state_dict()`` has."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.support import ROOT
from tests.support.docs import DOCS


def _nav_pages(entries: object) -> list[str]:
    """Every page path of an mkdocs ``nav`` (nested sections included)."""
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, list):
        return [page for entry in entries for page in _nav_pages(entry)]
    if isinstance(entries, dict):
        return [page for value in entries.values() for page in _nav_pages(value)]
    return []


def _nav() -> list[str]:
    yaml = pytest.importorskip("yaml", reason='the docs extra is not installed: pip install -e ".[docs]"')

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml names python objects (!!python/name:...): read as None, the nav needs none
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    return _nav_pages(config["nav"])


def test_the_home_page_links_every_page_of_the_nav() -> None:
    linked = set(re.findall(r"\]\(([^)#]+\.md)", (DOCS / "index.md").read_text()))
    missing = [page for page in _nav() if page != "index.md" and page not in linked]
    assert len(_nav()) >= 20
    assert not missing, f"docs/index.md links no {missing}"


def test_the_home_page_lists_the_keys_a_state_has() -> None:
    import guideloom as gl

    text = (DOCS / "index.md").read_text()
    table = text[text.index("| key | what it holds |") :].split("\n\n")[0]
    listed = {key for row in table.splitlines()[2:] for key in re.findall(r"`(\w+)`", row.split("|")[1])}
    storage = gl.MemoryStreamStorage(np.arange(1_000, dtype=np.uint16))
    for options in ({}, {"shuffle": True, "shuffle_seed": 0}):
        loader = gl.StatefulDataLoader.from_storage(
            storage, list, sequence_length=8, local_batch_size=2, device="cpu", **options
        )
        with loader:
            next(iter(loader))
            assert set(loader.state_dict()) == listed
