"""torch's ``LocalElasticAgent`` with our loop: restart policy, watchdog, preemption, events.

torch's agent owns rendezvous, rank assignment, the worker environment and process start;
we keep all of that and replace ``_invoke_run`` (its template loop). Every decision is a pure
function in ``core/decisions.py`` (on ``core/policy.py``'s restart budget) fed with what this
class observes; this class carries the answers out. Beside it in this package: the hand-over
of a joining round (``handover.py``), the store's move when its host goes
(``store_failover.py``), what failures are reported as (``failure_reports.py``) and the
control folder shared with the workers (``control_files.py``), a straggling node's leave and
return (``straggler_exit.py``). Worker trees are killed
through ``processes/procs.py`` (torch only signals each worker's own process group, then
waits 30 s); progress, hangs and resources are read by ``processes/observer.py``; what
workers get besides torchrun's environment is ``processes/workerenv.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.api import RendezvousError

from elastic_trainer.contract import protocol
from elastic_trainer.contract.config import DEFAULT_SHUTDOWN_TIMEOUT_S, RunConfig
from elastic_trainer.contract.events import FailureCause, MembershipReason, emit
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.agent import exit_barrier
from elastic_trainer.supervisor.agent.control_files import await_copies, mark_restarting
from elastic_trainer.supervisor.agent.failure_reports import FailureReports, PeerLeaving
from elastic_trainer.supervisor.agent.handover import HandOver
from elastic_trainer.supervisor.agent.store_failover import StoreFailover
from elastic_trainer.supervisor.agent.straggler_exit import StragglerExit
from elastic_trainer.supervisor.core import decisions
from elastic_trainer.supervisor.core.decisions import PeerStop, SupervisorState, Verdict
from elastic_trainer.supervisor.core.outcome import (
    STATUS_CONFIG_ERROR,
    STATUS_FAILED,
    STATUS_PREEMPTED,
    STATUS_SUCCEEDED,
    AgentOutcome,
)
from elastic_trainer.supervisor.core.policy import RestartPolicy, WorkerExit
from elastic_trainer.supervisor.core.watchdog import HangVerdict
from elastic_trainer.supervisor.processes import fd_limit
from elastic_trainer.supervisor.processes.observer import GroupObserver, read_progress
from elastic_trainer.supervisor.processes.procs import ProcessTracker, oom_kill_count
from elastic_trainer.supervisor.processes.signals import StopRequest, StopRequested
from elastic_trainer.supervisor.processes.workerenv import new_control_dir, set_worker_env
from elastic_trainer.supervisor.rendezvous import presence
from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch, member_name
from elastic_trainer.supervisor.warm import client as warm_workers
from elastic_trainer.supervisor.warm.launcher import READY_TIMEOUT_S, WarmPool

# How long a preempted node gives the others' agents to read its goodbye before it stops a
# plain script's workers (whose peers then fail in a collective): their loops wake on the
# goodbye itself, so this is an upper bound, well inside any grace period.
GOODBYE_HEARD_S = 0.2

# What a store that died under a rendezvous raises (torch's rendezvous errors wrap c10d's).
STORE_ERRORS = (RendezvousError, DistNetworkError, DistStoreError)


class ElasticTrainAgent(HandOver, StragglerExit, LocalElasticAgent):
    """Executes ``decisions``: observes, asks, acts, emits. Decides nothing itself."""

    def __init__(
        self,
        *,
        spec: Any,
        logs_specs: Any,
        cfg: RunConfig,
        stop: StopRequest,
        control_root: str,
        metrics: Any = None,  # metrics_server.SupervisorMetrics with --metrics-port
        procs: ProcessTracker | None = None,
        membership: MembershipWatch | None = None,
        pool: WarmPool | None = None,
    ) -> None:
        """``procs`` and ``membership``: the worker processes and the peers are watched
        through these instead of ones built here (tests script what the agent observes).
        ``pool``: the warm pool the supervisor started (``launcher.start_pool``), which the
        agent closes when it ends; None: workers start as fresh processes."""
        super().__init__(
            spec,
            logs_specs,
            start_method="spawn",
            exit_barrier_timeout=cfg.exit_barrier_timeout,
            **torch_compat.agent_shutdown_timeout(5),
            log_line_prefix_template=cfg.torchrun.log_line_prefix_template,
        )
        self._cfg = cfg
        self._stop = stop
        self._control_root = control_root
        self._policy = RestartPolicy(max_restarts=cfg.max_restarts, tuning=cfg.restart)
        self._state = SupervisorState()
        self._procs = ProcessTracker() if procs is None else procs
        self._observer = GroupObserver(
            procs=self._procs,
            hang_timeout=cfg.hang_timeout,
            resources_interval=cfg.resources_interval,
            metrics=metrics,
            follow_stragglers=cfg.evict_stragglers is not None,
        )
        self.ledger = self._observer.ledger
        self._attempt = 0
        self._started_at = time.monotonic()
        self._attempt_started = self._started_at
        if membership is None:
            membership = MembershipWatch(
                spec.rdzv_handler,
                endpoint=cfg.rdzv_endpoint,
                check_every_s=cfg.rdzv.keep_alive_interval,
                dead_after_s=cfg.rdzv.dead_after_s,
                leaving_grace_s=cfg.worker.grace_period_s,
            )
        self._membership = membership
        self._peer_stop_seen: float | None = None
        self._oom_kills_at_start: int | None = None
        self._error: str | None = None
        # SIGTERM -> SIGKILL when we stop workers to restart them (torchrun's
        # --shutdown-timeout); short by default: every second here is downtime
        timeout = cfg.torchrun.shutdown_timeout
        self._kill_grace_s = DEFAULT_SHUTDOWN_TIMEOUT_S if timeout is None else timeout
        self._pool = pool
        if pool is not None:
            self._procs.spare(pool.pid)  # not a stray to reap between attempts
        self._joined_once = False  # a first join into a running job waits for the pool
        # the job's secret: signs the store's values and the presence handshakes
        self._job_key = spec.rdzv_handler.job_key
        self._reports = FailureReports(
            stderr_tail=self._stderr_tail, observer=self._observer, membership=membership
        )
        self._store_failover = StoreFailover(cfg=cfg, membership=membership, job_key=self._job_key)
        self._peer_leaving = PeerLeaving()
        logging.getLogger(torch_compat.WORKER_FAILURE_LOGGER).addFilter(self._peer_leaving)
        self._files_exhausted = fd_limit.ExhaustionStreak(
            "supervisor", "its checks skip a beat until files are free again; the job goes on"
        )

    # ---- the loop ------------------------------------------------------------------------
    def supervise(self) -> AgentOutcome:
        try:
            status, code = self._loop()
        except StopRequested:
            status, code = self._preempt()
        finally:
            self._report_handover(ended=True)
            logging.getLogger(torch_compat.WORKER_FAILURE_LOGGER).removeFilter(self._peer_leaving)
            self._procs.kill(grace_s=1.0)
            self._membership.close()
            torch_compat.shut_down(self, timeout_s=2)
            if self._pool is not None:
                self._pool.close()
        return AgentOutcome(
            status=status,
            exit_code=code,
            restarts=self._state.restarts,
            goodput=self.ledger.goodput(time.monotonic() - self._started_at),
            error=self._error,
        )

    def _loop(self) -> tuple[str, int]:
        wg = self._worker_group
        cfg = self._cfg
        with contextlib.suppress(Exception):  # unnamed: events say its address and pid
            wg.spec.rdzv_handler.publish_node_label(cfg.node)
        self._membership.open_presence(
            presence.bind_host(cfg.local_addr, cfg.rdzv_host),
            self._job_key,
            max_nodes=cfg.max_nodes,
        )
        wg.spec.rdzv_handler.dead_now = self._membership.lost_peers
        wg.spec.rdzv_handler.connected_now = self._membership.connected_peers
        self._time_node_probe()
        self._initialize_workers(wg)
        while True:
            try:
                ended = self._tick(wg)
            except OSError as exc:  # out of files (a flood of connections): skip this check
                if not fd_limit.is_exhausted(exc):
                    raise
                self._files_exhausted.failed()
                self._stop.wait(self._cfg.monitor_interval)
                continue
            if ended is not None:
                return ended

    def _tick(self, wg: WorkerGroup) -> tuple[str, int] | None:
        """One pass of the loop: wait for a change, look, act. The job's end, or None."""
        changes = [*self._procs.exit_fds(), *self._membership.watched_fds()]
        if self._stop.wait_for_change(self._cfg.monitor_interval, changes):
            return self._preempt()
        if self._membership.left_peers():  # a peer is leaving: our workers' end is its
            self._mute_workers()
        result = self._monitor_workers(wg)
        wg.state = result.state
        verdict = self._observe()
        self._report_handover()
        if result.state == WorkerState.SUCCEEDED:
            self._exit_barrier()
            return STATUS_SUCCEEDED, protocol.SUPERVISOR_EXIT_OK
        if peers := self._membership.lost_peers():  # explains a failure of ours too
            outcome = self._on_peers_gone(peers, silent=False)
        elif result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            outcome = self._on_failure(result)
        elif verdict is not None:
            outcome = self._on_hang(verdict)
        elif self._membership.nodes_waiting() > 0:
            outcome = decisions.on_nodes_waiting(self._policy, self._state)
        elif peers := self._membership.silent_peers():
            outcome = self._on_peers_gone(peers, silent=True)
        elif host := self._membership.store_host_unreachable():
            self._store_failover.host_silent(host)
            return None
        elif slow := self._slow_node_leaves():
            return None if self._leave_as_straggler(wg, slow) else self._preempt()
        else:
            return None
        if outcome.verdict == Verdict.CONFIG_ERROR:
            self._stop_workers(wg)
            wg.state = WorkerState.FAILED
            return STATUS_CONFIG_ERROR, protocol.SUPERVISOR_EXIT_CONFIG
        if outcome.verdict == Verdict.GIVE_UP:
            self._stop_workers(wg)
            wg.state = WorkerState.FAILED
            return STATUS_FAILED, protocol.SUPERVISOR_EXIT_FAILED
        if not self._restart(outcome):
            return self._preempt()
        return None

    def _restart(self, outcome: decisions.Outcome) -> bool:
        """Stop, back off, re-rendezvous, start. False if a stop was requested meanwhile."""
        decision = outcome.restart_decision
        self._state = outcome.state
        emit(
            "group.restarting",
            reason=decision.reason,
            restart_count=self._state.restarts,
            restarts_left=decision.restarts_left,
            backoff_s=decision.backoff_s,
        )
        if decisions.round_before_stop(outcome) and self._may_start_alongside():
            self._admit(self._worker_group)
            return True
        self._await_copies()
        self._stop_workers(self._worker_group)
        if decision.backoff_s > 0 and self._stop.wait(decision.backoff_s):
            return False
        self._worker_group.state = WorkerState.STOPPED
        self._initialize_workers(self._worker_group)
        return True

    def _started(self, wg: WorkerGroup, pids: dict[int, Any]) -> None:
        """What torch's ``_initialize_workers`` does after its start."""
        for local_rank, pid in pids.items():
            wg.workers[local_rank].id = pid
        wg.state = WorkerState.HEALTHY

    def _accelerator(self) -> bool:
        import torch

        return torch.cuda.is_available()

    # ---- outcomes ------------------------------------------------------------------------
    def _mute_workers(self) -> None:
        """Their stderr off the console from now on (``RelayedLogsSpecs.mute``), and torch's
        error line for their exit a debug one (``PeerLeaving``), until the next start."""
        if self._peer_leaving.active:
            return
        mute = getattr(self._logs_specs, "mute", None)  # torch's own specs have none
        if mute is not None:
            mute()
        self._peer_leaving.active = True

    def _on_peer_left(self, result: RunResult, left: set[Any]) -> decisions.Outcome:
        """Our workers ended after members said they leave on purpose (preempted): a
        membership change, not a failure. Each exit is said at debug level, with its error
        line (gloo's "Connection reset by peer"), for whoever looks."""
        self._reports.peer_exits(result, left)
        reason = decisions.leaving_reason(left, self._membership.stragglers_left())
        outcome = decisions.on_peers_left(self._policy, self._state, {}, reason)
        self.ledger.failed(
            cause=outcome.recovery_cause or FailureCause.PREEMPTED.value,
            now=time.time(),
            world_size=self._state.world_size or 0,
        )
        return outcome

    def _on_failure(self, result: RunResult) -> decisions.Outcome:
        codes = {f.exitcode for f in result.failures.values()}
        # a TrainingSession's workers say it themselves (exit 75: worker.failed, preempted)
        said = codes <= {protocol.EXIT_PEER_PREEMPTED}
        if (
            not said
            and protocol.EXIT_CONFIG not in codes
            and (left := self._membership.left_peers())
        ):
            return self._on_peer_left(result, left)
        exits = {
            rank: WorkerExit(local_rank=f.local_rank, rank=rank, exit_code=f.exitcode)
            for rank, f in result.failures.items()
        }
        pids = {rank: f.pid for rank, f in result.failures.items()}
        roots = decisions.root_failures(exits, self._procs.killed_pids, pids)
        now_ooms, then_ooms = oom_kill_count(), self._oom_kills_at_start
        outcome = decisions.on_group_failure(
            self._policy,
            self._state,
            roots,
            oom_kills=now_ooms - then_ooms if now_ooms is not None and then_ooms is not None else 0,
            ran_for_s=self._ran_for(),
            multi_node=(self._worker_group.group_world_size or 1) > 1,
            peers_leaving=decisions.leaving_reason(
                self._membership.left_peers(), self._membership.stragglers_left()
            ),
        )
        for rank, cause in outcome.causes.items():
            self._reports.worker_failed(
                rank, result.failures[rank], cause, restart_count=self._state.restarts
            )
        if outcome.verdict == Verdict.CHECK_PEERS:  # a closed connection needs no wait
            lost = bool(self._membership.lost_peers())
            lost = lost or self._membership.wait_for_lost_peer(self._stop.wait)
            self._reports.lost_peers()  # our worker saw it die first
            outcome = decisions.after_peer_check(self._policy, outcome, peer_lost=lost)
        if outcome.verdict == Verdict.CONFIG_ERROR:
            self._error = self._reports.config_error_line(outcome, result)
        elif outcome.verdict == Verdict.GIVE_UP:
            self._error = self._reports.give_up_line(outcome, result)
        self.ledger.failed(
            cause=outcome.recovery_cause or "error",
            now=time.time(),
            world_size=self._state.world_size or 0,
        )
        return outcome

    def _on_peers_gone(self, peers: set[Any], *, silent: bool) -> decisions.Outcome:
        """Members are gone: lost (their agent's connection closed: the process died) or
        silent (no heartbeat and no reset: frozen, partitioned; our workers would block in a
        collective until its timeout). Re-form without them now."""
        if silent:
            self._reports.peers_silent(peers, silent_s=self._cfg.rdzv.dead_after_s)
        else:
            self._reports.lost_peers()
        self.ledger.failed(
            cause=MembershipReason.NODE_LOST.value,
            now=time.time(),
            world_size=self._state.world_size or 0,
        )
        return decisions.on_peers_gone(self._policy, self._state)

    def _on_hang(self, verdict: HangVerdict) -> decisions.Outcome:
        rank = self._global_rank(verdict.local_rank)
        emit(
            "worker.hung",
            level="error",
            rank=rank,
            last_step=verdict.last_step,
            stalled_s=round(verdict.stalled_s, 1),
            local_rank=verdict.local_rank,
        )
        # a rank hung in a collective (a peer's device gone silent) still has the end of its
        # last step: its watcher thread copies it (never a torn step), then the kill
        self._await_copies()
        self._procs.kill(grace_s=0)
        self._reports.worker_hung(
            rank,
            local_rank=verdict.local_rank,
            stalled_s=verdict.stalled_s,
            restart_count=self._state.restarts,
        )
        self.ledger.failed(cause="hang", now=time.time(), world_size=self._state.world_size or 0)
        return decisions.on_hang(self._policy, self._state, ran_for_s=self._ran_for())

    # ---- torch hooks (the template methods of SimpleElasticAgent; see torch_compat) -------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        began = time.monotonic()
        self._reports.lost_peers()
        self._membership.before_rejoin()
        if not self._joined_once:
            self._announce_first_round()
        self._warm_up_before_joining(handler)
        self._store_failover.move_if_host_gone(handler)
        try:
            self._join_round(worker_group)
        except STORE_ERRORS:  # the store died under the join: move it if we may, else end
            if not self._store_failover.move_if_host_gone(handler, store_failed=True):
                raise
            self._join_round(worker_group)
        self._reports.lost_peers()  # found while the round formed (the handler's dead_now)
        self._membership.round_formed()
        self._reports.round_formed()
        world_size = worker_group.workers[0].world_size
        emit(
            "rendezvous.completed",
            round=handler.round,
            world_size=world_size,
            num_nodes=worker_group.group_world_size,
            duration_ms=round((time.monotonic() - began) * 1000),
            group_rank=worker_group.group_rank,
            store_host=self._store_failover.store_host(handler),
        )
        new = decisions.on_new_world(self._state, world_size)
        self._state = new.state
        if new.relabel_node_lost:
            self.ledger.relabel(MembershipReason.NODE_LOST.value)
        if new.changed_reason is not None:
            emit(
                "membership.changed",
                old_world_size=new.old_world_size,
                new_world_size=world_size,
                reason=new.changed_reason,
            )

    def _start_workers(self, worker_group: WorkerGroup, *, handoff: bool = False) -> dict[int, Any]:
        """``handoff``: the previous attempt's workers still run (``_admit``)."""
        self._attempt += 1
        control_dir = new_control_dir(self._control_root, self._attempt, handoff=handoff)
        self._stop.control_dir = control_dir
        # torch derives TORCHELASTIC_RESTART_COUNT from its own counter: keep it equal to ours
        torch_compat.set_remaining_restarts(self, self._cfg.max_restarts - self._state.restarts)
        set_worker_env(
            self._cfg, control_dir, mtbf_s=self.ledger.mtbf_s(time.monotonic() - self._started_at)
        )
        pids, popens = self._spawn(worker_group)
        if self._stop.requested:  # a signal raced with the start: tell the new workers too
            self._stop.write_stop_file()
        self._procs.track(popens)
        if not handoff:  # alongside: once the old ones stopped (``_admit``), if ever
            self._attempt_began()
        emit(
            "workers.started",
            world_size=worker_group.workers[0].world_size,
            local_world_size=worker_group.spec.local_world_size,
            group_rank=worker_group.group_rank,
            restart_count=self._state.restarts,
            pids=sorted(pids.values()),
            warm=warm_workers.all_warm(popens),
            alongside=handoff,
        )
        return pids

    def _attempt_began(self) -> None:
        """The current workers are the ones the loop watches from now on."""
        self._report_handover(ended=True)  # the previous attempt's, if it made no step
        self._attempt_started = time.monotonic()
        self._observer.attempt_started(self._attempt_started)
        self._oom_kills_at_start = oom_kill_count()
        self._peer_stop_seen = None
        self._peer_leaving.active = False  # these workers' exits are theirs again

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if self._stop.control_dir is not None:
            mark_restarting(self._stop.control_dir)
        self._procs.kill(grace_s=self._kill_grace_s)
        super()._stop_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        action, self._peer_stop_seen = decisions.on_partial_exit(
            self._poll_codes(),
            peer_stop_seen=self._peer_stop_seen,
            now=time.monotonic(),
            grace_s=self._cfg.worker.grace_period_s,
        )
        if action == PeerStop.WAIT:
            return RunResult(state=WorkerState.HEALTHY)
        if action == PeerStop.KILL_REST:
            # the survivors' just-in-time copies first: a kill's grace (1 s) is shorter than
            # a large state's copy, which the next group would otherwise restore from storage
            self._await_copies()
            self._procs.kill(grace_s=1.0)  # torch would SIGTERM them and wait up to 30 s
        return self._collect(worker_group)

    def _exit_barrier(self) -> None:
        """torch's hook at the end of a job: ours waits for the round's members that are
        neither finished nor gone (``exit_barrier``); torch's waited its whole timeout for a
        member that had left or died, then logged its traceback at error level."""
        handler = self._worker_group.spec.rdzv_handler
        if getattr(handler, "store", None) is None:  # not our rendezvous: torch's barrier
            super()._exit_barrier()
            return
        watch = self._membership
        exit_barrier.wait_for_peers(
            store=handler.store,
            run_id=handler.get_run_id(),
            round_=handler.round,
            me=handler.member_name(),
            members={member_name(n): watch.label(n) for n in watch.members},
            gone=watch.gone,
            wait=lambda s: self._stop.wait_for_change(s, watch.watched_fds()),
            timeout_s=self._cfg.exit_barrier_timeout,
        )

    # ---- I/O seams (scripted in tests/process/supervisor/test_agent.py) ---------------------
    def _warm_up_before_joining(self, handler: Any) -> None:
        """A node joining a running job lets its warm pool finish first (see
        ``decisions.join_after_warm_pool``); a pool that fails or times out is the fresh path."""
        pool, first_join = self._pool, not self._joined_once
        self._joined_once = True
        if pool is None or not first_join:
            return
        try:
            state = torch_compat.rendezvous_state(handler, sync=True)
            running = bool(state.complete) and bool(state.participants)
        except Exception:  # the store not answering yet: the join retries it, as it always did
            running = False
        if decisions.join_after_warm_pool(
            first_join=first_join, round_running=running, pool_ready=pool.ready
        ):
            pool.wait_ready(READY_TIMEOUT_S, cancelled=lambda: self._stop.requested)

    def _announce_first_round(self) -> None:
        """Why a job that could start now waits: its first round stays open for the other
        nodes (``first_last_call_timeout``) so that nodes started seconds apart form one
        world instead of training alone and re-forming at once."""
        cfg = self._cfg
        if cfg.max_nodes <= cfg.min_nodes:
            return
        wait_s = cfg.rdzv.first_last_call_timeout
        emit(
            "rendezvous.waiting",
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.max_nodes,
            wait_s=wait_s,
            hint=f"once {cfg.min_nodes} node(s) joined, the first round waits up to {wait_s:g} s "
            f"for up to {cfg.max_nodes - cfg.min_nodes} more (--max-nodes {cfg.max_nodes}); "
            "--max-nodes equal to --min-nodes starts at once",
        )

    def _join_round(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous (blocks until the round closes), interruptible by a stop."""
        self._stop.interruptible = True
        try:
            if self._stop.requested:
                raise StopRequested(self._stop.signal_name or "stop")
            super()._rendezvous(worker_group)
        finally:
            self._stop.interruptible = False

    def _spawn(self, worker_group: WorkerGroup) -> tuple[dict[int, Any], dict[int, Any]]:
        """Start the worker processes: (local rank -> pid, local rank -> Popen-like), forked
        from the warm pool where it can serve (``warm_workers``), else as torch does."""
        pool = self._pool
        if pool is None or not pool.wait_ready(
            READY_TIMEOUT_S, cancelled=lambda: self._stop.requested
        ):
            pids = super()._start_workers(worker_group)
        else:
            factory = functools.partial(warm_workers.start_processes, pool=pool)
            with torch_compat.processes_started_by(factory):
                pids = super()._start_workers(worker_group)
        return pids, torch_compat.worker_popens(self)

    def _poll_codes(self) -> dict[int, int | None]:
        return {lr: p.poll() for lr, p in torch_compat.worker_popens(self).items()}

    def _collect(self, worker_group: WorkerGroup) -> RunResult:
        return super()._monitor_workers(worker_group)

    # ---- observation ---------------------------------------------------------------------
    def _observe(self) -> HangVerdict | None:
        control_dir = self._stop.control_dir
        if control_dir is None:
            return None
        return self._observer.observe(
            control_dir,
            local_world_size=self._worker_group.spec.local_world_size,
            world_size=self._state.world_size or 0,
            global_rank=self._global_rank,
        )

    # ---- preemption ----------------------------------------------------------------------
    def _preempt(self) -> tuple[str, int]:
        stop = self._stop
        grace = self._cfg.worker.grace_period_s
        local_ranks = range(self._worker_group.spec.local_world_size)
        in_session = read_progress(stop.control_dir, local_ranks) if stop.control_dir else {}
        plain = decisions.signal_at_once(local_ranks, in_session)
        emit(
            "preemption.received",
            level="warning",
            signal=stop.signal_name,
            grace_s=grace,
            signalled_ranks=[self._global_rank(r) for r in plain],
        )
        handler = self._worker_group.spec.rdzv_handler
        if self._membership.store_host == handler.member_name():
            handler.say_leaving()  # the others move the store
        # before our workers stop: the others hear that we leave on purpose (their workers'
        # failure that follows is our leaving, not a crash) and re-form without waiting for us
        self._membership.say_goodbye()
        handler.leave()
        if plain and self._membership.members - {handler.this_node}:
            time.sleep(GOODBYE_HEARD_S)  # their agents read it before their workers fail
        self._procs.terminate(plain)
        received = stop.received_at or time.monotonic()
        kill_at = decisions.preemption_kill_at(received, grace)
        while self._procs.alive() and time.monotonic() < kill_at and stop.count < 2:
            time.sleep(0.05)
        remaining = max(0.0, received + grace - time.monotonic())
        self._procs.kill(grace_s=0.0 if stop.count >= 2 else min(remaining, 2.0))
        return STATUS_PREEMPTED, protocol.SUPERVISOR_EXIT_PREEMPTED

    # ---- helpers -------------------------------------------------------------------------
    def _ran_for(self) -> float:
        return time.monotonic() - self._attempt_started

    def _global_rank(self, local_rank: int) -> int:
        workers = self._worker_group.workers
        return workers[local_rank].global_rank if local_rank < len(workers) else local_rank

    def _await_copies(self) -> None:
        """The current attempt's workers' just-in-time copies (``control_files.await_copies``)."""
        if self._stop.control_dir is not None:
            await_copies(self._stop.control_dir, self._poll_codes)

    def _stderr_tail(self, local_rank: int) -> list[str]:
        tail = getattr(self._logs_specs, "stderr_tail", None)  # torch's own specs keep none
        return tail(local_rank) if tail is not None else []
