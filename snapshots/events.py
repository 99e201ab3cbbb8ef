"""The events this package emits: the one catalogue of snapshot events (elastic_trainer's
event catalogue includes it).

Logged through ``structlog.get_logger("snapshots")``; the package never imports
elastic_trainer, so it stays usable on its own.
"""

from __future__ import annotations

from typing import Any

import structlog

EVENTS: dict[str, tuple[str, ...]] = {
    "snapshot.saved": ("step", "epoch", "url", "bytes", "stall_ms", "write_ms"),
    "snapshot.skipped": ("step", "reason"),
    # source: storage (this package), or memory | mirror (elastic_trainer's in-memory tier)
    "snapshot.restored": ("step", "saved_world_size", "world_size", "source"),
    "snapshot.corrupt": ("step", "url", "problem"),
    "snapshot.failed": ("step", "url", "error"),
    "snapshot.pruned": ("steps", "url"),
    "snapshot.reserved_released": ("bytes", "url"),  # the job ended: ``.reuse/`` freed
    "snapshot.storage_retry": ("op", "url", "attempt", "error"),
    "snapshot.adopted": ("url", "job_id", "run_token", "previous_run_token", "reason"),
    # the writer process (``_writer_process``): started; lost (later saves on the thread)
    "snapshot.writer_process_started": ("pid",),
    "snapshot.writer_process_lost": ("pid", "error", "fallback"),
}
_LEVELS = {
    "snapshot.corrupt": "warning",
    "snapshot.failed": "error",
    "snapshot.skipped": "warning",
    "snapshot.storage_retry": "warning",
    "snapshot.writer_process_lost": "warning",
}


def emit(event: str, **fields: Any) -> None:
    missing = [f for f in EVENTS[event] if f not in fields]
    if missing:
        raise KeyError(f"event {event} is missing fields {missing}")
    log = structlog.get_logger("snapshots")
    getattr(log, _LEVELS.get(event, "info"))(event, **fields)
