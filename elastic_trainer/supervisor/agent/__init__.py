"""The supervisor's agent: torch's ``LocalElasticAgent`` driven by our loop (``loop.py``),
with the hand-over, the store's failover and failure reporting beside it."""

from elastic_trainer.supervisor.agent.loop import GOODBYE_HEARD_S, STORE_ERRORS, ElasticTrainAgent
from elastic_trainer.supervisor.core.outcome import (
    STATUS_CLOSED,
    STATUS_CONFIG_ERROR,
    STATUS_FAILED,
    STATUS_PREEMPTED,
    STATUS_STORE_LOST,
    STATUS_SUCCEEDED,
    AgentOutcome,
)

__all__ = [
    "GOODBYE_HEARD_S",
    "STATUS_CLOSED",
    "STATUS_CONFIG_ERROR",
    "STATUS_FAILED",
    "STATUS_PREEMPTED",
    "STATUS_STORE_LOST",
    "STATUS_SUCCEEDED",
    "STORE_ERRORS",
    "AgentOutcome",
    "ElasticTrainAgent",
]
