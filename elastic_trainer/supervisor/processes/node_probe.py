"""How fast this node runs a fixed piece of CPU work on its own (``--evict-stragglers``).

A node that left the group as a straggler has no group to compare with while it is out, so
its supervisor compares the node with itself: the same work timed at the supervisor's start
(before its workers run) and again after each cool-down. What slows a whole node's CPUs
(a CPU quota, a neighbour on the same cores, throttling) slows this work too; what slows only
the worker (its GPU, a sleep in the training step) does not, and the group's verdict judges
that again once the node is back.

The work is hashing a fixed buffer: C code that holds one core for a few milliseconds and
touches no device, no file and no other process; the median of several rounds, so one
scheduler hiccup does not decide.
"""

from __future__ import annotations

import hashlib
import statistics
import time

PROBE_BYTES = 4 << 20  # a few milliseconds of hashing on one core
ROUNDS = 7

_BUFFER = bytes(range(256)) * (PROBE_BYTES // 256)


def cpu_probe_s(rounds: int = ROUNDS) -> float:
    """Seconds one round of the fixed work takes on this node now (the median of
    ``rounds``)."""
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        hashlib.sha256(_BUFFER).digest()
        times.append(time.perf_counter() - began)
    return statistics.median(times)
