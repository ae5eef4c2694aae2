"""Every private CPython API guideloom relies on, in one place.

Each has no public equivalent for what it is used for here; ``tests/test_compat.py`` fails loudly
on a Python release that changes one of them, naming it, so that a new release means checking
this file and the callers it names, not the whole package.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["PRIVATE_APIS", "at_threads_exit", "current_frames"]

#: What is used, and why: checked by the compatibility test.
PRIVATE_APIS: dict[str, str] = {
    "threading._register_atexit": (
        "stop guideloom's background work before the interpreter joins its threads, as "
        "concurrent.futures does (atexit handlers run after that join: too late)"
    ),
    "sys._current_frames": "the stacks of threads, to tell whether a fork would copy a thread's lock",
}


def at_threads_exit(fn: Callable[[], Any]) -> None:
    """Run ``fn`` at interpreter exit before non-daemon threads are joined (``atexit`` runs
    after that join, too late to tell a thread to stop)."""
    register: Callable[[Callable[[], Any]], None] = threading._register_atexit  # type: ignore[attr-defined]
    register(fn)


def current_frames() -> dict[int, types.FrameType]:
    """Each live thread's current frame, by thread id."""
    return sys._current_frames()
