"""The Benchmarks page is generated: the method and the latest figures, never a figure's history."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.suite.report import check_figures, docs_page
from tests.support import ROOT

FIGURES = ROOT / "benchmarks" / "suite" / "figures.md"


def test_the_page_is_what_the_report_writes() -> None:
    # Edited by hand, the page would drift from the generator (python -m benchmarks report).
    out = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page == docs_page(out, FIGURES.read_text()), "run `python -m benchmarks report` to regenerate"
    assert "## Latest figures" in page and out["date"] not in page


def test_the_changelog_is_in_the_nav() -> None:
    assert "changelog.md" in (ROOT / "mkdocs.yml").read_text()
    assert (ROOT / "docs" / "changelog.md").is_file()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("## Merge\n\n`python -m benchmarks merge`\n\n| run | before s | after s |\n", "'| before'"),
        ("## Merge\n\n`python -m benchmarks merge`: previous figures were lower.\n", "'previous'"),
        ("## Merge\n\n`python -m benchmarks merge` while another session loaded the machine.\n", "session"),
        ("## Merge\n\n`python -m benchmarks merge` on 2026-01-02.\n", "2026-01-02"),
        ("## Merge\n\nThe merge takes 1 s.\n", "names no `python -m benchmarks"),
        ("Some text.\n", "no '## ' section"),
    ],
)
def test_check_figures_refuses_history_and_sections_without_a_command(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"figures\.md") as caught:
        check_figures(text)
    assert says in str(caught.value)


def test_check_figures_passes_the_latest_figures_and_code_spans() -> None:
    check_figures("## Merge\n\n`python -m benchmarks merge --parts 10000`, `previous` in code is a name.\n")
    check_figures(FIGURES.read_text())


def test_the_page_lists_every_benchmark_command() -> None:
    # The table comes from the entry point's docstring; a command missing there is missing here.
    from benchmarks import __main__ as entry

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for command in ["suite", "report", *entry._PASSTHROUGH]:
        assert re.search(rf"^\| `python -m benchmarks {command}[ `]", page, re.M), command
