"""The read side of ``SnapshotStore``: list, verify, load, and retention's deletions.

Thin: each method is one call into ``catalog`` (reading and verifying) or ``housekeeping``
(carrying out ``retention``). Kept apart from the save side, whose writer thread, deadlines
and outage handling are what ``store.py`` is about; ``SnapshotStore`` inherits this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from snapshots.info import LoadedSnapshot, SnapshotInfo, VerifyResult
from snapshots.read import catalog
from snapshots.storage import RetryingStorage
from snapshots.write import housekeeping, writer


class StoreReading:
    # set up by SnapshotStore.__init__
    _catalog: catalog.Catalog
    _storage: RetryingStorage
    _writer: writer.BackgroundWriter
    keep_every: int | None
    stray_grace_s: float

    def _ensure_owner(self) -> None:  # SnapshotStore checks the folder's owner
        pass

    # ------------------------------------------------------------- reading
    def _step_url(self, step: int) -> str:
        return self._catalog.step_url(step)

    def committed_steps(self) -> list[int]:
        """Steps with a manifest (readable or not), oldest first. Nothing is verified."""
        return sorted(self._catalog.committed()[0])

    def list(self) -> list[SnapshotInfo]:
        """Committed snapshots whose manifest parses, oldest first (files are not verified).

        Returns:
            One ``SnapshotInfo`` per snapshot (step, epoch, size, when, metadata).
        """
        return self._catalog.list()

    def verify(self, step: int) -> VerifyResult:
        """Check a snapshot's manifest, file sizes and checksums. Deserialises nothing.

        Args:
            step: The snapshot's step.

        Returns:
            ``ok`` and, when not, every ``problems`` found (never raises for damage).
        """
        return self._catalog.verify(step)

    def latest(self) -> SnapshotInfo | None:
        """The newest committed and verified snapshot; None only when nothing is committed.

        Returns:
            Its ``SnapshotInfo``, skipping damaged ones (``snapshot.corrupt``); None when
            nothing is committed.

        Raises:
            NoValidSnapshotError: Snapshots are committed but none passes verification.
        """
        return self._catalog.latest()

    def load(
        self,
        step: int | None = None,
        *,
        into: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> LoadedSnapshot:
        """Load a verified snapshot (the newest valid one when ``step`` is None).

        ``into`` restores Stateful objects in place (RNG states last). ``rank`` loads only that
        rank's per-rank entry into ``rank_state``; without it ``per_rank`` holds all of them.
        Sharded snapshots: the FSDP2 entries of ``into`` get only their local shards read
        (at any world size); every other tensor is read whole.

        Args:
            step: Default None: the newest snapshot that verifies, falling back past damaged
                ones (``snapshot.corrupt``). A step: exactly that snapshot.
            into: Default None. Name -> object with ``load_state_dict`` (or a tensor dict),
                restored in place from the entry of that name.
            rank: Default None: every rank's per-rank state in ``per_rank``. A rank: only
                that one's, in ``rank_state``.

        Returns:
            The snapshot's ``info`` and its ``state`` (tensors loaded with
            ``weights_only=True`` after their checksums matched).

        Raises:
            SnapshotNotFoundError: Nothing is committed, or not that ``step``.
            NoValidSnapshotError: Snapshots are committed but none passes verification.
            SnapshotCorruptError: That ``step`` is damaged.
        """
        from snapshots.sharded.state import templates_for

        templates = templates_for(into)
        if step is None:
            loaded = self._catalog.load_newest(rank, templates)
        else:
            loaded = self._catalog.load_step(step, rank, templates)
        if into is not None:
            restore_into(into, loaded.state, step=loaded.info.step)
        return loaded

    # ------------------------------------------------------------- retention
    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed snapshots (and every keep_every-th),
        never the newest one that actually loads (deep verification: checksums are not
        enough when a file passes them but ``weights_only`` refuses it) nor anything newer.

        Args:
            keep: The newest committed snapshots to keep (>= 1).

        Returns:
            The steps deleted.

        Raises:
            SnapshotOwnerError: Another run of the job took the folder over.
        """
        latest = self._catalog.latest(deep=True)
        return self._prune(keep, latest.step if latest is not None else None)

    def _prune(self, keep: int, newest_verified: int | None) -> list[int]:
        self._ensure_owner()  # never delete in a folder another run took over
        return housekeeping.prune(
            self._storage,
            self._catalog,
            keep=keep,
            keep_every=self.keep_every,
            newest_verified=newest_verified,
            in_flight=self._writer.in_flight(),
            stray_grace_s=self.stray_grace_s,
        )


def restore_into(into: Mapping[str, Any], state: Mapping[str, Any], *, step: int) -> None:
    """load_state_dict for every Stateful in ``into`` (FSDP2 models and optimizers through
    ``set_state_dict``); RNG states last (loading may draw)."""
    from snapshots.sharded.state import restore

    restore(into, state, step=step)
