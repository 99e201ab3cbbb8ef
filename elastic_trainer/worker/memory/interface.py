"""What the session asks of an in-memory tier, whichever it runs (``tier`` for replicated
state, ``shards`` for FSDP2 shards): one interface, so ``TrainingSession`` treats them alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from elastic_trainer.worker.memory.plan import RestorePlan
from elastic_trainer.worker.memory.tier import MemoryRestored


class InMemoryTier(Protocol):
    every: int

    def due(self, step: int) -> bool:
        """This step gets a copy (every ``every`` steps)."""
        ...

    def save(self, step: int, state: Mapping[str, Any], per_rank: Mapping[str, Any]) -> None:
        """This rank's part of the step's copy; a failure is reported, never raised."""
        ...

    def holds(self, step: int) -> bool:
        """Local: this rank's part of ``step``'s copy is committed."""
        ...

    def restore(
        self,
        into: Mapping[str, Any],
        rank_into: Mapping[str, Any],
        storage_newest: Callable[[], int | None] | None,
    ) -> tuple[RestorePlan, MemoryRestored | None]:
        """Collective: restore from memory when every rank can, else say why not.
        ``storage_newest``: the newest storage snapshot's step (None: no storage)."""
        ...

    def after_restore(self, step: int | None) -> None:
        """Tidy the copies a restore made stale."""
        ...

    def flush(self) -> None:
        """Local: wait for the copy being written (no collective: safe after an error)."""
        ...

    def close(self) -> None:
        """Collective at the session's end: flush, and end what runs between ranks."""
        ...
