"""What the agent sees of its running workers, turned into decisions' inputs and events.

Each monitor tick the agent asks the observer once: it reads the workers' progress files,
feeds the ledger (``recovery.completed``, or ``recovery.unmeasured`` for a script that
reports no progress) and the hang watchdog, and every ``resources_interval`` samples the
process trees' RSS and CPU (``worker.resources``). With ``--metrics-port`` it also feeds the
metrics (``metrics_server.py``): the progress reports, the goodput so far and the events
workers forwarded (``tail.py``). The agent keeps the decisions; this module keeps the
bookkeeping that is only observation.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic_trainer.contract import protocol
from elastic_trainer.contract.events import emit
from elastic_trainer.supervisor.core.ledger import Ledger
from elastic_trainer.supervisor.core.watchdog import (
    HangVerdict,
    HangWatchdog,
    Progress,
    parse_progress,
)
from elastic_trainer.supervisor.processes.procs import ProcessTracker, Resources
from elastic_trainer.supervisor.processes.tail import WorkerEventTail

if TYPE_CHECKING:
    from elastic_trainer.supervisor.metrics_server import SupervisorMetrics

# psutil's first CPU reading of a process is 0: the first resources event comes after a while
_FIRST_RESOURCES_AFTER_S = 5.0
# How often the workers' process trees are scanned for new descendants between resources
# samples. A scan reads every process of the machine (psutil's children() builds the parent
# map from all of /proc): at every 0.2 s tick it was the largest part of an idle agent's CPU.
# A descendant orphaned between two scans still comes to the supervisor (the child
# subreaper), where the stop's own scan and reap_strays find it.
TREE_SCAN_EVERY_S = 1.0


class GroupObserver:
    """Progress, hangs and resources of the current attempt's workers on this node."""

    def __init__(
        self,
        *,
        procs: ProcessTracker,
        hang_timeout: float,
        resources_interval: float,
        metrics: SupervisorMetrics | None = None,
        follow_stragglers: bool = False,
    ) -> None:
        """``follow_stragglers``: keep this node's ranks' ``straggler.detected`` events for
        ``take_stragglers`` (``--evict-stragglers``)."""
        self.ledger = Ledger()
        self._metrics = metrics
        self._follow_stragglers = follow_stragglers
        self._stragglers: list[dict[str, Any]] = []
        self._tail: WorkerEventTail | None = None
        self._born = time.monotonic()
        self._procs = procs
        self._watchdog = HangWatchdog(timeout_s=hang_timeout)
        self._interval = resources_interval
        self._next_resources = 0.0
        self._next_scan = 0.0
        self._last: dict[int, Resources] = {}

    def attempt_started(self, now: float) -> None:
        self._procs.resources()  # primes psutil's CPU counters
        self._watchdog.reset()
        self.ledger.start_attempt()
        self._next_resources = now + min(_FIRST_RESOURCES_AFTER_S, self._interval)
        self._tail = None  # the new attempt's folder is read from its start
        self._stragglers = []  # the previous attempt's verdicts are of another group
        if self._metrics is not None:
            self._metrics.attempt_started()

    def observe(
        self,
        control_dir: str,
        *,
        local_world_size: int,
        world_size: int,
        global_rank: Callable[[int], int],
    ) -> HangVerdict | None:
        """One tick: events for recoveries and resources; a verdict if the group hangs."""
        reports = read_progress(control_dir, range(local_world_size))
        unmeasured = self.ledger.unmeasured_restart(world_size=world_size)
        if unmeasured is not None:  # a plain script restarted: what it lost is unknown
            emit("recovery.unmeasured", **unmeasured)
        recovered = self.ledger.observe(reports, world_size=world_size)
        if recovered is not None:
            emit("recovery.completed", **recovered)
        now = time.monotonic()
        if now >= self._next_resources:
            self._next_resources = now + self._interval
            self._emit_resources(global_rank)
            self._feed_goodput(now)
        elif now >= self._next_scan:
            self._next_scan = now + TREE_SCAN_EVERY_S
            self._procs.refresh()
        self._read_events(control_dir, local_world_size, reports)
        return self._watchdog.observe(reports, now)

    def take_stragglers(self) -> list[dict[str, Any]]:
        """The ``straggler.detected`` events this node's ranks wrote since the last call."""
        taken, self._stragglers = self._stragglers, []
        return taken

    def _read_events(self, control_dir: str, local_world_size: int, reports: Any) -> None:
        if self._metrics is None and not self._follow_stragglers:
            return
        if self._tail is None:
            self._tail = WorkerEventTail(control_dir, range(local_world_size))
        for event in self._tail.read():
            if self._metrics is not None:
                self._metrics.event(event)
            if self._follow_stragglers and event.get("event") == "straggler.detected":
                self._stragglers.append(event)
        if self._metrics is not None:
            self._metrics.progress(reports)

    def _feed_goodput(self, now: float) -> None:
        if self._metrics is not None:
            ratio = self.ledger.goodput(now - self._born)
            # unknown (a plain script restarted) is NaN, not the value the gauge held before
            self._metrics.goodput(math.nan if self.ledger.goodput_unknown else ratio)

    def _emit_resources(self, global_rank: Callable[[int], int]) -> None:
        self._procs.refresh()
        self._last = self._procs.resources()
        for local_rank, res in self._last.items():
            emit(
                "worker.resources",
                rank=global_rank(local_rank),
                local_rank=local_rank,
                rss_bytes=res.rss_bytes,
                cpu_percent=round(res.cpu_percent, 1),
                num_procs=res.num_procs,
            )

    def resources_fields(self, local_rank: int) -> dict[str, Any]:
        """The last sampled figures of ``local_rank``, for a ``worker.failed`` event."""
        res = self._last.get(local_rank)
        if res is None:
            return {}
        return {"rss_bytes": res.rss_bytes, "cpu_percent": round(res.cpu_percent, 1)}


def read_progress(control_dir: str, local_ranks: range) -> dict[int, Progress]:
    out: dict[int, Progress] = {}
    for local_rank in local_ranks:
        path = os.path.join(control_dir, protocol.progress_file(local_rank))
        try:
            with open(path, encoding="utf-8") as f:
                progress = parse_progress(f.read())
        except OSError:
            continue
        if progress is not None:
            out[local_rank] = progress
    return out
