"""Values the store hands back: SnapshotInfo, VerifyResult, LoadedSnapshot, SaveHandle."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Any

from snapshots.format.manifest import Manifest


@dataclass(frozen=True, kw_only=True)
class SnapshotInfo:
    step: int
    epoch: int
    world_size: int
    url: str  # the snapshot's own folder, credentials redacted
    created_at: str  # ISO-8601 UTC
    bytes: int  # data bytes (manifest excluded)
    metadata: dict[str, Any] = field(default_factory=dict)
    torch_version: str = ""
    format_version: int = 0

    @classmethod
    def from_manifest(cls, manifest: Manifest, url: str) -> SnapshotInfo:
        return cls(
            step=manifest.step,
            epoch=manifest.epoch,
            world_size=manifest.world_size,
            url=url,
            created_at=manifest.created_at,
            bytes=manifest.total_bytes,
            metadata=dict(manifest.metadata),
            torch_version=manifest.torch_version,
            format_version=manifest.format_version,
        )


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    step: int
    ok: bool
    problems: list[str]
    info: SnapshotInfo | None = None


@dataclass(frozen=True, kw_only=True)
class LoadedSnapshot:
    info: SnapshotInfo
    state: dict[str, Any]  # entry name -> the saved value (state_dict for Statefuls)
    rank_state: Any = None  # load(rank=r): that rank's entry, None if r >= saved world size
    per_rank: list[Any] | None = None  # load(rank=None): every rank's entry, by rank


class SaveHandle:
    """The outcome of one save() call. ``result()`` raises SnapshotSaveError on failure and
    returns None when the save was skipped (another save was in flight; see ``skipped``)."""

    def __init__(
        self,
        step: int,
        future: cf.Future[SnapshotInfo] | None = None,
        *,
        skipped_reason: str | None = None,
    ) -> None:
        self.step = step
        self.skipped_reason = skipped_reason
        self._future = future
        self.error_reported = False

    @property
    def skipped(self) -> bool:
        return self.skipped_reason is not None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: float | None = None) -> SnapshotInfo | None:
        if self._future is None:
            return None
        self.error_reported = True
        return self._future.result(timeout)

    def exception(self) -> BaseException | None:
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "running")
        return f"SaveHandle(step={self.step}, {state})"
