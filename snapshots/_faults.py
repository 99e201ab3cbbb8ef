"""Deterministic crash injection for the crash-consistency tests (a no-op in production).

``SNAPSHOTS_KILL_AT=<point>[:<n>]`` SIGKILLs this process the n-th time (1-based, default 1)
the save path reaches ``point``: before_data, mid_file, before_manifest, mid_manifest,
after_manifest. Reading one environment variable per point costs nothing next to I/O.
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "SNAPSHOTS_KILL_AT"
POINTS = ("before_data", "mid_file", "before_manifest", "mid_manifest", "after_manifest")
_hits: dict[str, int] = {}


def hit(point: str) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name != point:
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
