"""The on-disk format: the manifest, block digests and the whole-dataset check."""
