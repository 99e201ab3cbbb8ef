"""The one place the dist tests launch workers: swap torchrun for elastic-train here."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    returncode: int
    output: str


def launch_workers(
    script: str, nproc: int, args: list[str], *, env: dict[str, str], timeout: float = 60
) -> Launch:
    """Run ``script`` on ``nproc`` local workers (gloo, 127.0.0.1) through the real launcher."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
        script,
        *args,
    ]
    env = {**env, "GLOO_SOCKET_IFNAME": "lo"}  # gloo on loopback only
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return Launch(done.returncode, done.stdout + done.stderr)
