"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from reshard.store.testing import LocalS3Server, S3Proxy


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3Server]:
    """An in-process moto S3 server on 127.0.0.1, shared by the session."""
    pytest.importorskip("moto.server")
    with LocalS3Server() as server:
        yield server


@pytest.fixture
def s3_proxy(s3_server: LocalS3Server) -> Iterator[S3Proxy]:
    """A counting, fault-injecting proxy in front of ``s3_server`` (counters 0, faults off)."""
    with S3Proxy(s3_server.endpoint_url) as proxy:
        yield proxy


@pytest.fixture
def s3_bucket(s3_server: LocalS3Server) -> str:
    """Name of a fresh, empty bucket on ``s3_server``."""
    return s3_server.make_bucket()


@pytest.fixture(autouse=True)
def _directory_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests marked ``directory_form`` save in the directory form unless they say otherwise (in this process)."""
    if request.node.get_closest_marker("directory_form") is not None:
        monkeypatch.setattr("reshard.store.write.writer.DEFAULT_FORM", "directory")


@pytest.fixture(params=["packed", "directory"])
def form(request: pytest.FixtureRequest) -> str:
    """Each storage form in turn (``create(..., form=form)``): suites run on both."""
    return str(request.param)
