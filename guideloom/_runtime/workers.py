"""The workers an epoch on the loop runs with, made in one place from its configuration."""

from __future__ import annotations

from guideloom._runtime.config import PipelineConfig
from guideloom._runtime.pipeline import StageWorkers, Workers
from guideloom._runtime.processes import ProcessWorkers, WorkerPool
from guideloom._runtime.threadpool import CollateThreads

__all__ = ["make_workers", "process_workers"]


def make_workers(cfg: PipelineConfig, *, off_loop: bool = False) -> Workers:
    """The workers for ``cfg``: the stages with the collate on the loop at ``num_workers=0``
    (unless ``off_loop``: a caller's event loop must never run ``collate_fn``, so one thread
    collates), on ``num_workers`` threads, or process workers (the loader's persistent pool where
    it keeps one)."""
    if cfg.num_workers == 0:
        if off_loop:
            return StageWorkers(CollateThreads(1))
        return StageWorkers(None)
    if cfg.parallel_method == "thread":
        return StageWorkers(CollateThreads(cfg.num_workers))
    return process_workers(cfg)


def process_workers(cfg: PipelineConfig) -> ProcessWorkers:
    """Process workers for ``cfg``: the loader's persistent pool where it keeps one, else a pool
    of the iterator's own, closed with it."""
    if cfg.worker_pool is not None:
        return ProcessWorkers(cfg.worker_pool(), owned=False)
    return ProcessWorkers(WorkerPool(cfg.dataset, cfg.collate_fn, cfg.num_workers), owned=True)
