"""Process workers (``parallel_method="process"``): each worker collates groups of batches, read
by itself (local files, memory) or by the main process and sent through shared memory (object
stores), and returns them through shared memory.

- :mod:`.shm`: the segments, the workers' slots and the views rebuilt from them;
- :mod:`.pack`: arrays laid into a segment and the pickle that names them, both ways;
- :mod:`.wire`: the typed messages between the main process and a worker;
- :mod:`.worker`: what runs in a worker process;
- :mod:`.start`: how workers start (the start method, the zygote or fork server);
- :mod:`.proc`: each worker as the main process sees it, and a group of batches sent to one;
- :mod:`.pool`: the pool of processes and a session of it, the main process's side (what
  :class:`~guideloom._runtime.executors.Processes` drives for the epoch's flow).
"""

from __future__ import annotations

from guideloom._runtime.processes.pool import SHUTDOWN_GRACE_S, Session, WorkerPool
from guideloom._runtime.processes.shm import SHM_PREFIX, live_segments
from guideloom._runtime.processes.start import check_not_bootstrapping
from guideloom._runtime.processes.wire import RemoteTraceback

__all__ = [
    "SHM_PREFIX",
    "SHUTDOWN_GRACE_S",
    "RemoteTraceback",
    "Session",
    "WorkerPool",
    "check_not_bootstrapping",
    "live_segments",
]
