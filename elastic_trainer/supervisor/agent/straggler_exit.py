"""``--evict-stragglers``: this node leaves the group while its rank straggles, and comes back.

Every rank of a ``TrainingSession`` reaches the same straggler verdict; the slow rank's own
``straggler.detected`` lands in this node's control folder, where the observer picks it up.
``core/eviction.py`` decides from its figures and this job's measured re-form cost; here the
decision is carried out:

- leave as a preempted node does: the stop file makes every rank of the group stop together
  at the step's end and save (a preemption's stop: the others' state in memory is no help to
  a node that will not be in the next group), a goodbye (said first, as a straggler's) tells
  the other agents that the failure of their workers that follows is this node leaving and
  why (``membership.changed`` reason ``straggler_evicted``), and the rendezvous round is
  left, so the others re-form without waiting for this node. The store stays where it is
  (this process lives on and keeps serving it when it is the host);
- wait ``--evict-cooldown`` (a stop signal ends the wait, and the supervisor), then time the
  node's own probe (``processes/node_probe.py``) against the figure taken at the start: while
  the node is still as slow as it was evicted for, wait another cool-down
  (``straggler.still_slow``; at most ``eviction.MAX_COOLDOWNS`` in all);
- join again as a new node does: the running group admits it at its next step.

A mixin of ``ElasticTrainAgent``, like ``HandOver``: it drives the agent's own worker
stop, rendezvous and start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState

from elastic_trainer.contract.events import emit
from elastic_trainer.supervisor.core import decisions, eviction
from elastic_trainer.supervisor.core.eviction import EvictionDecision, EvictionHistory
from elastic_trainer.supervisor.core.ledger import Ledger
from elastic_trainer.supervisor.processes import node_probe
from elastic_trainer.supervisor.processes.signals import create_stop_file

if TYPE_CHECKING:
    from elastic_trainer.contract.config import RunConfig
    from elastic_trainer.supervisor.processes.observer import GroupObserver
    from elastic_trainer.supervisor.processes.procs import ProcessTracker
    from elastic_trainer.supervisor.processes.signals import StopRequest
    from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch


@dataclass(frozen=True)
class SlowVerdict:
    """This node's rank reported slow, and what ``core/eviction.decide`` made of it."""

    rank: Any  # as the worker's event said it
    slowdown: float
    reform_s: float
    decision: EvictionDecision


class StragglerExit:
    """``_slow_node_leaves`` each tick; ``_leave_as_straggler`` when it says so."""

    _cfg: RunConfig
    _stop: StopRequest
    _procs: ProcessTracker
    _membership: MembershipWatch
    _observer: GroupObserver
    ledger: Ledger
    _evictions = EvictionHistory()
    _node_probe: Callable[[], float] = staticmethod(node_probe.cpu_probe_s)
    _probe_baseline_s: float | None = None  # the node's probe at the supervisor's start

    if TYPE_CHECKING:  # the agent's own, used here

        def _initialize_workers(self, worker_group: WorkerGroup) -> None: ...
        def _stop_workers(self, worker_group: WorkerGroup) -> None: ...

    def _eviction_policy(self) -> eviction.EvictionPolicy | None:
        cfg = self._cfg
        if cfg.evict_stragglers is None:
            return None
        return eviction.EvictionPolicy(
            threshold=cfg.evict_stragglers, min_nodes=cfg.min_nodes, cooldown_s=cfg.evict_cooldown
        )

    def _time_node_probe(self) -> None:
        """The node's own speed before its workers run: what it is compared with while out."""
        if self._eviction_policy() is not None and self._probe_baseline_s is None:
            self._probe_baseline_s = self._node_probe()

    def _probe_ratio(self) -> float | None:
        if not self._probe_baseline_s:
            return None
        return round(self._node_probe() / self._probe_baseline_s, 3)

    def _slow_node_leaves(self) -> SlowVerdict | None:
        """This node's straggling rank reported since the last tick, and leaving pays. A rank
        kept is said once (``straggler.kept``)."""
        policy = self._eviction_policy()
        if policy is None:
            return None
        for event in self._observer.take_stragglers():
            num_nodes = len(self._membership.members) or 1
            node = eviction.slow_node(event, num_nodes=num_nodes)
            if node is None:
                continue
            reform_s = eviction.reform_estimate_s(
                recoveries_s=self.ledger.measured_s,
                recoveries=self.ledger.recoveries,
                cold_start_s=self.ledger.first_start_s(),
            )
            decision = eviction.decide(
                policy, self._evictions, node, reform_s=reform_s, now=time.monotonic()
            )
            verdict = SlowVerdict(event.get("rank"), node.slowdown, round(reform_s, 3), decision)
            if decision.evict:
                return verdict
            emit(
                "straggler.kept",
                rank=verdict.rank,
                slowdown=verdict.slowdown,
                reason=decision.reason,
                projected_gain_s=decision.projected_gain_s,
                reform_s=verdict.reform_s,
            )
        return None

    def _leave_as_straggler(self, wg: WorkerGroup, verdict: SlowVerdict) -> bool:
        """Leave, cool down, join again. False: a stop was asked for meanwhile (this node is
        out of the group already: the supervisor ends as preempted)."""
        decision = verdict.decision
        self._evictions = self._evictions.evicted(time.monotonic())
        emit(
            "straggler.evicted",
            level="warning",
            rank=verdict.rank,
            slowdown=verdict.slowdown,
            reason=decision.reason,
            projected_gain_s=decision.projected_gain_s,
            reform_s=verdict.reform_s,
            rejoin_after_s=decision.rejoin_after_s,
            evictions=self._evictions.evictions,
        )
        # the goodbye first: the others know why before any of their workers stops
        self._membership.say_goodbye(as_straggler=True)
        if self._stop.control_dir is not None:
            create_stop_file(self._stop.control_dir)  # the group's next step_done stops it
        wg.spec.rdzv_handler.leave()
        left_at = time.monotonic()
        kill_at = decisions.preemption_kill_at(left_at, self._cfg.worker.grace_period_s)
        while self._procs.alive() and time.monotonic() < kill_at:
            time.sleep(0.05)
        self._stop_workers(wg)
        wg.state = WorkerState.STOPPED
        policy, cooldowns = self._eviction_policy(), 0
        while True:
            if self._stop.wait(decision.rejoin_after_s):
                return False
            cooldowns += 1
            ratio = self._probe_ratio()
            if policy is None or eviction.rejoin_now(
                policy, probe_ratio=ratio, cooldowns=cooldowns
            ):
                break
            emit(
                "straggler.still_slow",
                probe_ratio=ratio,
                cooled_s=round(time.monotonic() - left_at, 3),
                cooldowns=cooldowns,
            )
        emit(
            "straggler.rejoining",
            cooled_s=round(time.monotonic() - left_at, 3),
            evictions=self._evictions.evictions,
            probe_ratio=ratio,
            cooldowns=cooldowns,
        )
        self._initialize_workers(wg)
        return True
