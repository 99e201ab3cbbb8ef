"""The one place the dist tests launch workers: through ``elastic-train`` (our supervisor).

Workers get the supervisor's environment (torchrun's variables plus ours, including a fresh
``ELASTIC_TRAIN_CONTROL_DIR`` per attempt); the supervisor's JSON events come back parsed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Launch:
    returncode: int
    output: str
    events: list[dict[str, Any]] = field(default_factory=list)

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]


def launch_workers(
    script: str,
    nproc: int,
    args: list[str],
    *,
    env: dict[str, str],
    timeout: float = 90,
    max_restarts: int = 0,
    supervisor_args: Sequence[str] = (),
) -> Launch:
    """Run ``script`` on ``nproc`` local workers (gloo, 127.0.0.1) through elastic-train."""
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        log_file = Path(tmp) / "events.jsonl"
        command = [
            sys.executable,
            "-m",
            "elastic_trainer.cli",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.1",
            "--log-format",
            "json",
            "--log-file",
            str(log_file),
            *supervisor_args,
            script,
            *args,
        ]
        env = {**env, "GLOO_SOCKET_IFNAME": "lo"}  # gloo on loopback only
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        events = _parse(log_file)
    return Launch(done.returncode, done.stdout + done.stderr, events)


def _parse(path: Path) -> list[dict[str, Any]]:
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a worker's plain print that landed in the file
    return events
