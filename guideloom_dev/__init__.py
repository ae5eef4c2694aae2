"""Development tools that the tests and the benchmarks share; not part of the installed package.

- ``servers``: moto (S3), nginx (HTTP) and a fault proxy on 127.0.0.1, started and stopped by the
  object-store tests' fixtures and by the remote benchmarks

It is imported from the repository's root, as ``tests`` and ``benchmarks`` are: the wheel holds
``guideloom`` alone (``[tool.setuptools.packages.find]`` in ``pyproject.toml``).
"""
