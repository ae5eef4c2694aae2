"""Parsing and tokenizing one task, in the main process or in a worker process.

Workers are started with ``spawn``/``forkserver``; each builds its tokenizer once (in
:func:`init_worker`) and then runs :func:`run_task` on the tasks it is sent. Results come back in
submission order (see :func:`ordered_results`), so the written dataset does not depend on the
number of workers.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process  # BrokenProcessPool: the submodule loads only with a process pool
import functools
import json
import multiprocessing
import signal
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom._cli._common import CLIError, InputError
from guideloom._cli._inputs import Task, read_range, read_text_file
from guideloom._cli._tokenizers import Tokenizer, TokenizerSpec, build_tokenizer

__all__ = ["Options", "Result", "init_worker", "ordered_results", "process", "run_task"]


@dataclass(frozen=True, slots=True)
class Options:
    tokenizer: TokenizerSpec
    field: str
    skip_invalid: bool


@dataclass(frozen=True, slots=True)
class Result:
    tokens: npt.NDArray[Any]
    """All the task's documents, concatenated, each followed by the end-of-document token."""
    lengths: npt.NDArray[np.int64]
    """Tokens of each document (its end-of-document token included)."""
    invalid: int
    disk_bytes: int
    lines: int = 0
    """jsonl: the lines the task held."""


_SKIP_HINT = "; pass --skip-invalid to skip such input"


class LineError(InputError):
    """A bad JSON line, numbered within its task until :meth:`located` knows the task's first line."""

    def __init__(self, source: str, line: int, detail: str) -> None:
        super().__init__(source, line, detail)
        self.source, self.line, self.detail = source, line, detail

    def __str__(self) -> str:
        return f"{self.source}: line {self.line} of a block: {self.detail}{_SKIP_HINT}"

    def located(self, first_line: int) -> InputError:
        return InputError(f"{self.source}:{first_line + self.line}: {self.detail}{_SKIP_HINT}")


def _reject(task: Task, index: int, detail: str, options: Options) -> None:
    """Raise for item ``index`` of ``task`` unless invalid input is skipped."""
    if options.skip_invalid:
        return
    if task.kind == "jsonl":
        raise LineError(task.source, index, detail)
    where = task.names[index] if task.kind == "text" else f"{task.source}: row {task.first + index}"
    raise InputError(f"{where}: {detail}{_SKIP_HINT}")


_DECODER = json.JSONDecoder()


def _jsonl_texts(task: Task, options: Options) -> tuple[list[str], list[int], int, int]:
    texts: list[str] = []
    where: list[int] = []
    invalid = 0
    name = options.field
    data: bytes = task.payload if isinstance(task.payload, bytes) else read_range(*task.payload)
    pieces: list[Any]
    loads: Callable[[Any], Any]
    try:
        # One decode for the block, then str lines: faster than json.loads on each bytes line.
        block = data.decode("utf-8")
        if task.first == 0 and block.startswith("\ufeff"):
            block = block[1:]  # a byte-order mark at the start of the file
        pieces = block.split("\n")
        loads = _DECODER.decode
    except UnicodeDecodeError:  # some line is not UTF-8: json.loads on bytes finds which
        pieces = data.split(b"\n")
        loads = json.loads
    for i, item in enumerate(pieces):
        line: Any = item
        if not line or line.isspace():
            continue
        try:
            obj = loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            _reject(task, i, f"invalid JSON ({exc})", options)
            invalid += 1
            continue
        value = obj.get(name) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            if not isinstance(obj, dict):
                what = "not a JSON object"
            elif name not in obj:
                what = f"no {name!r} field (use --field to name the text field)"
            else:
                what = f"field {name!r} is not a string"
            _reject(task, i, what, options)
            invalid += 1
            continue
        texts.append(value)
        where.append(i)
    return texts, where, invalid, len(pieces) - 1


