"""One exception root for elastic_trainer; a subclass per failure family.

Every message names the problem and the fix on one line: the CLI prints ``str(exc)``
as is and exits with ``exit_code``.
"""

from __future__ import annotations


def first_line(text: str | None, limit: int = 500) -> str | None:
    """The first non-blank line of a message (what an event or an operator gets)."""
    for line in str(text or "").splitlines():
        if line.strip():
            return line.strip()[:limit]
    return None


class ElasticTrainError(Exception):
    """Root of every error this package raises on purpose."""

    exit_code: int = 1


class ConfigError(ElasticTrainError):
    """Bad flags, environment or configuration, found before any worker starts."""

    exit_code = 2


class EnvironmentProblem(ElasticTrainError):
    """The worker environment set by the supervisor (or torchrun) is missing or inconsistent."""

    exit_code = 2


class DatasetError(ElasticTrainError):
    """A dataset is missing, malformed, or does not match the saved sampler state."""

    exit_code = 2


class SamplerStateError(ElasticTrainError):
    """A saved sampler state does not fit the current dataset, seed or shuffle settings."""

    exit_code = 2


class StorageUnavailable(ElasticTrainError):
    """Snapshot storage did not answer within its deadline: transient, so not exit 2 (a
    scheduler's restart policy may retry it), but this node cannot start now."""

    exit_code = 1
