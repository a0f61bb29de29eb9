"""S3 writes in one round trip each: reshard's S3 client sends no ``Expect: 100-continue``.

botocore (1.43, through aiobotocore 3.10 and s3fs) sends ``Expect: 100-continue`` with every
``PutObject`` and ``UploadPart``, even a 300-byte one: the client sends the headers, waits for the
server's ``100 Continue``, and only then sends the body. Each write thus costs two round trips.
Over a link of 50 ms that put about 0.35 s into every commit (metadata, refs, the root's copy, the
marker and the lock: 5 writes one after another) and one round trip into each multipart part.
The wait buys one thing: a refused request (a wrong signature, no such bucket) does not send its
body. reshard's writes are expected to succeed, and a refused one fails the save either way, so the
header is dropped from every request of the s3fs client a :class:`~reshard.store.io.storage.Storage`
uses (:func:`one_round_trip_writes`). The body of a refused write is then sent once, in vain.
"""

from __future__ import annotations

from typing import Any

from . import multipart

_HANDLER_ID = "reshard-no-expect-continue"


def _drop_expect(request: Any, **kwargs: Any) -> None:
    request.headers.pop("Expect", None)


def one_round_trip_writes(fs: Any) -> None:
    """Make ``fs`` (an s3fs filesystem; anything else is left alone) send its writes without waiting
    for ``100 Continue``.

    The handler goes on the client's events (made now if not yet: no request is sent) and on the
    session it came from, so a client s3fs makes again from that session has it too. Registering twice
    is a no-op.
    """
    if not multipart.supported(fs):
        return
    try:
        client = fs.s3  # s3fs makes its client now if not yet (no request is sent)
    except Exception:  # e.g. an asynchronous=True filesystem, or no region: the first request says what is wrong
        return
    client.meta.events.register("before-send.s3", _drop_expect, unique_id=_HANDLER_ID)
    session = getattr(fs, "session", None)
    if session is not None:
        session.register("before-send.s3", _drop_expect, unique_id=_HANDLER_ID)
