"""moto's S3 server (``python -m moto.server`` with its arguments), minus a cost per request
and with a listen backlog of a production server's size.

For each request moto asks whether the Host header names one of its services by listing its
package's folder again (``moto.backends.list_of_moto_modules``: a ``listdir`` and a ``stat`` of
some 180 entries), about a third of the CPU it spends on a small ranged GET. The listing is the
same for the server's life, so it is read once here; moto answers every request as before.

werkzeug listens with a backlog of 128 connections. A loader opens its connections as its first
wide read's requests go out (some 175 in an epoch of 64 MiB of 1 KiB samples), and moto, busy
answering in Python, accepts them slowly: the kernel drops the connections past the backlog,
and each dropped one is tried again after TCP's 1 s retransmission timeout (measured: 46 drops
in 6 epochs, 5 of them 1.5 s instead of 0.4). nginx listens with 511, S3 with whatever it needs;
1024 here (the kernel caps it at ``net.core.somaxconn``).
"""

from __future__ import annotations

import functools
import sys

import moto.backends
import moto.server
import werkzeug.serving

moto.backends.list_of_moto_modules = functools.cache(  # type: ignore[assignment]
    lambda listing=moto.backends.list_of_moto_modules: tuple(listing())
)

werkzeug.serving.BaseWSGIServer.request_queue_size = 1024

if __name__ == "__main__":
    moto.server.main(sys.argv[1:])
