"""One bounded storage deadline: an unreachable or silent S3 endpoint fails in time.

Without one deadline a refused endpoint takes about a minute and five retries to fail (our
retries stacked on botocore's), a silent one several minutes (no per-attempt timeout below 15 s
read, 5 s connect, times s3fs's and botocore's retries). Bounds here are generous: a hang is
the bug.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import SnapshotSaveError, SnapshotStore, StorageError

from .conftest import make_bucket

pytestmark = pytest.mark.s3


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A loopback port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def _s3_store(endpoint: str, bucket: str = "bucket", **kwargs: object) -> SnapshotStore:
    return SnapshotStore(
        f"s3://{bucket}/run",
        storage_options={"client_kwargs": {"endpoint_url": endpoint}},
        **kwargs,  # type: ignore[arg-type]
    )


def _retries(logs: list[dict]) -> int:
    return sum(1 for e in logs if e["event"] == "snapshot.storage_retry")


def test_refused_endpoint_fails_within_the_default_deadline(moto_endpoint: str) -> None:
    began = time.monotonic()
    with capture_logs() as logs, pytest.raises(StorageError, match="cannot use snapshot storage"):
        _s3_store(f"http://127.0.0.1:{_closed_port()}")
    assert time.monotonic() - began < 30  # the default storage_timeout
    assert 1 <= _retries(logs) <= 5


def test_silent_endpoint_fails_within_the_deadline(
    moto_endpoint: str, silent_endpoint: str
) -> None:
    began = time.monotonic()
    with capture_logs() as logs, pytest.raises(StorageError):
        _s3_store(silent_endpoint, storage_timeout=3)
    assert time.monotonic() - began < 20  # 3 s deadline; was minutes
    assert _retries(logs) <= 2  # attempts of 1 s each fit the deadline once or twice


def test_saves_fail_within_the_deadline_once_the_endpoint_goes(moto_endpoint: str) -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    store = _s3_store(endpoint, make_bucket(endpoint), storage_timeout=3, async_save=False)
    store.save(1, {"w": torch.ones(4)})
    server.stop()
    began = time.monotonic()
    with capture_logs() as logs, pytest.raises(SnapshotSaveError, match="step 2"):
        store.save(2, {"w": torch.zeros(4)})
    assert time.monotonic() - began < 20
    assert _retries(logs) <= 5
    assert store.storage.health.down


def test_storage_timeout_reaches_s3fs_and_botocore(moto_endpoint: str) -> None:
    store = _s3_store(moto_endpoint, make_bucket(moto_endpoint), storage_timeout=6)
    fs = store.storage.inner.fs  # type: ignore[attr-defined]
    assert fs.retries == 1
    assert fs.config_kwargs["read_timeout"] == 2.0
    assert fs.config_kwargs["retries"]["total_max_attempts"] == 1
    assert store.storage.policy.deadline_s == 6.0
