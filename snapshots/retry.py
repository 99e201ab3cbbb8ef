"""Pure: which storage errors are worth retrying, and the retry policy's settings."""

from __future__ import annotations

import errno
from dataclasses import dataclass

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
    """Exponential backoff with jitter: ``initial_s``, doubling up to ``max_s`` per wait."""

    attempts: int = 6
    initial_s: float = 0.2
    max_s: float = 10.0
    deadline_s: float = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError(
                f"RetryPolicy needs 0 <= initial_s <= max_s, got {self.initial_s}, {self.max_s}"
            )


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
