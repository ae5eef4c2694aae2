"""``python -m guideloom``: the same command line as the ``guideloom`` console script."""

from __future__ import annotations

from guideloom._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
