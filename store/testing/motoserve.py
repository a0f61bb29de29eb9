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
application. A GET with a ``Range`` reads only that range of the object (:func:`read_ranges_only`;
moto reads the whole object and slices it: an 8 MiB copy for each ranged GET of a packed load's data).
moto still spills each object or part over 5 MiB to a temporary file: kept in
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
import threading
from typing import Any

_local = threading.local()
_patched = False


class _Range:
    """An object's bytes, read from moto's buffer only where a slice asks (what ``len`` and a slice need)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return bytes(self.key._value_buffer.read(max(0, stop - start)))


def read_ranges_only() -> None:
    """Make moto's GET with a ``Range`` read that range of the object, not all of it and then a slice.

    moto's ``get_object`` takes the whole object (``FakeKey.value``: a read of its buffer, a spilled
    file past 5 MiB) and its ``_handle_range_header`` then slices what the range asks. Here
    ``get_object``, while a ``Range`` header is present, gets a :class:`_Range` instead, which reads
    only the bytes sliced; whatever moto then answers whole (a range it ignores, a part number) is read
    whole as before. Same answers, statuses and headers. Applied once a process.
    """
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    global _patched
    if _patched:
        return
    _patched = True
    whole: Any = FakeKey.__dict__["value"]  # the property
    get_object, key_response = S3Response.get_object, S3Response.key_response

    def value(self: Any) -> Any:
        return _Range(self) if getattr(_local, "ranged", False) else whole.fget(self)

    def ranged_get_object(self: Any) -> Any:
        _local.ranged = bool(self.headers.get("range"))
        try:
            return get_object(self)
        finally:
            _local.ranged = False

    def answer(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = key_response(self, *args, **kwargs)
        if isinstance(out, tuple) and isinstance(out[-1], _Range):  # answered whole after all
            return (*out[:-1], out[-1][:])
        return out

    FakeKey.value = property(value, whole.fset)  # type: ignore[assignment]
    S3Response.get_object = ranged_get_object  # type: ignore[method-assign]
    S3Response.key_response = answer  # type: ignore[method-assign]


class S3Only:
    """moto's S3 application for every request, its API application (``/moto-api/...``) for resets."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import create_backend_app

        read_ranges_only()
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
