"""Shared pieces of the command line: its errors, optional imports, progress bars, formatting."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from types import ModuleType
from typing import Any

from guideloom._core.text import plural

__all__ = [
    "counted",
    "CLIError",
    "InputError",
    "Progress",
    "UsageError",
    "format_bytes",
    "format_count",
    "require",
]

_CLI_EXTRA = 'pip install "guideloom[cli]"'
_INSTALL_HINT = {
    "tqdm": _CLI_EXTRA,
    "zstandard": _CLI_EXTRA,
    "pyarrow": _CLI_EXTRA,
    "tokenizers": 'pip install "guideloom[tokenizers]"',
    "ray": 'pip install "guideloom[ray]"',
    "torch": 'pip install "guideloom[torch]" (install the CPU or CUDA build of PyTorch you want first)',
}


class CLIError(Exception):
    """An expected failure: printed as ``guideloom: error: <message>`` with exit code 1."""

    exit_code = 1


class UsageError(CLIError):
    """A bad command line (exit code 2)."""

    exit_code = 2


class InputError(CLIError):
    """Input data that cannot be read (a malformed line, a missing field, bad UTF-8)."""


def int_at_least(minimum: int) -> Any:
    """An argparse ``type`` for integers ``>= minimum``, with a readable error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def add_count(
    parser: argparse.ArgumentParser, flag: str, minimum: int, default: int, metavar: str, what: str
) -> None:
    """An integer option of at least ``minimum``, its default said in its help."""
    help_text = f"{what} (default {default})"
    parser.add_argument(flag, type=int_at_least(minimum), default=default, metavar=metavar, help=help_text)


def require(module: str, purpose: str) -> Any:
    """Import an optional dependency, or fail with the ``pip install`` line that provides it."""
    try:
        mod: ModuleType = importlib.import_module(module)
    except ImportError:
        top = module.split(".", maxsplit=1)[0]
        hint = _INSTALL_HINT.get(top, f"pip install {top}")
        raise CLIError(f"{purpose} needs the {top!r} package: install it with {hint}") from None
    return mod


def counted(n: int, noun: str, *, short: bool = False) -> str:
    """``n`` (with thousands separators, or as :func:`format_count` writes it where ``short``)
    and ``noun`` in the right number: ``counted(1, "token")`` is ``"1 token"``."""
    return plural(n, noun, shown=format_count(n) if short else f"{n:,}")


def format_count(n: float) -> str:
    """``1234567`` -> ``'1.23M'``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


def format_bytes(n: float) -> str:
    """``3_000_000`` -> ``'2.86 MiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


class Progress:
    """A tqdm bar counting bytes, with documents/s and tokens/s beside it; a no-op when disabled.

    Shown on stderr when it is a terminal, or when forced with ``--progress``; ``--quiet`` wins.
    """

    def __init__(
        self, *, enabled: bool, total: int | None, desc: str, counters: tuple[str, ...] = ()
    ) -> None:
        self._bar: Any = None
        self._counters = dict.fromkeys(counters, 0)
        self._start = time.perf_counter()
        self._last_postfix = 0.0
        if enabled:
            tqdm = require("tqdm", "the progress bar").tqdm
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.25,
            )

    @staticmethod
    def wanted(*, progress: bool, quiet: bool) -> bool:
        if quiet:
            return False
        return progress or sys.stderr.isatty()

    def update(self, nbytes: int, **counts: int) -> None:
        for name, n in counts.items():
            self._counters[name] = self._counters.get(name, 0) + n
        if self._bar is None:
            return
        self._bar.update(nbytes)
        now = time.perf_counter()
        if self._counters and now - self._last_postfix >= 0.5:
            self._last_postfix = now
            self._bar.set_postfix_str(self._postfix(now), refresh=False)

    def _postfix(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        return ", ".join(
            f"{format_count(n)} {name} ({format_count(n / elapsed)}/s)" for name, n in self._counters.items()
        )

    def close(self) -> None:
        if self._bar is not None:
            if self._counters:
                self._bar.set_postfix_str(self._postfix(time.perf_counter()), refresh=False)
            self._bar.close()
            self._bar = None
