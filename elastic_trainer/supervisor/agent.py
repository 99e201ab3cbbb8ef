"""torch's ``LocalElasticAgent`` with our loop: restart policy, watchdog, preemption, events.

torch's agent owns rendezvous, rank assignment, the worker environment and process start;
we keep all of that and replace ``_invoke_run`` (its template loop) so that each outcome
goes through ``policy.py`` and shows up as an event. Worker trees are killed through
``procs.py`` (torch only signals each worker's own process group, then waits 30 s); progress,
hangs and resources are read by ``observer.py``; what workers get besides torchrun's
environment (ours, the control directory, the bootstrap they run under) is ``workerenv.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import structlog
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import ProcessFailure

from elastic_trainer import protocol
from elastic_trainer.config import RunConfig
from elastic_trainer.events import emit
from elastic_trainer.supervisor.observer import GroupObserver
from elastic_trainer.supervisor.policy import (
    Action,
    Decision,
    PolicyState,
    RestartPolicy,
    classify_exit,
    signal_name,
)
from elastic_trainer.supervisor.procs import ProcessTracker, oom_kill_count
from elastic_trainer.supervisor.signals import StopRequest, StopRequested
from elastic_trainer.supervisor.watchdog import HangVerdict
from elastic_trainer.supervisor.workerenv import new_control_dir, worker_env

log = structlog.get_logger("elastic_trainer")

STATUS_SUCCEEDED = "succeeded"
STATUS_FAILED = "failed"
STATUS_PREEMPTED = "preempted"
STATUS_CLOSED = "closed"  # the job had already finished when this node arrived
STATUS_STORE_LOST = "store_lost"


@dataclass(frozen=True, kw_only=True)
class AgentOutcome:
    status: str
    exit_code: int
    restarts: int
    goodput: float | None


class ElasticTrainAgent(LocalElasticAgent):
    def __init__(
        self, *, spec: Any, logs_specs: Any, cfg: RunConfig, stop: StopRequest, control_root: str
    ) -> None:
        super().__init__(
            spec,
            logs_specs,
            start_method="spawn",
            exit_barrier_timeout=cfg.exit_barrier_timeout,
            shutdown_timeout=5,
        )
        self._cfg = cfg
        self._stop = stop
        self._control_root = control_root
        self._policy = RestartPolicy(max_restarts=cfg.max_restarts, tuning=cfg.restart)
        self._pstate = PolicyState()
        self._procs = ProcessTracker()
        self._observer = GroupObserver(
            procs=self._procs,
            hang_timeout=cfg.hang_timeout,
            resources_interval=cfg.resources_interval,
        )
        self.ledger = self._observer.ledger
        self._attempt = 0
        self._started_at = time.monotonic()
        self._world_size: int | None = None
        self._members: set[Any] = set()
        self._refund_if_shrunk = False
        self._membership_reason: str | None = None
        self._peer_stop_seen: float | None = None
        self._store_lost_reported = False
        self._oom_kills_at_start: int | None = None

    # ---- the loop ------------------------------------------------------------------------
    def supervise(self) -> AgentOutcome:
        try:
            status, code = self._loop()
        except StopRequested:
            status, code = self._preempt()
        finally:
            self._procs.kill(grace_s=1.0)
            self._shutdown(timeout=2)
        return AgentOutcome(
            status=status,
            exit_code=code,
            restarts=self._pstate.restarts,
            goodput=self.ledger.goodput(time.monotonic() - self._started_at),
        )

    def _loop(self) -> tuple[str, int]:
        wg = self._worker_group
        self._initialize_workers(wg)
        while True:
            if self._stop.wait(self._cfg.monitor_interval):
                return self._preempt()
            result = self._monitor_workers(wg)
            wg.state = result.state
            verdict = self._observe()
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
                return STATUS_SUCCEEDED, protocol.SUPERVISOR_EXIT_OK
            if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
                decision = self._on_failure(result)
            elif verdict is not None:
                decision = self._on_hang(verdict)
            elif self._nodes_waiting() > 0:
                self._membership_reason = "node_joined"
                decision = self._policy.on_membership(self._pstate)
            else:
                continue
            if decision.action == Action.GIVE_UP:
                self._stop_workers(wg)
                wg.state = WorkerState.FAILED
                return STATUS_FAILED, protocol.SUPERVISOR_EXIT_FAILED
            if not self._restart(decision):
                return self._preempt()

    def _restart(self, decision: Decision) -> bool:
        """Stop, back off, re-rendezvous, start. False if a stop was requested meanwhile."""
        self._pstate = decision.state
        emit(
            "group.restarting",
            reason=decision.reason,
            restart_count=self._pstate.restarts,
            restarts_left=decision.restarts_left,
            backoff_s=decision.backoff_s,
        )
        self._stop_workers(self._worker_group)
        if decision.backoff_s > 0 and self._stop.wait(decision.backoff_s):
            return False
        self._remaining_restarts = self._cfg.max_restarts - self._pstate.restarts
        self._worker_group.state = WorkerState.STOPPED
        self._initialize_workers(self._worker_group)
        return True

    # ---- outcomes ------------------------------------------------------------------------
    def _on_failure(self, result: RunResult) -> Decision:
        failures = self._root_failures(result)
        causes = set()
        now_ooms, then_ooms = oom_kill_count(), self._oom_kills_at_start
        oom_kills = now_ooms - then_ooms if now_ooms is not None and then_ooms is not None else 0
        for rank, failure in failures.items():
            cause = classify_exit(failure.exitcode, oom_kills=oom_kills).value
            causes.add(cause)
            self._emit_failed(rank, failure, cause)
        if causes == {"preempted"}:
            self._membership_reason = "peer_preempted"
            self.ledger.failed(cause="preempted", now=time.time(), world_size=self._world_size or 0)
            return self._policy.on_membership(self._pstate)
        self.ledger.failed(
            cause=sorted(causes)[0], now=time.time(), world_size=self._world_size or 0
        )
        decision = self._policy.on_failure(self._pstate, ran_for_s=self._ran_for())
        multi_node = self._worker_group.group_world_size and self._worker_group.group_world_size > 1
        if multi_node and decision.action == Action.GIVE_UP and self._peer_lost():
            self._membership_reason = "node_lost"
            return self._policy.on_membership(self._pstate)
        self._refund_if_shrunk = bool(multi_node)
        return decision

    def _on_hang(self, verdict: HangVerdict) -> Decision:
        rank = self._global_rank(verdict.local_rank)
        emit(
            "worker.hung",
            level="error",
            rank=rank,
            last_step=verdict.last_step,
            stalled_s=round(verdict.stalled_s, 1),
            local_rank=verdict.local_rank,
        )
        self._procs.kill(grace_s=0)
        emit(
            "worker.failed",
            level="error",
            rank=rank,
            exit_code=None,
            signal="SIGKILL",
            cause="hang",
            error_summary=f"no progress for {verdict.stalled_s:.1f}s",
            local_rank=verdict.local_rank,
            restart_count=self._pstate.restarts,
            **self._observer.resources_fields(verdict.local_rank),
        )
        self.ledger.failed(cause="hang", now=time.time(), world_size=self._world_size or 0)
        return self._policy.on_failure(self._pstate, ran_for_s=self._ran_for(), hang=True)

    def _root_failures(self, result: RunResult) -> dict[int, ProcessFailure]:
        """Failures not caused by our own kill of the rest of the group."""
        killed = self._procs.killed_pids
        own = {r: f for r, f in result.failures.items() if f.pid not in killed}
        return own or dict(result.failures)

    def _emit_failed(self, rank: int, failure: ProcessFailure, cause: str) -> None:
        # torch's message without an error file is boilerplate; only @record/session write one
        summary = _first_line(failure.message) if os.path.isfile(failure.error_file) else None
        emit(
            "worker.failed",
            level="warning" if cause == "preempted" else "error",
            rank=rank,
            exit_code=failure.exitcode,
            signal=signal_name(failure.exitcode),
            cause=cause,
            error_summary=summary,
            local_rank=failure.local_rank,
            restart_count=self._pstate.restarts,
            **self._observer.resources_fields(failure.local_rank),
        )

    def _peer_lost(self) -> bool:
        """Did a node of our round vanish? Waits until a dead node's heartbeat would expire."""
        handler = self._worker_group.spec.rdzv_handler
        deadline = time.monotonic() + self._cfg.rdzv.dead_after_s + 1.5
        while time.monotonic() < deadline:
            try:
                if handler.stale_peers(self._members):
                    return True
            except Exception:
                return False
            if self._stop.wait(0.5):
                return False
        return False

    def _nodes_waiting(self) -> int:
        try:
            return int(self._worker_group.spec.rdzv_handler.num_nodes_waiting())
        except Exception as exc:  # the store host is gone: keep training, no scale-up
            if not self._store_lost_reported:
                self._store_lost_reported = True
                emit(
                    "store.unreachable",
                    level="error",
                    endpoint=self._cfg.rdzv_endpoint,
                    error=_first_line(str(exc)),
                    consequence="running workers continue; no node can join or leave until restart",
                )
            return 0

    # ---- torch hooks ---------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        began = time.monotonic()
        self._stop.interruptible = True
        try:
            if self._stop.requested:
                raise StopRequested(self._stop.signal_name or "stop")
            super()._rendezvous(worker_group)
        finally:
            self._stop.interruptible = False
        self._members = handler.participants()
        world_size = worker_group.workers[0].world_size
        emit(
            "rendezvous.completed",
            round=handler.round,
            world_size=world_size,
            num_nodes=worker_group.group_world_size,
            duration_ms=round((time.monotonic() - began) * 1000),
            group_rank=worker_group.group_rank,
        )
        self._on_new_world(world_size)

    def _on_new_world(self, world_size: int) -> None:
        old = self._world_size
        self._world_size = world_size
        if old is not None and old != world_size:
            reason = self._membership_reason or ("node_lost" if world_size < old else "node_joined")
            if world_size < old and self._refund_if_shrunk and self._pstate.restarts > 0:
                # the failure was a node vanishing: a membership change, not charged
                self._pstate = dataclasses.replace(self._pstate, restarts=self._pstate.restarts - 1)
                reason = "node_lost"
                self.ledger.relabel("node_lost")
            emit("membership.changed", old_world_size=old, new_world_size=world_size, reason=reason)
        self._membership_reason = None
        self._refund_if_shrunk = False

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._attempt += 1
        control_dir = new_control_dir(self._control_root, self._attempt)
        self._stop.control_dir = control_dir
        self._remaining_restarts = self._cfg.max_restarts - self._pstate.restarts
        os.environ.update(worker_env(self._cfg, control_dir))
        pids = super()._start_workers(worker_group)
        if self._stop.requested:  # a signal raced with the start: tell the new workers too
            self._stop.write_stop_file()
        handlers = self._pcontext.subprocess_handlers  # type: ignore[union-attr]
        self._procs.track({lr: h.proc for lr, h in handlers.items()})
        self._attempt_started = time.monotonic()
        self._observer.attempt_started(self._attempt_started)
        self._oom_kills_at_start = oom_kill_count()
        self._peer_stop_seen = None
        emit(
            "workers.started",
            world_size=worker_group.workers[0].world_size,
            local_world_size=worker_group.spec.local_world_size,
            group_rank=worker_group.group_rank,
            restart_count=self._pstate.restarts,
            pids=sorted(pids.values()),
        )
        return pids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._mark_restarting()
        self._procs.kill(grace_s=2.0)
        super()._stop_workers(worker_group)

    def _mark_restarting(self) -> None:
        """Tell workers the SIGTERM they are about to get is ours (see protocol.RESTART_FILE);
        during a preemption the stop file already says what is happening."""
        control_dir = self._stop.control_dir
        if control_dir is None or os.path.exists(os.path.join(control_dir, protocol.STOP_FILE)):
            return
        with contextlib.suppress(OSError):
            open(os.path.join(control_dir, protocol.RESTART_FILE), "w").close()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        codes = {lr: h.proc.poll() for lr, h in self._pcontext.subprocess_handlers.items()}  # type: ignore[union-attr]
        failed = [c for c in codes.values() if c not in (None, 0)]
        running = any(c is None for c in codes.values())
        if failed and running:
            if all(c == protocol.EXIT_PEER_PREEMPTED for c in failed):
                # a peer node is stopping: the others finish their final step, then exit 75
                now = time.monotonic()
                self._peer_stop_seen = self._peer_stop_seen or now
                if now - self._peer_stop_seen < self._cfg.grace_period:
                    return RunResult(state=WorkerState.HEALTHY)
            # kill the rest ourselves: torch would SIGTERM them and wait up to 30 s
            self._procs.kill(grace_s=1.0)
        return super()._monitor_workers(worker_group)

    # ---- observation ---------------------------------------------------------------------
    def _observe(self) -> HangVerdict | None:
        control_dir = self._stop.control_dir
        if control_dir is None:
            return None
        return self._observer.observe(
            control_dir,
            local_world_size=self._worker_group.spec.local_world_size,
            world_size=self._world_size or 0,
            global_rank=self._global_rank,
        )

    # ---- preemption ----------------------------------------------------------------------
    def _preempt(self) -> tuple[str, int]:
        stop = self._stop
        grace = self._cfg.grace_period
        emit("preemption.received", level="warning", signal=stop.signal_name, grace_s=grace)
        self._worker_group.spec.rdzv_handler.leave()
        received = stop.received_at or time.monotonic()
        kill_at = received + max(0.0, grace - min(2.0, grace * 0.2))
        while self._procs.alive() and time.monotonic() < kill_at and stop.count < 2:
            time.sleep(0.05)
        remaining = max(0.0, received + grace - time.monotonic())
        self._procs.kill(grace_s=0.0 if stop.count >= 2 else min(remaining, 2.0))
        return STATUS_PREEMPTED, protocol.SUPERVISOR_EXIT_PREEMPTED

    # ---- helpers -------------------------------------------------------------------------
    def _ran_for(self) -> float:
        return time.monotonic() - getattr(self, "_attempt_started", self._started_at)

    def _global_rank(self, local_rank: int) -> int:
        workers = self._worker_group.workers
        return workers[local_rank].global_rank if local_rank < len(workers) else local_rank


def _first_line(text: str | None) -> str | None:
    if not text:
        return None
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:500]
    return None
