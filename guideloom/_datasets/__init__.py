"""Datasets: observation ``i`` to sample, over a storage or any random-access source."""
