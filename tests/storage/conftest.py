"""Backends for the storage contract: local disk, memory://, and s3:// on a moto server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class Backend:
    name: str
    url: str
    storage_options: dict[str, Any] | None = field(default=None)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """One moto S3 server on 127.0.0.1 (free port) for the session, the way s3fs tests itself."""
    server_mod = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    saved = {k: os.environ.get(k) for k in DUMMY_AWS}
    os.environ.update(DUMMY_AWS)  # never let a test reach real credentials
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_bucket(endpoint: str) -> str:
    import boto3

    bucket = f"snap-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    if request.param == "local":
        return Backend("local", str(tmp_path / "snaps"))
    if request.param == "memory":
        return Backend("memory", f"memory://contract-{uuid.uuid4().hex}/snaps")
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = make_bucket(endpoint)
    return Backend("s3", f"s3://{bucket}/run", {"client_kwargs": {"endpoint_url": endpoint}})
