"""The benchmark suite: guideloom against the loaders people use today (``python -m benchmarks``)."""
