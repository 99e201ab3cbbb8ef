"""Pure: which storage errors are worth retrying, and the retry policy's settings.

One storage deadline. Every storage operation (a write, a read, a listing...) either
succeeds or fails within ``RetryPolicy.deadline_s`` (``storage_timeout``, default
``DEFAULT_STORAGE_TIMEOUT_S`` = 30 s), counted from its first attempt:

- each attempt is bounded by ``attempt_timeout_s`` (a third of the deadline, 1 to 15 s): on
  S3 these are botocore's connect and read timeouts (``config_kwargs``), so a paused or
  black-holed endpoint fails the attempt instead of hanging;
- transient failures are retried with exponential backoff and jitter, by us only: s3fs's
  own retry loop and botocore's are set to a single attempt (``s3_options``), so the layers
  do not multiply (stacked, each layer would retry every attempt of the one above it, and a
  refused endpoint would take far longer to fail);
- no retry starts unless its wait plus one whole attempt still ends before the deadline,
  and at most ``attempts`` attempts are made.

A refused endpoint therefore fails in about 6 s (6 attempts, backoff 0.2 s doubling), a
paused one in about 2 attempt timeouts. Non-S3 backends get the same retry rules; their
per-attempt timeouts are their own (local disk has none).
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_STORAGE_TIMEOUT_S = 30.0

# Errors a retry can cure: a peer or network hiccup, a busy or throttling service.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EINTR,
        errno.EBUSY,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EPIPE,
        getattr(errno, "EREMOTEIO", 121),  # s3fs: HTTP 500
    }
)
# Never retried: the answer will not change by asking again.
PERMANENT_TYPES = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)
# botocore / aiohttp connection and timeout errors, matched by name so that this module
# needs neither package.
TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "IncompleteReadError",
        "IncompleteRead",
        "FSTimeoutError",
    }
)
TRANSIENT_AWS_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "BandwidthLimitExceeded",
    }
)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff with jitter: ``initial_s``, doubling up to ``max_s`` per wait, at
    most ``attempts`` attempts, all within ``deadline_s`` (see the module docstring)."""

    attempts: int = 6
    initial_s: float = 0.2
    max_s: float = 5.0
    deadline_s: float = DEFAULT_STORAGE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError(
                f"RetryPolicy needs 0 <= initial_s <= max_s, got {self.initial_s}, {self.max_s}"
            )
        if not self.deadline_s > 0:
            raise ValueError(
                f"RetryPolicy.deadline_s (storage_timeout) must be > 0 seconds, got "
                f"{self.deadline_s!r}; pass e.g. 30"
            )

    def with_timeout(self, storage_timeout: float | None) -> RetryPolicy:
        """This policy with ``deadline_s = storage_timeout`` (unchanged when None)."""
        if storage_timeout is None:
            return self
        if isinstance(storage_timeout, bool) or not isinstance(storage_timeout, (int, float)):
            raise ValueError(f"storage_timeout must be seconds (> 0), got {storage_timeout!r}")
        return replace(self, deadline_s=float(storage_timeout))

    @property
    def attempt_timeout_s(self) -> float:
        """Per-attempt connect/read timeout: room for about three attempts in the deadline."""
        return max(1.0, min(self.deadline_s / 3, 15.0))

    def gives_up(self, *, attempt: int, elapsed_s: float, next_wait_s: float) -> bool:
        """After a transient failure of attempt ``attempt``: stop rather than retry?"""
        if attempt >= self.attempts:
            return True
        return elapsed_s + next_wait_s + self.attempt_timeout_s > self.deadline_s


def s3_options(storage_options: Mapping[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """s3fs options with per-attempt timeouts and botocore's retries off (ours are the only
    layer). Values the caller set explicitly win."""
    options = dict(storage_options)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", min(policy.attempt_timeout_s, 5.0))
    config.setdefault("read_timeout", policy.attempt_timeout_s)
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = config
    return options


def is_transient(exc: BaseException) -> bool:
    """True when retrying the failed storage call may succeed; looks through the cause chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        verdict = _classify_one(current)
        if verdict is not None:
            return verdict
        current = current.__cause__ or current.__context__
    return False


def _classify_one(exc: BaseException) -> bool | None:
    if isinstance(exc, PERMANENT_TYPES):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if any(cls.__name__ in TRANSIENT_CLASS_NAMES for cls in type(exc).__mro__):
        return True
    aws = _aws_verdict(exc)
    if aws is not None:
        return aws
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in TRANSIENT_ERRNOS
    return None


def _aws_verdict(exc: BaseException) -> bool | None:
    """botocore ClientError: throttling codes, HTTP 429 and 5xx are transient."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in TRANSIENT_AWS_CODES:
        return True
    if isinstance(status, int):
        return status == 429 or status >= 500
    return None
