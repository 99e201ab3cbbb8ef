"""Pure: which snapshots and partial writes to delete.

Rules: keep the newest ``keep`` committed snapshots, every ``keep_every``-th step forever, and
always the newest verified one; delete only snapshots older than a verified one (a newer but
unverified snapshot never justifies deleting anything). Partial writes (a step folder with no
manifest) are orphans once a newer snapshot committed, unless this process is writing them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


def steps_to_prune(
    committed: Iterable[int],
    *,
    newest_verified: int | None,
    keep: int,
    keep_every: int | None = None,
) -> list[int]:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    if newest_verified is None:
        return []  # nothing proven good: deleting anything could delete the last good one
    steps = sorted(set(committed), reverse=True)
    kept = set(steps[:keep]) | {newest_verified}
    if keep_every:
        kept |= {s for s in steps if s % keep_every == 0}
    return sorted(s for s in steps if s not in kept and s < newest_verified)


def orphans_to_clean(
    partial: Iterable[int],
    *,
    newest_committed: int | None,
    in_flight: Collection[int],
) -> list[int]:
    """Step folders without a manifest, older than the newest committed one, not being written."""
    if newest_committed is None:
        return []
    return sorted(s for s in set(partial) if s < newest_committed and s not in in_flight)
