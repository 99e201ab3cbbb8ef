"""Transient-error classification (pure) and the retrying storage wrapper."""

from __future__ import annotations

import errno

import pytest

from snapshots import RetryPolicy, StorageError
from snapshots.storage import Entry, RetryingStorage
from snapshots.storage.retry import is_transient, s3_options


class _ClientError(Exception):
    """Shaped like botocore.exceptions.ClientError (code + HTTP status in .response)."""

    def __init__(self, code: str, status: int) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


class EndpointConnectionError(Exception):
    """Named like botocore's; matched by class name."""


def _chained(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as exc:
            raise outer from exc
    except Exception as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError(),
        TimeoutError(),
        OSError(errno.ETIMEDOUT, "timed out"),
        OSError(errno.EBUSY, "SlowDown"),  # what s3fs makes of a 503
        OSError(121, "InternalError"),  # s3fs: 500 -> EREMOTEIO
        _ClientError("SlowDown", 503),
        _ClientError("ThrottlingException", 400),
        _ClientError("Whatever", 500),
        _ClientError("TooMany", 429),
        EndpointConnectionError(),
        _chained(RuntimeError("wrapped"), ConnectionRefusedError()),
    ],
)
def test_transient(exc: Exception) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(),
        FileExistsError(),
        PermissionError(),
        OSError(errno.ENOSPC, "disk full"),
        _ClientError("AccessDenied", 403),
        _ClientError("NoSuchBucket", 404),
        ValueError("bad"),
        _chained(PermissionError(), ConnectionResetError()),  # the outer verdict wins
    ],
)
def test_permanent(exc: Exception) -> None:
    assert not is_transient(exc)


class _Flaky:
    url = "fake://flaky"

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls = 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)

    def check(self, *, create: bool = True) -> None:
        self._maybe_fail()

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self._maybe_fail()

    def read(self, path: str) -> bytes:
        self._maybe_fail()
        return b"ok"

    def list(self, path: str = "") -> list[Entry]:
        self._maybe_fail()
        return []

    def delete(self, path: str) -> None:
        self._maybe_fail()


FAST = RetryPolicy(attempts=4, initial_s=0.001, max_s=0.002)


def test_transient_errors_are_retried_until_success() -> None:
    inner = _Flaky([ConnectionResetError(), TimeoutError()])
    assert RetryingStorage(inner, FAST).read("x") == b"ok"
    assert inner.calls == 3


def test_permanent_errors_fail_at_once_as_storage_error() -> None:
    inner = _Flaky([PermissionError("denied")])
    with pytest.raises(StorageError, match="denied"):
        RetryingStorage(inner, FAST).write("x", b"")
    assert inner.calls == 1


def test_answers_pass_through_unwrapped() -> None:
    with pytest.raises(FileNotFoundError):
        RetryingStorage(_Flaky([FileNotFoundError()]), FAST).read("x")
    with pytest.raises(FileExistsError):
        RetryingStorage(_Flaky([FileExistsError()]), FAST).write("x", b"", exclusive=True)


def test_retries_give_up_after_the_policy_with_credentials_redacted() -> None:
    inner = _Flaky([ConnectionError("s3://key:secret@host/x down")] * 10)
    store = RetryingStorage(inner, FAST)
    with pytest.raises(StorageError) as info:
        store.list("")
    assert inner.calls == 4
    assert "secret" not in str(info.value)


def test_policy_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


def test_no_retry_starts_that_could_end_past_the_deadline() -> None:
    policy = RetryPolicy(attempts=10, deadline_s=30.0)  # attempts of up to 10 s
    assert policy.attempt_timeout_s == 10.0
    assert not policy.gives_up(attempt=1, elapsed_s=0.0, next_wait_s=0.2)
    assert not policy.gives_up(attempt=2, elapsed_s=10.0, next_wait_s=0.4)
    assert policy.gives_up(attempt=3, elapsed_s=20.0, next_wait_s=0.4)  # would end at 30.4
    assert policy.gives_up(attempt=10, elapsed_s=0.0, next_wait_s=0.0)  # attempts bound too


def test_storage_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"deadline_s.*storage_timeout"):
        RetryPolicy(deadline_s=0)


def test_s3_options_bound_each_attempt_and_leave_retries_to_us() -> None:
    options = s3_options({"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}, RetryPolicy())
    config = options["config_kwargs"]
    assert config["connect_timeout"] <= 5 and config["read_timeout"] == 10.0
    assert config["retries"]["total_max_attempts"] == 1  # botocore: one attempt, ours retry
    assert options["client_kwargs"] == {"endpoint_url": "http://127.0.0.1:9"}
    mine = s3_options({"config_kwargs": {"read_timeout": 99}}, RetryPolicy())
    assert mine["config_kwargs"]["read_timeout"] == 99  # the caller's choice wins


def test_transient_failures_mark_storage_down_until_it_answers() -> None:
    inner = _Flaky([ConnectionResetError()] * 4)
    store = RetryingStorage(inner, FAST)
    with pytest.raises(StorageError):
        store.read("x")
    assert store.health.down and "ConnectionResetError" in (store.health.error or "")
    assert store.list("") == []  # storage answered again
    assert not store.health.down


def test_single_attempt_view_never_retries_and_shares_health() -> None:
    inner = _Flaky([ConnectionResetError()] * 4)
    store = RetryingStorage(inner, FAST)
    with pytest.raises(StorageError):
        store.single_attempt().delete("x")
    assert inner.calls == 1 and store.health.down
