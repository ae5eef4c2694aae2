"""A data file truncated while a read copies from its map: refused with a clear error, never a
process killed by SIGBUS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import guideloom as gl

READER = r"""
import sys, numpy as np, guideloom as gl
storage = gl.open_stream(sys.argv[1])
storage.open_sync()
print("ready", flush=True)
starts = np.arange(0, 15 * 2**20, 2**20, dtype=np.int64)
try:
    while True:
        storage.read_many_sync(starts, 2**20)
except gl.DatasetIntegrityError as exc:
    print(str(exc).splitlines()[0], flush=True)
    sys.exit(3)
"""


def test_a_file_truncated_during_a_read_is_refused_not_a_bus_error(tmp_path: Path) -> None:
    """The reader copies 16 windows of 1 Mi tokens from the map over and over; the file is cut
    to half its size meanwhile (as a tool rewriting it in place would). The reader must stop
    with ``DatasetIntegrityError`` (exit 3), not die of SIGBUS reading past the new end."""
    data = (np.arange(16 * 2**20) % 50_000).astype(np.uint16)
    gl.write_stream(tmp_path / "ds", data)
    (path,) = [p for p in (tmp_path / "ds").iterdir() if p.suffix == ".bin"]
    size = path.stat().st_size
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _trial in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", READER, str(tmp_path / "ds")], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        os.truncate(path, size // 2)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode != -signal.SIGBUS, "the reader was killed by SIGBUS (a map read past the end)"
        assert proc.returncode == 3 and "truncated" in out, (proc.returncode, out)
        path.write_bytes(data.tobytes())  # restored for the next trial
        time.sleep(0.1)
