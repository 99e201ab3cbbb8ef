"""How a supervisor's run ended: ``AgentOutcome`` and the status words of ``job.finished``."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_trainer.contract.events import JobStatus

STATUS_SUCCEEDED = JobStatus.SUCCEEDED.value
STATUS_FAILED = JobStatus.FAILED.value
STATUS_PREEMPTED = JobStatus.PREEMPTED.value
STATUS_CLOSED = JobStatus.CLOSED.value
STATUS_STORE_LOST = JobStatus.STORE_LOST.value
STATUS_CONFIG_ERROR = JobStatus.CONFIG_ERROR.value


@dataclass(frozen=True, kw_only=True)
class AgentOutcome:
    status: str
    exit_code: int
    restarts: int
    goodput: float | None
    error: str | None = None  # one line for the operator (a worker's configuration error)
