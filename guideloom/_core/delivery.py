"""The delivery step: a batch on its way to the consumer, and the one place where a step of its
making (the collate, the copy to a device) runs and its failure takes the batch's place.

Every way of running an epoch (inline, thread workers, process workers, the event-loop stages)
makes batches through :func:`apply` or :func:`apply_group`, so a failure is caught, and reaches
the consumer at its batch, the same way in each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from guideloom._core.plan import BatchSpec

__all__ = ["DELIVERED_ERRORS", "Delivery", "Results", "apply", "apply_group", "for_the_consumer", "through"]

#: What a read or a step raises that reaches the consumer in place of its batch, with its own
#: type: ``SystemExit`` and ``KeyboardInterrupt`` too, so that a collate that calls ``sys.exit()``
#: (or is interrupted) ends the consumer's loop with that same exception rather than killing an
#: event loop or a worker. Never ``CancelledError``: that one is guideloom's own signal.
DELIVERED_ERRORS: tuple[type[BaseException], ...] = (Exception, SystemExit, KeyboardInterrupt)

#: A group of batches made in one worker call: each batch's value and error, in order, ending at
#: the first failure.
Results = list[tuple[Any, BaseException | None]]


@dataclass(slots=True)
class Delivery:
    """One batch on its way to the consumer, or the error that replaced it."""

    spec: BatchSpec
    value: Any = None
    error: BaseException | None = None


def apply(d: Delivery, *steps: Callable[[Any], Any]) -> bool:
    """Run ``steps`` in turn on ``d``'s value in place; a failure replaces the value and ends
    them. Whether ``d`` now carries an error (a batch that already failed is left as it is)."""
    if d.error is None:
        try:
            d.value = through(steps, d.value)
        except DELIVERED_ERRORS as exc:
            d.value, d.error = None, exc
    return d.error is not None


def through(steps: Sequence[Callable[[Any], Any]], value: Any) -> Any:
    """``value`` through each of ``steps`` in turn (one batch made at once)."""
    for step in steps:
        value = step(value)
    return value


def apply_group(steps: Sequence[Callable[[Any], Any]], batches: list[Any]) -> Results:
    """A worker's call: each of ``steps`` in turn over each of ``batches``, stopping at the first
    failure, which is returned in place of its batch."""
    out: Results = []
    for value in batches:
        try:
            value = through(steps, value)
        except DELIVERED_ERRORS as exc:
            out.append((None, exc))
            break
        out.append((value, None))
    return out


def for_the_consumer(error: BaseException) -> BaseException:
    """The exception a consumer is given for a failed batch: ``error`` itself, except that a
    ``StopIteration`` or ``StopAsyncIteration`` (from a ``collate_fn`` or a read) becomes a
    ``RuntimeError`` caused by it, as PEP 479 does for generators: raised from ``next()`` as it is,
    it would end the consumer's loop as if the epoch were complete."""
    if isinstance(error, StopIteration | StopAsyncIteration):
        wrapped = RuntimeError(
            f"a batch's collate_fn or read raised {type(error).__name__}; it is raised as this "
            "RuntimeError so that the loop does not end as if the epoch were complete"
        )
        wrapped.__cause__ = error
        return wrapped
    return error
