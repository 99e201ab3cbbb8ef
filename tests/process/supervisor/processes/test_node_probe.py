"""The node probe (``--evict-stragglers``' health check while a node is out) sees what slows a
whole node: a CPU quota on the process that runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_trainer.supervisor.processes.node_probe import cpu_probe_s
from tests.e2e.workers.slowness import CpuQuota

# times the probe once per line on stdin, and prints the seconds
PROBER = """
import sys
from elastic_trainer.supervisor.processes.node_probe import cpu_probe_s
for _ in sys.stdin:
    print(cpu_probe_s(), flush=True)
"""


def test_the_probe_times_a_round_of_its_work() -> None:
    assert 0 < cpu_probe_s(rounds=3) < 5.0


def test_a_cpu_quota_makes_the_probe_slower_than_the_eviction_threshold() -> None:
    quota = CpuQuota()
    if quota.group is None:
        pytest.skip("no cgroup (v2 with the cpu controller, or v1 cpu) this user can make")
    prober = subprocess.Popen(
        [sys.executable, "-c", PROBER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:

        def probe() -> float:
            prober.stdin.write("\n")
            prober.stdin.flush()
            return float(prober.stdout.readline())

        before = min(probe() for _ in range(3))  # its own start: the best of three
        quota.add(prober.pid)
        quota.limit(0.05)  # a twentieth of one CPU
        after = probe()
    finally:
        prober.kill()
        prober.wait()
        quota.remove()
    assert after / before >= 1.3, (before, after)  # --evict-stragglers' usual threshold
