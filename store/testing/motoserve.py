"""moto's S3, served with HTTP/1.1 keep-alive: the S3 server of the shaped test cloud.

Run as a script (``python motoserve.py --port 5000``), normally inside the network namespace of
:class:`reshard.store.testing.ShapedCloud`. ``python -m moto.server`` serves moto through
werkzeug's development server, which answers every request with ``Connection: close``
(werkzeug 3.1 ``serving.py``: "Always close the connection"). Over the shaped link every S3
request then paid a new connection's handshake, a round trip that S3 itself, which keeps
connections alive, does not charge: a commit of 7 dependent requests took 14 round trips.

Here moto's own S3 application (the Flask app ``create_backend_app("s3")`` makes, so the same
S3 semantics) runs in cheroot's threaded WSGI server, which keeps connections alive and answers
``Expect: 100-continue``. Requests go straight to it: moto's ``DomainDispatcherApplication``,
which picks one of moto's ~170 services per request, lists moto's package folder twice per
request (``backends.list_of_moto_modules``, ~350 ``isdir`` calls) under one lock for all threads:
a third of moto's CPU for a GET (yappi, moto 5.2.5), paid on the cores the client shares with
the server, which no object store charges its client. ``/moto-api`` (reset) goes to moto's API
application. moto still spills each object or part over 5 MiB to a temporary file: kept in
memory instead (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``), moto used a fifth less CPU for a save,
but then held every object saved in its memory (7 GB after 24 saves of 256 MiB) and the saves
timed over the shaped link were no faster, so moto keeps its default.

The script imports nothing from reshard, so it runs from its file path in any interpreter with
``moto[server]`` and ``cheroot``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any


class S3Only:
    """moto's S3 application for every request, its API application (``/moto-api/...``) for resets."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import create_backend_app

        self.s3 = create_backend_app("s3")
        self.api = create_backend_app("moto_api")

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        """Answer one WSGI request."""
        app = self.api if environ.get("PATH_INFO", "").startswith("/moto-api") else self.s3
        return app(environ, start_response)


def serve(host: str, port: int, threads: int = 64) -> Any:
    """A cheroot server of moto's application on ``host:port``, not yet started.

    Parameters
    ----------
    host, port : str, int
        Where to listen.
    threads : int
        Worker threads: one for each connection kept open, so at least as many as clients keep.
    """
    from cheroot import wsgi

    server = wsgi.Server((host, port), S3Only(), numthreads=threads, request_queue_size=256, timeout=60)
    server.keep_alive_conn_limit = 1024  # cheroot closes idle connections past 10 by default; S3 keeps them
    return server


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM or SIGINT."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("-H", "--host", default="127.0.0.1")
    p.add_argument("-p", "--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=64)
    args = p.parse_args(argv)
    server = serve(args.host, args.port, args.threads)

    def stop(signum: int, frame: Any) -> None:
        sys.exit(0)  # cheroot's safe_start stops the server on SystemExit

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.safe_start()


if __name__ == "__main__":
    main()