def _texts(task: Task, options: Options) -> tuple[list[str], list[int], int, int]:
    """The task's texts, the index of each in the task, how many were invalid, and lines held."""
    if task.kind == "jsonl":
        return _jsonl_texts(task, options)
    texts: list[str] = []
    where: list[int] = []
    invalid = 0
    if task.kind == "text":
        for i, f in enumerate(task.payload):
            try:
                texts.append(read_text_file(f).decode("utf-8"))
                where.append(i)
            except UnicodeDecodeError as exc:
                detail = (
                    f"not valid UTF-8 text (byte {exc.start}: {exc.reason}; a binary file?): leave "
                    "it out of the inputs, or select a folder's text files with --include PATTERN"
                )
                _reject(task, i, detail, options)
                invalid += 1
        return texts, where, invalid, 0
    for i, value in enumerate(task.payload):
        if isinstance(value, str):
            texts.append(value)
            where.append(i)
        else:
            kind = "null" if value is None else f"a {type(value).__name__}, not a string"
            _reject(task, i, f"column {options.field!r} is {kind}", options)
            invalid += 1
    return texts, where, invalid, 0


def process(task: Task, tokenizer: Tokenizer, options: Options) -> Result:
    texts, where, invalid, lines = _texts(task, options)
    try:
        tokens, lengths = tokenizer.encode_many(texts)
    except UnicodeEncodeError:
        # A lone surrogate (JSON allows "\ud800"): not text that UTF-8 can hold. Find it.
        kept = []
        for text, loc in zip(texts, where, strict=True):
            try:
                text.encode("utf-8")
                kept.append(text)
            except UnicodeEncodeError as exc:
                _reject(task, loc, f"text that UTF-8 cannot encode ({exc.reason})", options)
                invalid += 1
        tokens, lengths = tokenizer.encode_many(kept)
    return Result(tokens, lengths, invalid, task.disk_bytes, lines)


_worker_state: dict[str, tuple[Tokenizer, Options]] = {}


def init_worker(options: Options) -> None:
    """Worker process initializer: ignore Ctrl-C (the main process handles it), build the tokenizer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_state["current"] = (build_tokenizer(options.tokenizer), options)


def run_task(task: Task) -> Result:
    return process(task, *_worker_state["current"])


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def ordered_results(tasks: Iterable[Task], options: Options, workers: int) -> Generator[Result, None, None]:
    """Results of ``tasks`` in their order.

    One worker is a thread of this process (tokenizing overlaps with checksumming and writing,
    which release the GIL); more are processes. At most ``2 * workers`` tasks are in flight, so
    memory stays bounded whatever the input size.
    """
    pool: concurrent.futures.Executor
    if workers <= 1:
        tokenizer = build_tokenizer(options.tokenizer)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="guideloom-prepare")
        run: Any = functools.partial(process, tokenizer=tokenizer, options=options)
    else:
        pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=_context(), initializer=init_worker, initargs=(options,)
        )
        run = run_task
    pending: deque[tuple[Task, concurrent.futures.Future[Result]]] = deque()
    line = 1  # the first line of the next jsonl task, within its file (or from ``after``)
    source = ""
    after: int | None = None  # a task's share starting inside a file: lines count from this byte

    def take() -> Result:
        nonlocal line, source, after
        task, future = pending.popleft()
        if task.kind == "jsonl" and (task.first == 0 or task.source != source):
            line, source = 1, task.source
            inside = task.first != 0 and isinstance(task.payload, tuple)
            after = task.payload[1] if inside else None
        try:
            result = future.result()
        except LineError as exc:
            if after is None:
                raise exc.located(line) from None
            raise InputError(
                f"{exc.source}: line {line + exc.line} of the lines starting after byte {after} "
                f"(where this task's share of the file begins): {exc.detail}{_SKIP_HINT}"
            ) from None
        except concurrent.futures.process.BrokenProcessPool:
            raise CLIError(
                "a worker process died (killed, or out of memory); try fewer --workers or a "
                "smaller --task-size"
            ) from None
        line += result.lines
        return result

    try:
        for task in tasks:
            pending.append((task, pool.submit(run, task)))
            if len(pending) >= 2 * max(1, workers):
                yield take()
        while pending:
            yield take()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
