"""Pure parts of bench/recovery.py: the logs' lines to values, values to a ``Result``.

No files, no clocks: bench/_recovery_run.py reads the files and hands their text here, and
tests/bench/test_recovery.py checks the arithmetic (steps lost above all) on made-up logs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

PHASES = ("detect", "rendezvous", "worker_start", "restore", "first_step")

# what each launcher says when it notices the fault, and when the new round has closed
OUR_DETECT = {"worker.failed", "peer.lost", "peer.silent", "group.restarting"}
TORCHRUN_DETECT = re.compile(r"Worker group (FAILED|UNHEALTHY)|Detected \d+ new nodes")
TORCHRUN_RDZV = re.compile(r"Rendezvous complete for workers")
# the steps of a recovery, in order, for ``breakdown``: a supervisor's events (torch's log line
# for the start of its rendezvous: the workers are stopped by then), the session worker's markers
SUPERVISOR_STEPS = ("fault", "worker.failed", "peer.lost", "peer.silent", "group.restarting",
                    "store.moved", "rendezvous.joining", "rendezvous.completed",
                    "workers.started")  # fmt: skip
WORKER_STEPS = ("began", "imported", "optimizer", "group_ready", "session_import", "ddp",
                "open_memory_tier", "restore_state", "restored", "first_step")  # fmt: skip
RDZV_JOINING = "Rendezvous'ing worker group"
GLOG = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+)")

Row = tuple[int, int, int, float]  # an audit line: step, rank, world size, time
Stamp = tuple[str, float]  # an event name (or a log line, or a marker name) and its time


@dataclass(frozen=True, kw_only=True)
class Result:
    total: float | None = None  # fault -> first completed step of the new group
    pause: float | None = None  # the running group's last step before -> first step after
    steps_lost: int | None = None
    phases: dict[str, float | None] = field(default_factory=dict)
    resumed_from: int | None = None  # the step the new group started from
    source: str | None = None  # snapshot.restored's sources ("memory+mirror"); None: no event
    detail: str = ""  # where the phases' time went (``breakdown``), for the per-run line

    def __str__(self) -> str:
        parts = [f"{k}={v:.2f}" for k, v in self.phases.items() if v is not None]
        detail = f"\n    {self.detail}" if self.detail else ""
        return (
            f"total={self.total} pause={self.pause} lost={self.steps_lost} "
            f"from={self.resumed_from} source={self.source} " + " ".join(parts) + detail
        )


@dataclass(frozen=True, kw_only=True)
class Restore:
    """What the new group's ``snapshot.restored`` events say (one per rank that restored)."""

    step: int
    source: str  # the distinct sources, sorted, joined by "+"


def parse_audit(text: str) -> list[Row]:
    out = []
    for line in text.splitlines():
        p = line.split()
        if len(p) == 4:  # a line torn by a kill has fewer fields
            with contextlib.suppress(ValueError):
                out.append((int(p[0]), int(p[1]), int(p[2]), float(p[3])))
    return out


def parse_markers(text: str) -> list[Stamp]:
    out = []
    for line in text.splitlines():
        p = line.split()
        if len(p) == 4:
            with contextlib.suppress(ValueError):
                out.append((p[0], float(p[1])))
    return out


def parse_events(text: str) -> list[dict[str, Any]]:
    """Our JSON lines, each with ``_t`` (its timestamp, epoch seconds) added."""
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            ev = json.loads(line)
            ev["_t"] = datetime.fromisoformat(ev["timestamp"]).timestamp()
            out.append(ev)
    return out


def parse_glog(text: str, year: int) -> list[Stamp]:
    """torchrun's glog-style lines (I1122 19:40:00.123456 pid file:line] text), local time."""
    out = []
    for line in text.splitlines():
        m = GLOG.match(line)
        if m:
            stamp = f"{year}-{m[1]}-{m[2]} {m[3]}"
            out.append((line, datetime.fromisoformat(stamp).timestamp()))
    return out


def first_after(stamps: list[Stamp], match: Callable[[str], bool], t: float | None):
    if t is None:
        return None
    return min((ts for name, ts in stamps if ts >= t and match(name)), default=None)


def last_of_first(marks: list[Stamp], name: str, after: float | None) -> float | None:
    """The latest rank's first ``name`` marker after ``after`` (the group waits for all)."""
    if after is None:
        return None
    hits = [t for n, t in marks if n == name and t >= after]
    if not hits:
        return None
    first = min(hits)
    return max(t for t in hits if t - first < 30)  # one per rank of this start


def restore_after(events: list[dict[str, Any]], after: float) -> Restore | None:
    """The first restore after ``after``: its step, and the sources its ranks used.

    All ranks of one start agree on the step (worker.memory.plan); a later start (a second fault)
    is a different restore, so only the events of the first step seen count."""
    restored = sorted(
        (e for e in events if e.get("event") == "snapshot.restored" and e["_t"] >= after),
        key=lambda e: e["_t"],
    )
    if not restored:
        return None
    step = int(restored[0]["step"])
    sources = {str(e.get("source", "storage")) for e in restored if int(e["step"]) == step}
    return Restore(step=step, source="+".join(sorted(sources)))


def breakdown(stamps: list[Stamp], names: tuple[str, ...], after: float | None) -> str:
    """``name=+seconds`` since the one before, for each of ``names`` at its latest rank's first
    occurrence after ``after``, in time order; a name never seen is left out. For a look at
    where one phase's time goes, not for the table."""
    found = [(n, last_of_first(stamps, n, after)) for n in names]
    seen = sorted(((n, t) for n, t in found if t is not None), key=lambda nt: nt[1])
    spans = [f"{b[0]}=+{b[1] - a[1]:.2f}" for a, b in itertools.pairwise(seen)]
    return " ".join(spans)


def steps_lost(last_done: int, resumed_from: int) -> int:
    """Steps the old group completed that the new one does again."""
    return max(0, last_done - resumed_from)


def result(
    *,
    fault: float,
    detected: float | None,
    formed: float | None,
    marks: list[Stamp],
    audit: list[Row],
    restore: Restore | None,
    ws_after: int,
) -> Result:
    """The phases and steps lost of one recovery, on the node that keeps running.

    Steps lost = the last step the old group completed (any audit line before the new
    group's restore: it may train on a moment after the fault) minus the step the new group
    resumed from: the ``snapshot.restored`` step when the worker reports one (a
    ``TrainingSession``), else one before the new group's first step (the plain worker, which
    logs no event; both agree for a session worker)."""
    ready = last_of_first(marks, "group_ready", formed)
    restored = last_of_first(marks, "restored", ready)
    if restored is None:
        return Result()
    after = [r for r in audit if r[2] == ws_after and r[3] > restored]
    if not after:
        return Result()
    first = min(after, key=lambda r: r[3])
    before = [r for r in audit if r[3] < restored]
    last_done = max((r[0] for r in before), default=0)
    last_t = max((r[3] for r in before), default=None)
    resumed = restore.step if restore is not None else first[0] - 1
    bounds = [fault, detected, formed, ready, restored, first[3]]
    spans = {
        name: (b - a if a is not None and b is not None else None)
        for name, a, b in zip(PHASES, bounds[:-1], bounds[1:], strict=True)
    }
    return Result(
        total=round(first[3] - fault, 3),
        pause=None if last_t is None else round(first[3] - last_t, 3),
        steps_lost=steps_lost(last_done, resumed),
        phases=spans,
        resumed_from=resumed,
        source=None if restore is None else restore.source,
    )
