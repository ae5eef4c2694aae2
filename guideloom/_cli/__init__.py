"""The ``guideloom`` command line: ``prepare``, ``inspect``, ``verify``, ``explain`` and ``bench``.

:func:`main` is the console script's entry point; it returns the exit status: 0 on success, 1 for
a data error (unreadable input, a damaged dataset, an existing destination), 2 for a usage error,
130 when interrupted. Expected errors print ``guideloom: error: <message>``, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from guideloom._cli._common import CLIError
from guideloom._errors import GuideloomError

__all__ = ["main"]

EXAMPLES = """\
examples:
  guideloom prepare corpus/ --output ds --workers 2
  guideloom inspect ds --tokenizer bytes
  guideloom verify ds
  guideloom explain ds --checkpoint ckpt.pt --step 1200 --sequence-length 2048
  guideloom bench ds --sequence-length 2048 --batch-size 16 --shuffle

Run `guideloom COMMAND --help` for each command's options and examples.
"""


def build_parser() -> argparse.ArgumentParser:
    from guideloom._cli import _bench, _explain, _inspect, _prepare

    common = argparse.ArgumentParser(add_help=False)
    out = common.add_argument_group("output")
    out.add_argument(
        "--progress", action="store_true", help="show a progress bar even when stderr is not a terminal"
    )
    out.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")

    parser = argparse.ArgumentParser(
        prog="guideloom",
        description="Prepare, inspect, verify, explain and benchmark guideloom datasets.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from guideloom import __version__

    parser.add_argument("--version", action="version", version=f"guideloom {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _prepare.add_parser(sub, common)
    _inspect.add_parsers(sub, common)
    _explain.add_parser(sub, common)
    _bench.add_parser(sub, common)
    return parser


def _error(message: str) -> None:
    print(f"guideloom: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors (argparse exits 2 itself)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        status: int = args.func(args)
    except CLIError as exc:
        _error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        _error("interrupted; no dataset was written (run the command again to start over)")
        return 130
    except FileExistsError as exc:
        _error(f"{exc} (use --overwrite)")
        return 1
    except (GuideloomError, OSError, ValueError, TypeError, NotImplementedError) as exc:
        # Storage errors (missing or damaged dataset, a value the dtype cannot hold, an object
        # store that is not available) are expected outcomes of a command, not crashes.
        _error(str(exc) or type(exc).__name__)
        return 1
    return status
