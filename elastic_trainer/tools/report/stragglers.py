"""Stragglers in a run's events: which ranks were slow, and the time the group waited for
its slowest rank. Pure: events in, figures out.

The waiting time is the sessions' own (``straggler.summary``: rank 0 sums, each step, the
slowest rank's compute less the median, over the steps it compared); a session that never
closed (killed, a restart) wrote none, and its episodes' ``straggler.recovered`` waited_s
stand in for it where no session closed (a lower bound: the wait outside the episodes is
not in them).
"""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]


def straggler_episodes(events: list[Event]) -> list[dict[str, Any]]:
    """Each ``straggler.detected``: node, rank, slowdown, since_step, and whether it ended."""
    recovered = {
        (e.get("node"), e.get("rank"), e.get("since_step"))
        for e in events
        if e.get("event") == "straggler.recovered"
    }
    return [
        {
            "node": e.get("node"),
            "rank": e.get("rank"),
            "slowdown": e.get("slowdown"),
            "since_step": e.get("since_step"),
            "recovered": (e.get("node"), e.get("rank"), e.get("since_step")) in recovered,
        }
        for e in events
        if e.get("event") == "straggler.detected"
    ]


def straggler_wait_s(events: list[Event]) -> float | None:
    """Seconds the group waited for its slowest rank (None: no session measured it)."""
    summaries = {
        e.get("attempt"): float(e["waited_s"])
        for e in events
        if e.get("event") == "straggler.summary" and e.get("waited_s") is not None
    }
    if summaries:  # a closed session's summary holds its episodes' waits
        return round(sum(summaries.values()), 3)
    episodes = [
        float(e["waited_s"])
        for e in events
        if e.get("event") == "straggler.recovered" and e.get("waited_s") is not None
    ]
    return round(sum(episodes), 3) if episodes else None


def describe_stragglers(episodes: list[dict[str, Any]], wait_s: float | None) -> str:
    """The report's line: the slow ranks by node, and the time waited for the slowest."""
    named = ", ".join(
        f"{e['node']} rank {e['rank']} x{e['slowdown']} from step {e['since_step']}"
        + ("" if e["recovered"] else " (to the end)")
        for e in episodes
    )
    wait = "n/a" if wait_s is None else f"{wait_s:.1f} s"
    return (
        f"{len(episodes)}"
        + (f" ({named})" if named else "")
        + f"; waited for the slowest rank {wait}"
    )
