"""The docs pages as the tests read them: their python code blocks, and a PNG reader for the
site's screenshots.

A page's blocks run top to bottom as one program (later blocks use what earlier ones defined). A
block that is not meant to run on its own (a fragment, an object-store URL, a multi-rank
program) is marked by the line ``<!-- fragment -->`` right before its opening fence.

The PNG reader takes 8-bit RGB/RGBA, non-interlaced images (what Chromium writes) into a numpy
array: Pillow is not a dependency of the project.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from pathlib import Path

import numpy as np

from . import ROOT

DOCS = ROOT / "docs"

#: What a zygote that runs pages' code may import first: the pages' common modules, which start no
#: thread (pyarrow, which ``datasets`` imports, starts its allocator's threads: a zygote forks on
#: its only thread). A run imports the page's other modules itself.
PRELOAD = ("asyncio", "numpy", "torch", "guideloom")


def run_env() -> dict[str, str]:
    """The environment a page's code runs in: the test's, this checkout first on the path, numpy's
    BLAS on one thread (a zygote forks on its only thread)."""
    return {"OPENBLAS_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(ROOT)}


FRAGMENT = "<!-- fragment -->"
_FENCE = re.compile(r"^(?P<marker>[^\n]*)\n```python\n(?P<code>.*?)^```$", re.M | re.S)


def python_blocks(page: Path) -> tuple[list[str], int]:
    """(the runnable blocks, how many fragments were skipped)."""
    text = "\n" + page.read_text()
    runnable, fragments = [], 0
    for m in _FENCE.finditer(text):
        if m.group("marker").strip() == FRAGMENT:
            fragments += 1
        else:
            runnable.append(m.group("code"))
    return runnable, fragments


SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _paeth_row(row: bytearray, prev: bytes, bpp: int) -> None:
    for i in range(len(row)):
        a = row[i - bpp] if i >= bpp else 0
        b = prev[i]
        c = prev[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        row[i] = (row[i] + pred) & 0xFF


def _average_row(row: bytearray, prev: bytes, bpp: int) -> None:
    for i in range(len(row)):
        a = row[i - bpp] if i >= bpp else 0
        row[i] = (row[i] + ((a + prev[i]) >> 1)) & 0xFF


def read_png(path: Path) -> np.ndarray:
    """The image as a (height, width, channels) uint8 array."""
    data = path.read_bytes()
    if not data.startswith(SIGNATURE):
        raise ValueError(f"{path} is not a PNG")
    pos, idat, header = len(SIGNATURE), bytearray(), None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError(f"{path} has no IHDR chunk")
    width, height, depth, colour, _, _, interlace = header
    channels = {2: 3, 6: 4}.get(colour)
    if depth != 8 or channels is None or interlace != 0:
        raise ValueError(
            f"{path}: unsupported PNG (depth {depth}, colour type {colour}, interlace {interlace})"
        )
    raw = zlib.decompress(bytes(idat))
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind = raw[start]
        line = raw[start + 1 : start + 1 + stride]
        if kind == 0:
            row = np.frombuffer(line, dtype=np.uint8)
        elif kind == 1:  # Sub: a running sum per channel, modulo 256
            row = np.cumsum(
                np.frombuffer(line, dtype=np.uint8).reshape(width, channels), axis=0, dtype=np.uint8
            )
            row = row.reshape(-1)
        elif kind == 2:  # Up
            row = np.frombuffer(line, dtype=np.uint8) + np.frombuffer(prev, dtype=np.uint8)
        elif kind in (3, 4):
            buf = bytearray(line)
            (_average_row if kind == 3 else _paeth_row)(buf, prev, channels)
            row = np.frombuffer(bytes(buf), dtype=np.uint8)
        else:
            raise ValueError(f"{path}: unknown PNG filter {kind} in row {y}")
        out[y] = row
        prev = row.tobytes()
    return out.reshape(height, width, channels)
