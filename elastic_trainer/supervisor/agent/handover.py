"""The hand-over: a node joins a running group, and its workers may be replaced alongside
(``decisions.start_alongside``): the new round forms while the old workers train on, the new
workers start beside them, and the old ones stop at a step's end only once every new one has
its process group (``worker.handoff``). The group pauses for that stop and the restore, not
for the round or the new processes' start.

A mixin of ``ElasticTrainAgent``: it drives the agent's own rendezvous, start and process
tracking, so it shares the agent's state rather than copying it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from elastic_trainer.contract import protocol
from elastic_trainer.contract.events import emit
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.agent.control_files import await_copies, listed, mark_restarting
from elastic_trainer.supervisor.core import decisions
from elastic_trainer.supervisor.core.handover_pause import HandedOver, last_step_time, step_time
from elastic_trainer.supervisor.core.ledger import Ledger
from elastic_trainer.supervisor.processes.observer import read_progress
from elastic_trainer.supervisor.processes.procs import ProcessTracker
from elastic_trainer.supervisor.processes.workerenv import remove_control_dir

if TYPE_CHECKING:
    from elastic_trainer.contract.config import RunConfig
    from elastic_trainer.supervisor.processes.signals import StopRequest
    from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch

# How long the old workers train on while a joining round's new workers start alongside them
# (``_admit``): a start from the warm pool takes ~0.1 s, a fresh one seconds; past this the
# old ones stop anyway and the new ones finish starting during the pause.
HANDOFF_READY_S = 60.0
HANDOFF_POLL_S = 0.005


class HandOver:
    """``_admit`` and its steps; the agent's loop calls ``_may_start_alongside`` first."""

    _cfg: RunConfig
    _stop: StopRequest
    _procs: ProcessTracker
    _membership: MembershipWatch
    _worker_group: WorkerGroup
    _kill_grace_s: float
    ledger: Ledger
    _handed_over: HandedOver | None = None  # its event waits for the new workers' first step

    if TYPE_CHECKING:  # the agent's own, used here

        def _rendezvous(self, worker_group: WorkerGroup) -> None: ...
        def _start_workers(self, wg: WorkerGroup, *, handoff: bool = False) -> dict[int, Any]: ...
        def _started(self, wg: WorkerGroup, pids: dict[int, Any]) -> None: ...
        def _attempt_began(self) -> None: ...
        def _poll_codes(self) -> dict[int, int | None]: ...
        def _accelerator(self) -> bool: ...

    def _may_start_alongside(self) -> bool:
        control_dir = self._stop.control_dir
        if control_dir is None:
            return False
        return decisions.start_alongside(
            range(self._worker_group.spec.local_world_size),
            aware=listed(control_dir, protocol.handoff_aware_file),
            accelerator=self._accelerator(),
        )

    def _admit(self, wg: WorkerGroup) -> None:
        """Form the new round, start the new workers alongside, then stop the old ones."""
        self._rendezvous(wg)  # a stop requested meanwhile raises StopRequested: _preempt
        old_dir = self._stop.control_dir or ""
        old_procs = self._procs.handover()
        old_context = torch_compat.take_processes(self)
        began, began_at = time.monotonic(), time.time()
        pids = self._start_workers(wg, handoff=True)
        new_dir = self._stop.control_dir
        self._stop.control_dir = old_dir  # a stop request now reaches the workers that train
        step = self._await_new_workers(new_dir or "", began + HANDOFF_READY_S)
        if step == decisions.Handoff.ABANDON:
            self._abandon_new_workers(wg, old_procs, old_context, new_dir or "", began)
            return
        ready = step == decisions.Handoff.READY
        stopping = time.monotonic()
        self._stop_old_workers(old_procs, old_dir)
        self._stop.control_dir = new_dir
        with contextlib.suppress(OSError):  # the new workers go on (worker.handoff)
            os.unlink(os.path.join(new_dir or "", protocol.HANDOFF_FILE))
        stopped = time.monotonic()
        old_procs.kill(grace_s=self._kill_grace_s, reap=False)  # exiting, or stuck: killed
        if old_context is not None:
            old_context.close(timeout=1)
        if self._stop.requested:  # it reached the old workers: tell the new ones too
            self._stop.write_stop_file()
        last, step_s = self._last_steps(old_dir, wg, began_at)
        remove_control_dir(old_dir)
        self._attempt_began()
        # group.handed_over once the new workers report a step (``_report_handover``)
        self._handed_over = HandedOver(ready=ready, start_s=round(stopping - began, 3),
                                       stop_s=round(stopped - stopping, 3), last_time=last,
                                       step_s=step_s)  # fmt: skip
        self._started(wg, pids)

    def _last_steps(
        self, old_dir: str, wg: WorkerGroup, began_at: float
    ) -> tuple[float | None, float | None]:
        """The old workers' last progress, into their attempt's record: when the join's pause
        began (their last step, or the hand-over's start if they had stopped stepping before
        it: a group stalled beforehand did not stall for the join) and their step time (None:
        not reported)."""
        reports = read_progress(old_dir, range(wg.spec.local_world_size))
        if self.ledger.current is not None:
            self.ledger.current.observe(reports)
        last = last_step_time(reports)
        return (None if last is None else max(last, began_at)), step_time(self.ledger.current)

    def _report_handover(self, *, ended: bool = False) -> None:
        """``group.handed_over`` of the last hand-over, once its new workers made a step, or
        (``ended``) as their attempt ends without one: ``pause_s`` null then."""
        pending = self._handed_over
        if pending is None:
            return
        fields = pending.fields(self.ledger.current, ended=ended)
        if fields is not None:
            self._handed_over = None
            emit(
                "group.handed_over",
                ready=fields["ready"],
                start_s=fields["start_s"],
                stop_s=fields["stop_s"],
                pause_s=fields["pause_s"],
            )

    def _await_new_workers(self, control_dir: str, deadline: float) -> decisions.Handoff:
        """Wait while the old workers train, until ``decisions.handoff_step`` says otherwise:
        every new worker ready, one exited, the round moved on, a stop, a lost peer, or
        ``deadline``."""
        moved_on, next_read = False, 0.0
        while True:
            if time.monotonic() >= next_read:  # a store read: as often as the loop's own
                moved_on = self._membership.nodes_waiting() > 0
                next_read = time.monotonic() + self._cfg.monitor_interval
            step = decisions.handoff_step(
                self._poll_codes(),
                ready=listed(control_dir, protocol.handoff_ready_file),
                round_moved_on=moved_on,
                interrupted=bool(
                    self._stop.requested
                    or self._membership.lost_peers()
                    or time.monotonic() > deadline
                ),
            )
            if step != decisions.Handoff.WAIT:
                return step
            time.sleep(HANDOFF_POLL_S)

    def _abandon_new_workers(
        self,
        wg: WorkerGroup,
        old_procs: ProcessTracker,
        old_context: Any,
        new_dir: str,
        began: float,
    ) -> None:
        """The round moved on before the new workers had their group: they go (killed: they
        wait before they touch any state, ``worker.handoff``), and the old ones, which never
        stopped, are this node's workers again. The loop sees the waiting node next and
        forms the next round the same way, alongside."""
        self._procs.kill(grace_s=0, reap=False)  # the old ones would look like strays
        new_context = torch_compat.take_processes(self)
        if new_context is not None:
            new_context.close(timeout=1)
        self._procs.take_back(old_procs)
        torch_compat.give_processes(self, old_context)
        self._started(wg, self._procs.pids())
        remove_control_dir(new_dir)
        emit(
            "group.handover_abandoned",
            level="warning",
            reason="round_moved_on",
            start_s=round(time.monotonic() - began, 3),
            consequence="the running workers train on; the next round forms alongside them",
        )

    def _stop_old_workers(self, procs: ProcessTracker, control_dir: str) -> None:
        """The old workers, while the new ones wait: told it is a restart (unless a stop
        file says it is a preemption), signalled, so that each stops at its step's end with
        its copy (``TrainingSession``) and says so as it exits (``protocol.handed_off_file``);
        one that does neither within the kill grace (blocked in a collective) is asked for
        its just-in-time copy, then killed. The caller kills the rest once the new ones go on
        (those that handed off are only exiting)."""
        mark_restarting(control_dir)
        procs.signal_roots(signal.SIGTERM)
        deadline = time.monotonic() + self._kill_grace_s
        while not decisions.handed_off(
            procs.poll_codes(), done=listed(control_dir, protocol.handed_off_file)
        ):
            if time.monotonic() > deadline:
                await_copies(control_dir, procs.poll_codes)
                # before the new ones go on: nothing of theirs (a snapshot write) may outlive it
                procs.kill(grace_s=0, reap=False)
                break
            time.sleep(HANDOFF_POLL_S)
