"""What the operator is told when workers fail or peers go: ``worker.failed`` with its one
line, ``worker.exited`` for a peer's leaving, ``peer.lost`` once per lost member,
``peer.silent``, and torch's own error line demoted while a peer leaves on purpose."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult
from torch.distributed.elastic.multiprocessing import ProcessFailure

from elastic_trainer.contract.events import FailureCause, emit
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.core import decisions
from elastic_trainer.supervisor.core.policy import signal_name
from elastic_trainer.supervisor.processes.observer import GroupObserver
from elastic_trainer.supervisor.processes.tail import exception_line, message_line
from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch, node_name


class PeerLeaving(logging.Filter):
    """While ``active`` (a member said it leaves, so our workers' exit is its leaving),
    torch's error line for a worker's exit is a debug line: no error-level line for what is
    no failure (``FailureReports.peer_exits``)."""

    active = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.active and str(record.msg).startswith(torch_compat.WORKER_FAILURE_MESSAGE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


class FailureReports:
    """Says what failed and why; decides nothing (the agent asks ``decisions``)."""

    def __init__(
        self,
        *,
        stderr_tail: Callable[[int], list[str]],
        observer: GroupObserver,
        membership: MembershipWatch,
    ) -> None:
        """``stderr_tail``: a local rank's last lines of stderr (empty where none are kept)."""
        self._stderr_tail = stderr_tail
        self._observer = observer
        self._membership = membership
        self._reported_lost: set[Any] = set()  # lost members a peer.lost event has named

    def worker_failed(
        self, rank: int, failure: ProcessFailure, cause: FailureCause, *, restart_count: int
    ) -> None:
        emit(
            "worker.failed",
            level="warning" if cause == FailureCause.PREEMPTED else "error",
            rank=rank,
            exit_code=failure.exitcode,
            signal=signal_name(failure.exitcode),
            cause=cause,
            error_summary=self.error_summary(failure),
            local_rank=failure.local_rank,
            restart_count=restart_count,
            **self._observer.resources_fields(failure.local_rank),
        )

    def worker_hung(
        self, rank: int, *, local_rank: int, stalled_s: float, restart_count: int
    ) -> None:
        """The ``worker.failed`` of a rank the watchdog killed."""
        emit(
            "worker.failed",
            level="error",
            rank=rank,
            exit_code=None,
            signal="SIGKILL",
            cause=FailureCause.HANG,
            error_summary=f"no progress for {stalled_s:.1f}s",
            local_rank=local_rank,
            restart_count=restart_count,
            **self._observer.resources_fields(local_rank),
        )

    def peer_exits(self, result: RunResult, left: set[Any]) -> None:
        """Our workers ended after members said they leave on purpose (preempted): each exit
        at debug level, with its error line (gloo's "Connection reset by peer"), for whoever
        looks."""
        names = sorted(self._membership.label(p) for p in left)
        for rank, failure in result.failures.items():
            emit(
                "worker.exited",
                level="debug",
                rank=rank,
                local_rank=failure.local_rank,
                exit_code=failure.exitcode,
                signal=signal_name(failure.exitcode),
                why="peer_preempted",
                peers=names,
                error_summary=self.error_summary(failure),
            )

    def give_up_line(self, outcome: decisions.Outcome, result: RunResult) -> str | None:
        """``job.finished.error`` of a job that gives up: the first failed rank's one line."""
        for rank in sorted(outcome.causes):
            summary = self.error_summary(result.failures[rank])
            if summary:
                return f"worker rank {rank} failed: {summary}"
        return None

    def config_error_line(self, outcome: decisions.Outcome, result: RunResult) -> str:
        rank = min(r for r, c in outcome.causes.items() if c == FailureCause.CONFIG)
        summary = self.error_summary(result.failures[rank])
        why = summary or "see its output above"
        return f"worker rank {rank} refused its configuration (exit 2): {why}"

    def peers_silent(self, peers: set[Any], *, silent_s: float) -> None:
        emit(
            "peer.silent",
            level="warning",
            nodes=sorted(self._membership.label(p) for p in peers),
            addresses=sorted(node_name(p) for p in peers),
            silent_s=silent_s,
        )

    def lost_peers(self) -> None:
        """``peer.lost`` for members found gone that no event has named yet: once each,
        whenever we learn of it -- also after a restart that our worker's failure started
        before the peer's connection had closed (its workers died a moment before its
        agent), at the latest when we re-form."""
        peers = self._membership.lost_peers() - self._reported_lost
        if peers:
            self._reported_lost |= peers
            emit(
                "peer.lost",
                level="warning",
                nodes=sorted(self._membership.label(p) for p in peers),
                addresses=sorted(node_name(p) for p in peers),
                how="connection_closed",
            )

    def round_formed(self) -> None:
        """The lost are not members of the new round."""
        self._reported_lost.clear()

    def error_summary(self, failure: ProcessFailure) -> str | None:
        """The one line that says why: the error file's message (written by ``@record`` and
        our session), else the exception line of the traceback at the end of the worker's
        stderr (any Python script); None for a death without either (a signal)."""
        # torch's message without an error file is boilerplate ("To enable traceback see")
        if os.path.isfile(failure.error_file) and (line := message_line(failure.message)):
            return line
        return exception_line(self._stderr_tail(failure.local_rank))
