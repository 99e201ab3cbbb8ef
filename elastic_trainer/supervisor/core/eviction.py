"""Whether a straggling node should leave the group: a pure decision (``--evict-stragglers``).

The decision is node-local: every rank reaches the same straggler verdict
(``worker.stragglers``), and the slow rank's own ``straggler.detected`` reaches its own
node's supervisor, which alone decides whether its node leaves (gracefully, as a preempted
node does) and when it may come back. Nothing has to be agreed between supervisors: the
other nodes see a member leave and re-form without it.

Leaving pays when what the group gains over the work left beats what it costs:

- now every step takes the slow rank's time, about ``median_step_s * slowdown``;
- without the node the other ``n - 1`` nodes share its part of the global batch, so a step
  takes about ``median_step_s * n / (n - 1)``;
- the cost is two re-forms (one without the node, one when it comes back), each as long as
  the re-forms this job has measured (``recovery.completed`` downtime, or a pause of a join).

So the projected gain is ``steps_left * (step now - step without) - 2 * reform_s``; the node
leaves only when it is positive, the slowdown is at least the operator's threshold, the group
keeps ``min_nodes``, this node is the slowest of the slow (so two nodes never leave at once)
and its backoff has passed (each eviction of this node doubles the wait before the next: a
node that comes back slow is not evicted in a loop).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

# the work left when the run does not know its own length: the gain is judged over this many
DEFAULT_HORIZON_STEPS = 1000


@dataclass(frozen=True, kw_only=True)
class EvictionPolicy:
    threshold: float  # --evict-stragglers: the slowdown from which leaving is considered
    min_nodes: int
    cooldown_s: float  # --evict-cooldown: before an evicted node asks to join again
    backoff_s: float = 600.0  # after the first eviction; doubled by each further one

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ValueError(f"--evict-stragglers={self.threshold}: use a slowdown > 1, e.g. 1.3")
        if self.cooldown_s < 0 or self.backoff_s < 0:
            raise ValueError("EvictionPolicy: cooldown_s and backoff_s must be >= 0")


@dataclass(frozen=True, kw_only=True)
class SlowNode:
    """What this node's supervisor knows when its rank is reported slow."""

    slowdown: float  # straggler.detected
    median_step_s: float  # the other ranks' compute per step (straggler.detected median_ms)
    steps_left: int | None  # max_steps - step; None: no step budget
    num_nodes: int  # in the current round
    slowest: bool  # no other flagged rank is slower (the verdict every rank holds)


@dataclass(frozen=True)
class EvictionHistory:
    evictions: int = 0
    last_evicted_at: float | None = None

    def evicted(self, now: float) -> EvictionHistory:
        return replace(self, evictions=self.evictions + 1, last_evicted_at=now)


@dataclass(frozen=True)
class EvictionDecision:
    evict: bool
    reason: str
    projected_gain_s: float
    rejoin_after_s: float = 0.0


def slow_node(event: Mapping[str, Any], *, num_nodes: int) -> SlowNode | None:
    """What a ``straggler.detected`` of this node's own rank says (read back from the
    worker's events file, so each field is checked); None when it is not one."""
    slowdown, median_ms = event.get("slowdown"), event.get("median_ms")
    steps_left, slowest = event.get("steps_left"), event.get("slowest", True)
    if not (_number(slowdown) and _number(median_ms) and isinstance(slowest, bool)):
        return None
    if steps_left is not None and not (isinstance(steps_left, int) and steps_left >= 0):
        return None
    return SlowNode(
        slowdown=float(slowdown),
        median_step_s=float(median_ms) / 1e3,
        steps_left=steps_left,
        num_nodes=num_nodes,
        slowest=slowest,
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def reform_estimate_s(*, recoveries_s: float, recoveries: int, cold_start_s: float | None) -> float:
    """What one re-form costs this job: its measured recoveries' mean downtime, else its
    first start (workers started to the first step, an upper bound: a re-form starts warm),
    else ``DEFAULT_REFORM_S``."""
    if recoveries > 0:
        return recoveries_s / recoveries
    return cold_start_s if cold_start_s is not None else DEFAULT_REFORM_S


# a re-form's cost before the job has measured any start (the rejoin and the leave)
DEFAULT_REFORM_S = 30.0

# cool-downs an evicted node waits out while its own probe still finds it slow, before it
# joins anyway: a probe can be wrong (its baseline taken in a quiet moment), and once back the
# group's verdict judges the node again, its backoff keeping that from becoming a loop
MAX_COOLDOWNS = 3


def rejoin_now(policy: EvictionPolicy, *, probe_ratio: float | None, cooldowns: int) -> bool:
    """After its ``cooldowns``-th cool-down, whether an evicted node joins again: when its
    probe (``processes/node_probe.py``: now over its own start) is below the threshold it
    was evicted at, when there is no probe figure, or after ``MAX_COOLDOWNS``."""
    if probe_ratio is None or cooldowns >= MAX_COOLDOWNS:
        return True
    return probe_ratio < policy.threshold


def projected_gain_s(node: SlowNode, reform_s: float) -> float:
    """Seconds the group saves over the work left if the node leaves and later comes back."""
    steps = node.steps_left if node.steps_left is not None else DEFAULT_HORIZON_STEPS
    now = node.median_step_s * node.slowdown
    without = node.median_step_s * node.num_nodes / (node.num_nodes - 1)
    return steps * (now - without) - 2 * reform_s


def backoff_left_s(policy: EvictionPolicy, history: EvictionHistory, now: float) -> float:
    if history.last_evicted_at is None:
        return 0.0
    wait = policy.backoff_s * 2 ** (history.evictions - 1)
    return max(0.0, history.last_evicted_at + wait - now)


def decide(
    policy: EvictionPolicy,
    history: EvictionHistory,
    node: SlowNode,
    *,
    reform_s: float,
    now: float,
) -> EvictionDecision:
    """Leave the group now, or why not (``reason`` names the first rule that holds it)."""
    if node.num_nodes - 1 < policy.min_nodes:
        return EvictionDecision(
            False, f"the group would fall below --min-nodes {policy.min_nodes}", 0.0
        )
    if node.num_nodes < 2 or node.median_step_s <= 0:
        return EvictionDecision(False, "nothing to compare with", 0.0)
    gain = round(projected_gain_s(node, reform_s), 3)
    if node.slowdown < policy.threshold:
        return EvictionDecision(False, f"slowdown {node.slowdown} < {policy.threshold}", gain)
    if not node.slowest:
        return EvictionDecision(False, "another node is slower: it goes first", gain)
    wait = backoff_left_s(policy, history, now)
    if wait > 0:
        return EvictionDecision(False, f"evicted {history.evictions}x: backoff {wait:.0f}s", gain)
    if gain <= 0:
        return EvictionDecision(False, "the re-forms cost more than the work left gains", gain)
    reason = f"slowdown {node.slowdown} >= {policy.threshold}: the group gains {gain:.0f}s"
    return EvictionDecision(True, reason, gain, rejoin_after_s=policy.cooldown_s)
