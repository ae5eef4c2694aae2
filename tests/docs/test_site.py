"""The built site: no broken internal link, and four pages that render in headless Chromium.

The screenshots are kept in ``site/screenshots/`` (CI's artifact, beside the site ``make docs``
builds).
"""

from __future__ import annotations

import functools
import html
import http.server
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest

from tests.support import ROOT
from tests.support.docs import read_png

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = ROOT / "site" / "screenshots"
PAGES = {  # screenshot name -> (path, the page's <title>)
    "home": ("", "guideloom"),
    "loader-reference": ("reference/loader/", "StatefulDataLoader - guideloom"),
    "checkpointing": ("checkpointing/", "Checkpointing - guideloom"),
    # long code lines: they wrap (docs/assets/extra.css) instead of hiding past the block's edge
    "parquet": ("parquet/", "Training on Parquet - guideloom"),
}
_LINK = re.compile(r'\s(?:href|src)="([^"]+)"')
_ID = re.compile(r'\sid="([^"]+)"')


def internal_links(page: Path) -> Iterator[str]:
    for raw in _LINK.findall(page.read_text()):
        url = html.unescape(raw)
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or url.startswith(("mailto:", "data:", "javascript:")):
            continue
        yield url


def resolve(site: Path, page: Path, url: str) -> tuple[Path, str]:
    """The file a relative link of ``page`` points to, and its fragment."""
    parts = urlsplit(url)
    target = page if not parts.path else (page.parent / unquote(parts.path))
    if parts.path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target.resolve(), parts.fragment


def test_every_internal_link_resolves(built_site: Path) -> None:
    pages = sorted(built_site.rglob("*.html"))
    assert len(pages) >= 12
    ids = {p.resolve(): set(_ID.findall(p.read_text())) for p in pages}
    broken = []
    checked = 0
    for page in pages:
        if page.name == "404.html":
            continue  # its links are relative to wherever the server shows it
        for url in internal_links(page):
            target, fragment = resolve(built_site, page, url)
            checked += 1
            if not target.is_file() or built_site.resolve() not in target.parents:
                broken.append(f"{page.relative_to(built_site)}: {url} (no file)")
            elif fragment and target in ids and fragment not in ids[target]:
                broken.append(f"{page.relative_to(built_site)}: {url} (no #{fragment})")
    assert checked > 500
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "a" / "index.html"
    page.parent.mkdir()
    page.write_text('<a href="../b/">b</a> <a href="https://example.org/">x</a> <img src="../c.png">')
    (tmp_path / "c.png").write_bytes(b"")
    links = list(internal_links(page))
    assert links == ["../b/", "../c.png"]
    assert not resolve(tmp_path, page, "../b/")[0].is_file()
    assert resolve(tmp_path, page, "../c.png")[0].is_file()


class _Handler(http.server.SimpleHTTPRequestHandler):
    statuses: list[tuple[int, str]]

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.statuses.append((int(code) if str(code).isdigit() else 0, self.path))

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def served_site(built_site: Path) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    statuses: list[tuple[int, str]] = []
    handler = type("Handler", (_Handler,), {"statuses": statuses})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(built_site))
    )
    thread = threading.Thread(target=server.serve_forever, name="docs-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", statuses
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
        *args,
    ]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=90)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(
    not CHROMIUM.exists(), reason="chromium is not installed (.ci/install-servers.sh installs it)"
)
def test_pages_render_in_headless_chromium(
    served_site: tuple[str, list[tuple[int, str]]], tmp_path: Path
) -> None:
    base, statuses = served_site
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for name, (path, title) in PAGES.items():
        url = base + path
        png = tmp_path / f"{name}.png"
        # one browser a page: the screenshot of the page it loaded, and that page's DOM
        shot = chromium(tmp_path / f"profile-{name}", f"--screenshot={png}", "--dump-dom", url)
        assert png.is_file(), f"no screenshot of {url}:\n{shot.stderr[-3000:]}"
        image = read_png(png)[..., :3]
        assert image.shape[:2] == (900, 1280)
        colours = len(np.unique(image.reshape(-1, 3), axis=0))
        inked = float((image < 240).any(axis=-1).mean())  # pixels that are not (near) white
        assert colours >= 50, f"{name}: {colours} colours, the page looks blank"
        assert inked >= 0.03, f"{name}: {inked:.1%} of the pixels are not white"
        shutil.copyfile(png, SCREENSHOTS / f"{name}.png")

        dom = shot.stdout
        assert f"<title>{html.escape(title, quote=False)}</title>" in dom, f"{name}: title is not {title!r}"
        assert re.search(r'<nav class="md-nav md-nav--primary"', dom), f"{name}: no navigation"
        for label in ("Getting started", "Checkpointing", "StatefulDataLoader"):
            assert label in dom, f"{name}: the nav lacks {label!r}"
    missing = sorted({p for code, p in statuses if code >= 400})
    assert not missing, f"requests the site could not answer: {missing}"
    assert any(code == 200 and p.endswith(".css") for code, p in statuses)  # styled, not bare HTML


def test_the_png_check_tells_a_blank_page(tmp_path: Path) -> None:
    import struct
    import zlib

    width, height = 4, 3
    rows = b"".join(b"\x00" + b"\xff" * (width * 3) for _ in range(height))  # white, filter 0
    body = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = tmp_path / "blank.png"
    png.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", body)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    image = read_png(png)
    assert image.shape == (3, 4, 3)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) == 1 and not (image < 240).any()


def test_the_cli_page_shows_every_command_and_option(built_site: Path) -> None:
    import argparse

    from guideloom._cli import build_parser

    text = html.unescape(re.sub(r"<[^>]+>", "", (built_site / "cli" / "index.html").read_text()))
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"prepare", "inspect", "verify", "bench"} <= set(commands)
    for name, sub in commands.items():
        assert f"usage: guideloom {name}" in text, f"the CLI page lacks guideloom {name}"
        for action in sub._actions:
            for option in action.option_strings:
                assert option in text, f"the CLI page lacks guideloom {name} {option}"


def test_code_blocks_wrap_their_long_lines(built_site: Path) -> None:
    # Many browsers show a code block's scrollbar only on hover: a long line would look cut off.
    css = (built_site / "assets" / "extra.css").read_text()
    rule = re.search(r"\.md-typeset pre > code\s*\{([^}]*)\}", css)
    assert rule and "white-space: pre-wrap" in rule.group(1), "code blocks do not wrap (extra.css)"
    for page in ("parquet/index.html", "provenance/index.html", "index.html"):
        html_text = (built_site / page).read_text()
        assert re.search(r'<link[^>]+href="[./]*assets/extra\.css"', html_text), f"{page}: no extra.css"
