"""How fast this node runs a fixed piece of CPU work on its own (``--evict-stragglers``).

A node that left the group as a straggler has no group to compare with while it is out, so
its supervisor compares the node with itself: the same work timed at the supervisor's start
(before its workers run) and again after each cool-down. What slows a whole node's CPUs
(a CPU quota, a neighbour on the same cores, throttling) slows this work too; what slows only
the worker (its GPU, a sleep in the training step) does not, and the group's verdict judges
that again once the node is back.

The work is hashing a fixed buffer: C code that holds one core and touches no device, no file
and no other process, round after round for a fixed window; the probe is the window's time
per round. A CPU quota (cgroup ``cpu.max``) gives a process its budget per period (100 ms by
default) and stops it for the rest: a round of a few milliseconds timed alone mostly fits in
the budget and runs at full speed, so the median of a few such rounds can show a quota of a
twentieth of a CPU as 1.2x instead of ~20x. A window of several periods sees the quota's
share, and one scheduler hiccup in it does not decide.
"""

from __future__ import annotations

import hashlib
import time

PROBE_BYTES = 1 << 20  # one round: about a millisecond of hashing on one core
# three periods of the kernel's default CPU quota period (100 ms): what a quota leaves shows
PROBE_WINDOW_S = 0.3

_BUFFER = bytes(range(256)) * (PROBE_BYTES // 256)


def cpu_probe_s(window_s: float = PROBE_WINDOW_S) -> float:
    """Seconds one round of the fixed work takes on this node now: rounds back to back for
    ``window_s``, the window's time over the rounds it ran (at least one)."""
    rounds, began = 0, time.perf_counter()
    while True:
        hashlib.sha256(_BUFFER).digest()
        rounds += 1
        elapsed = time.perf_counter() - began
        if elapsed >= window_s:
            return elapsed / rounds
