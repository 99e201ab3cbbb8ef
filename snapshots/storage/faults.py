"""Fault injection: the points where a crash is worth testing, and the one seam to crash there.

Product code marks each point with ``hit(point, ...)``. Nothing happens unless a test has put
an injector into this process with ``inject`` (the models: torchsnapshot's faulty storage
plugin, torchft's ``FailureInjector``); without one, ``hit`` is one comparison.

Points: ``before_data``, ``mid_file``, ``before_manifest``, ``mid_manifest``,
``after_manifest`` (a snapshot's save path), ``mid_memory_write`` (a rank copying its part of
an in-memory copy; ``step``, and ``torn``: what a kill halfway leaves) and ``mid_mirror_send``
(a sharded copy's header sent to the mirror, its bytes not; ``step``).

``KillAt`` is the injector the crash tests use: SIGKILL this process the n-th time a point
is reached (of a given step, if one is named). A forked child inherits the parent's injector;
a process started afresh (the writer process, a worker) has none until its own code injects
one.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SAVE_POINTS = ("before_data", "mid_file", "before_manifest", "mid_manifest", "after_manifest")
POINTS = (*SAVE_POINTS, "mid_memory_write", "mid_mirror_send")

Injector = Callable[..., None]  # (point, **where)
_injector: Injector | None = None


def inject(injector: Injector | None) -> None:
    """Install ``injector`` for this process (None removes it)."""
    global _injector
    _injector = injector


def injected() -> bool:
    return _injector is not None


def hit(point: str, **where: Any) -> None:
    if _injector is not None:
        _injector(point, **where)


@dataclass
class KillAt:
    """SIGKILL this process the ``nth`` time (1-based) ``point`` is reached, counting only
    reaches of ``step`` when one is given."""

    point: str
    nth: int = 1
    step: int | None = None
    reached: int = 0

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}: one of {', '.join(POINTS)}")

    @classmethod
    def parse(cls, spec: str) -> KillAt:
        """``point[:n]``, as the crash tests write their cases."""
        point, _, nth = spec.partition(":")
        return cls(point, int(nth or 1))

    def __call__(
        self, point: str, *, step: int | None = None, torn: Callable[[], Any] | None = None
    ) -> None:
        if point != self.point or (self.step is not None and step != self.step):
            return
        self.reached += 1
        if self.reached == self.nth:
            if torn is not None:
                torn()
            os.kill(os.getpid(), signal.SIGKILL)
