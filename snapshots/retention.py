"""Pure: which snapshots and partial writes to delete.

Rules: keep the newest ``keep`` committed snapshots, every ``keep_every``-th step forever, and
always the newest verified one; delete only snapshots older than a verified one (a newer but
unverified snapshot never justifies deleting anything). Partial writes (a step folder with no
manifest) are orphans once a newer snapshot committed, unless this process is writing them.

Strays are files inside a *committed* step folder that its manifest does not list: data of a
writer that lost the race for the step's exclusive manifest create and crashed before
cleaning up, or a temp file of a writer killed mid-write. A committed manifest is never
rewritten, so a stray can never become part of the snapshot; it is swept once it is older
than a grace period (a losing writer still running then fails on its own manifest create and
removes its files itself). Only names this package writes are ever swept.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from snapshots.format import layout


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


def may_hold_strays(names: Iterable[str]) -> bool:
    """From a listing alone: could the folder hold strays? One save's files share one token,
    so a single token and no temp file means nothing to sweep (no manifest read needed)."""
    tokens = set()
    for name in names:
        if layout.is_temp_name(name):
            return True
        token = layout.token_of(name)
        if token is not None:
            tokens.add(token)
    return len(tokens) > 1


def strays_to_sweep(
    files: Iterable[tuple[str, float | None]],
    *,
    listed: Collection[str],
    now: float,
    grace_s: float,
) -> list[str]:
    """Names in a committed folder (with their mtime, None if unknown) that its manifest does
    not list, that this package writes (data or temp files), older than ``grace_s``."""
    return sorted(
        name
        for name, mtime in files
        if name not in listed
        and (layout.is_temp_name(name) or layout.token_of(name) is not None)
        and (mtime is None or now - mtime >= grace_s)
    )
