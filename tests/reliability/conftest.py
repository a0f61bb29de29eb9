"""Fixtures of the reliability suite: one backend per parameter, a form, a watchdog.

The moto server (``s3_server``) comes from ``tests/conftest.py``.
"""

from __future__ import annotations

import faulthandler
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import BACKENDS, FORMS, SOAK, Backend

#: A reliability test that runs longer than this is dumped and killed (a hang is a failure).
WATCHDOG_S = 3600 if SOAK else 300


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    name = request.param
    if name == "file":
        return Backend("file", str(tmp_path / "ck"))
    if name == "memory":
        return Backend("memory", f"memory://reliability-{uuid.uuid4().hex}/ck", shared=False)
    server = request.getfixturevalue("s3_server")
    return Backend("s3", f"s3://{server.make_bucket()}/ck", server.storage_options())


@pytest.fixture(params=sorted(FORMS))
def form(request: pytest.FixtureRequest) -> str:
    return str(request.param)
