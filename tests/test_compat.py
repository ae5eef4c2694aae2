"""The private CPython APIs guideloom relies on (``guideloom._compat``) are still there, with the
shape it uses: a Python release that changes one fails here, by name."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from guideloom import _compat

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dotted", sorted(_compat.PRIVATE_APIS))
def test_each_private_api_used_still_exists(dotted: str) -> None:
    module, _, name = dotted.partition(".")
    assert callable(getattr(sys.modules[module], name, None)), (
        f"{dotted} is gone in Python {sys.version.split()[0]}: guideloom uses it to "
        f"{_compat.PRIVATE_APIS[dotted]}; see guideloom/_compat.py"
    )


def test_at_threads_exit_runs_before_the_interpreter_joins_threads() -> None:
    """A non-daemon thread that waits for a stop signal: without the hook the process would never
    exit."""
    code = (
        "import threading\n"
        "from guideloom._compat import at_threads_exit\n"
        "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait).start()\n"
        "at_threads_exit(stop.set)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30)


def test_current_frames_names_every_live_thread() -> None:
    started, stop = threading.Event(), threading.Event()

    def wait() -> None:
        started.set()
        stop.wait()

    t = threading.Thread(target=wait)
    t.start()
    started.wait()
    try:
        assert {threading.get_ident(), t.ident} <= set(_compat.current_frames())
    finally:
        stop.set()
        t.join()
