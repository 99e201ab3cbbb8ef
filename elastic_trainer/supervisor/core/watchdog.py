"""Hang watchdog: progress files in, a verdict out.

Workers rewrite ``progress-<local_rank>.json`` after every completed step. The watchdog is
armed only once some worker of the current attempt has reported: a plain torchrun script
never reports, and must never be killed for it. It fires when *no* rank has made progress
for ``timeout_s`` (one slow rank stalls all of them in DDP, so the group is the unit).

``HangWatchdog`` is pure (times are passed in); ``read_progress`` is the only I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic_trainer.contract import protocol


@dataclass(frozen=True, kw_only=True)
class Progress:
    step: int
    epoch: int = 0
    restored_step: int | None = None
    time: float = 0.0


def parse_progress(text: str) -> Progress | None:
    """One progress file's content -> Progress; None while it is half-written or garbage."""
    body = protocol.progress_json(text)
    if body is None:
        return None
    try:
        data = json.loads(body)
        restored = data.get("restored_step")
        return Progress(
            step=int(data["step"]),
            epoch=int(data.get("epoch") or 0),
            restored_step=None if restored is None else int(restored),
            time=float(data.get("time") or 0.0),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True, kw_only=True)
class HangVerdict:
    local_rank: int  # the rank that reported last longest ago
    last_step: int
    stalled_s: float


@dataclass
class HangWatchdog:
    """Tracks when each rank last changed its report; says when the group stalled."""

    timeout_s: float  # 0 = off
    _last: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (step, seen_at)

    def reset(self) -> None:
        """A new attempt: disarm until a worker reports again."""
        self._last.clear()

    @property
    def armed(self) -> bool:
        return self.timeout_s > 0 and bool(self._last)

    def observe(self, reports: Mapping[int, Progress], now: float) -> HangVerdict | None:
        for rank, progress in reports.items():
            previous = self._last.get(rank)
            if previous is None or previous[0] != progress.step:
                self._last[rank] = (progress.step, now)
        return self.verdict(now)

    def verdict(self, now: float) -> HangVerdict | None:
        if not self.armed:
            return None
        newest = max(seen for _, seen in self._last.values())
        if now - newest < self.timeout_s:
            return None
        rank, (step, seen) = min(self._last.items(), key=lambda item: item[1][1])
        return HangVerdict(local_rank=rank, last_step=step, stalled_s=now - seen)
