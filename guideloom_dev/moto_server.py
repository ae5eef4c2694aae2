"""moto's S3 server (``python -m moto.server`` with its arguments), minus a cost per request.

For each request moto asks whether the Host header names one of its services by listing its
package's folder again (``moto.backends.list_of_moto_modules``: a ``listdir`` and a ``stat`` of
some 180 entries), about a third of the CPU it spends on a small ranged GET. The listing is the
same for the server's life, so it is read once here; moto answers every request as before.
"""

from __future__ import annotations

import functools
import sys

import moto.backends
import moto.server

moto.backends.list_of_moto_modules = functools.cache(  # type: ignore[assignment]
    lambda listing=moto.backends.list_of_moto_modules: tuple(listing())
)

if __name__ == "__main__":
    moto.server.main(sys.argv[1:])
