"""Helpers the tests share, by concern; no tests here.

- ``data``: identity datasets and storages, collate functions (module-level: process workers,
  started with ``spawn``, unpickle them by their module path)
- ``loader``: running a loader (``make``, ``take``, the resume check), threads, the event loop
- ``processes``: a local stream and collates for the process-worker tests
- ``chunks``: a local dataset served as an object store would, for the chunk cache
- ``ranks``: real ``torch.distributed`` ranks as processes; ``stream_rank`` and ``mixture_rank``
  are the programs those ranks run (``python -m tests.support.stream_rank``)
- ``zygote``: processes forked from a zygote that has imported a program's heavy modules once
  (the ranks, the torchft replicas)
- ``remote``: the datasets and loaders the object-store tests share (the servers they start,
  moto, nginx and a fault proxy on 127.0.0.1, are in ``guideloom_dev.servers``, which the
  benchmarks import too);
  ``exit_script``: a program run by file path to check that processes reading S3 exit cleanly
- ``recipes``: the training-framework recipes of ``examples/recipes/`` run as ranks, and what
  each rank trained on
- ``cli``: reading back what the command line wrote
- ``docs``: the docs pages' code blocks and a PNG reader for the screenshots
- ``schedule``: the order in which pytest-xdist's workers take the tests (long ones first)
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root: the folder holding ``guideloom/``, ``tests/``, ``docs/`` and ``examples/``."""
