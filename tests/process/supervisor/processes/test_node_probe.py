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
    assert 0 < cpu_probe_s(window_s=0.05) < 5.0


def _slowdown_under_quota(cpus: float) -> float:
    """The probe of a process under a CPU quota of ``cpus``, over its own start (best of 3)."""
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

        before = min(probe() for _ in range(3))
        quota.add(prober.pid)
        quota.limit(cpus)
        after = probe()
    finally:
        prober.kill()
        prober.wait()
        quota.remove()
    return after / before


def test_a_cpu_quota_makes_the_probe_slower_than_the_eviction_threshold() -> None:
    # a twentieth of one CPU; 1.3: --evict-stragglers' usual threshold
    assert _slowdown_under_quota(0.05) >= 1.3


def test_a_quota_whose_budget_holds_many_rounds_is_seen() -> None:
    """Regression: the probe was the median of 7 short rounds (~17 ms of hashing in all), which
    a quota of a fifth of a CPU (20 ms a period) let run at full speed: the node looked healthy
    and rejoined. Its window now spans several periods: ~5x."""
    assert _slowdown_under_quota(0.2) >= 2.0
