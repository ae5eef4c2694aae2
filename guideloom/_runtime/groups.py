"""Groups of consecutive batches handed to collate threads, in plan order: the bookkeeping the
sync thread workers (:mod:`.threads`) and the loop's collate stage (:mod:`.pipeline`) share.

A group's raw batches go to a worker in one call (:func:`~guideloom._core.delivery.apply_group`);
its results replace them when they come, in order. A group that stopped at a failure returns
that failure in place of its batch and nothing after it: those batches are dropped, and nothing
after a failure is delivered. The drivers differ only in how they wait for a group's future (a
blocking ``result()``, an ``await``) and in their credits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from guideloom._core.delivery import Delivery, Results
from guideloom._core.plan import BatchSpec

__all__ = ["CollateGroups"]

F = TypeVar("F")


class _Group(Generic[F]):
    __slots__ = ("deliveries", "future")

    def __init__(self, deliveries: list[Delivery], future: F | None) -> None:
        self.deliveries = deliveries  # first last: popped as handed out
        self.future = future  # None once its results are in the deliveries


class CollateGroups(Generic[F]):
    """Groups in flight, oldest first; ``ahead``: their batches not yet taken."""

    def __init__(self) -> None:
        self._queue: deque[_Group[F]] = deque()
        self.ahead = 0

    def __len__(self) -> int:
        return len(self._queue)

    def start(self, group: list[Delivery], submit: Callable[[list[BatchSpec], list[Any]], F]) -> None:
        """Hand ``group``'s raw batches to a worker (``submit`` makes the call with their specs
        and values, returns its future); the worker holds them from here, the deliveries get the
        results."""
        if not group:
            return
        values = [d.value for d in group]
        for d in group:
            d.value = None
        self._queue.append(_Group(group[::-1], submit([d.spec for d in group], values)))
        self.ahead += len(group)

    def add_ready(self, d: Delivery) -> None:
        """A batch that needs no worker (a read's failure), after the groups before it."""
        self._queue.append(_Group([d], None))
        self.ahead += 1

    def head_future(self) -> F | None:
        """What the oldest group waits for; None once its results are in (or none is queued)."""
        return self._queue[0].future if self._queue else None

    def resolve_head(self, results: Results) -> None:
        """The oldest group's results, in order; a group that stopped at a failure drops the
        batches after it."""
        head = self._queue[0]
        ds = head.deliveries
        dropped = len(ds) - len(results)
        if dropped > 0:
            del ds[:dropped]  # the last ones (first last)
            self.ahead -= dropped
        for d, (value, error) in zip(reversed(ds), results, strict=False):
            d.value, d.error = value, error
        head.future = None

    def head_size(self) -> int:
        """Batches of the oldest group still to take."""
        return len(self._queue[0].deliveries) if self._queue else 0

    def take(self) -> Delivery:
        """The next batch of the oldest group (its results are in)."""
        head = self._queue[0]
        assert head.future is None, "take() before the group's results"
        d = head.deliveries.pop()
        self.ahead -= 1
        if not head.deliveries:
            self._queue.popleft()
        return d

    def futures(self) -> Iterator[F]:
        """The futures of the groups still waited for (to cancel them)."""
        return (g.future for g in self._queue if g.future is not None)

    def clear(self) -> None:
        self._queue.clear()
        self.ahead = 0
