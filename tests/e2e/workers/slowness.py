"""Slowness as production has it, put on one process from outside: a duty-cycled
SIGSTOP/SIGCONT (a hypervisor's steal, a swapping neighbour) and a CPU quota through a cgroup
of its own (used by tests/e2e/test_stragglers.py and bench/straggler.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path


def duty_cycle(pid: int, stop: threading.Event, stopped_s: float, running_s: float) -> None:
    while not stop.is_set():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        time.sleep(stopped_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        stop.wait(running_s)


class CpuQuota:
    """A cgroup of its own with a CPU quota: cgroup v2 (``cpu.max``) or v1 (``cpu`` controller,
    ``cpu.cfs_quota_us``). ``made`` is None where this user cannot make one."""

    PERIOD_US = 100_000

    def __init__(self) -> None:
        self.group: Path | None = None
        self.v2 = False
        name = f"straggler-{os.getpid()}"
        v1 = Path("/sys/fs/cgroup/cpu")
        candidates = [
            (_v2_parent(), True),
            (v1 if (v1 / "cpu.cfs_quota_us").exists() else None, False),
        ]
        for parent, v2 in candidates:
            if parent is None:
                continue
            with contextlib.suppress(OSError):
                (parent / name).mkdir()
                self.group, self.v2 = parent / name, v2
                return

    def limit(self, cpus: float) -> None:
        quota = round(cpus * self.PERIOD_US)
        if self.v2:
            (self.group / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            (self.group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.group / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, pid: int) -> None:
        (self.group / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Move what is left back to the parent, then remove the group."""
        with contextlib.suppress(OSError):
            for pid in (self.group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.group.parent / "cgroup.procs").write_text(pid)
            self.group.rmdir()


def _v2_parent() -> Path | None:
    try:
        relative = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
    except (OSError, IndexError):
        return None
    parent = Path("/sys/fs/cgroup") / relative.lstrip("/")
    return parent if _v2_has_cpu(parent) else None


def _v2_has_cpu(parent: Path) -> bool:
    with contextlib.suppress(OSError):
        return "cpu" in (parent / "cgroup.subtree_control").read_text().split()
    return False
