"""The ``guideloom`` command line: ``prepare``, ``inspect``, ``verify``, ``explain`` and ``bench``.

:func:`main` is the console script's entry point; it returns the exit status: 0 on success, 1 for
a data error (unreadable input, a damaged dataset, an existing destination), 2 for a usage error,
130 when interrupted. Expected errors print ``guideloom: error: <message>``, never a traceback.

Output piped into a reader that stops early (``guideloom inspect ds | head``) ends the command
quietly with 141, what a shell reports for ``cat`` or ``yes`` ended by ``SIGPIPE`` (128 + 13),
so ``set -o pipefail`` sees it as it sees theirs: no traceback, no ``Exception ignored`` line.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Sequence

from guideloom._cli._common import CLIError
from guideloom._errors import GuideloomError

__all__ = ["main"]

#: The exit status when stdout's reader went away: 128 + SIGPIPE, as a shell reports for a
#: command that the signal ended.
EXIT_CLOSED_PIPE = 141

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


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (``poll`` reports an error on it);
    ``False`` where that cannot be told, so that a broken pipe elsewhere is still reported."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), stdout not a file
        return False


def _silence_stdout() -> None:
    """/dev/null over stdout's file descriptor: what is still buffered, flushed at exit, goes
    there instead of raising again in the interpreter's shutdown."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        status = _run(argv)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
    except BrokenPipeError as exc:
        if not _stdout_gone():  # a pipe of the command's own (a worker's, a socket) broke
            _error(str(exc))
            return 1
        _silence_stdout()
        return EXIT_CLOSED_PIPE
    return status


def _run(argv: Sequence[str] | None) -> int:
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
    except BrokenPipeError:
        raise  # main() tells a closed stdout from a failure
    except (GuideloomError, OSError, ValueError, TypeError, NotImplementedError) as exc:
        # Storage errors (missing or damaged dataset, a value the dtype cannot hold, an object
        # store that is not available) are expected outcomes of a command, not crashes.
        _error(str(exc) or type(exc).__name__)
        return 1
    return status
