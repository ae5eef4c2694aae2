"""One event loop on one background thread: what the synchronous facade runs its pipeline on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "new_event_loop"]

T = TypeVar("T")


_uvloop: Any
try:  # imported with guideloom, not on a loader's first batch
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
    _uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed (it is faster), else asyncio's default."""
    if _uvloop is None:  # pragma: no cover
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = _uvloop.new_event_loop()
    return loop


class LoopThread:
    """A daemon thread running an event loop until :meth:`stop`."""

    def __init__(self, name: str = "guideloom-loop") -> None:
        self.loop = new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            finally:
                self.loop.close()

    def is_current(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; a loop closed already refuses it, and ``coro`` is closed
        (never left to be collected unawaited)."""
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:
            coro.close()
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result here."""
        return self.submit(coro).result()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop (cancelling what still runs on it) and join the thread, for at most
        ``timeout`` seconds (a daemon thread stuck in a call is left to finish it). Idempotent."""
        if self._thread.is_alive():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # already closed
                pass
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
