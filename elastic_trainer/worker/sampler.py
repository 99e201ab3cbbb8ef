"""ElasticSampler: a resumable, world-size independent drop-in for DistributedSampler.

Guarantees (proved by tests/unit/worker/test_sampler_properties.py):

* The epoch order is one permutation of ``range(len(dataset))`` derived from (seed, epoch)
  only; the world size never changes it.
* Progress is a global cursor into that permutation, advanced only by *completed* optimizer
  steps (the session calls :meth:`ElasticSampler.complete_step`), never by DataLoader
  prefetch. ``state_dict()`` saved at world size W loads at any W'; the remainder of the
  epoch is split over the W' ranks. Every sample of an epoch is trained exactly once, with no
  padding duplicates.
* With ``global_batch_size=B`` every optimizer step trains the same B positions of the
  permutation whatever the world size; rank r of W takes the step's positions r, r+W, ...
  (strided). Only the last step of an epoch may be shorter (``drop_last=True`` drops the
  ``len(dataset) % B`` tail instead). When that last step has fewer samples than ranks, the
  ranks left without a sample read one padding sample that the session weighs 0 (a
  zero-weight step: every rank still joins DDP's all-reduce; the audit log omits it).
* Without ``global_batch_size`` it splits the remainder like DistributedSampler, strided,
  but never pads: shares differ by at most one sample, so at the end of an epoch some ranks
  may run one batch fewer (with DDP use ``global_batch_size`` or DDP's ``join()``).
  ``drop_last=True`` trims the remainder to a multiple of the world size instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from elastic_trainer.errors import ConfigError, SamplerStateError
from elastic_trainer.worker import plan as P

STATE_VERSION = 1
# Fields a saved state must agree on with the running sampler.
_IDENTITY_FIELDS = ("num_samples", "seed", "shuffle", "drop_last", "global_batch_size")


class ElasticSampler(Sampler[int]):
    """DistributedSampler's constructor and ``set_epoch``, plus a resumable global cursor.

    ``num_replicas``/``rank`` default to the initialised process group, resolved lazily (so
    the sampler may be built before the process group), else to a single process.
    ``max_micro_batch_size`` caps what one forward pass takes; the micro-batch size and the
    gradient-accumulation count then follow from the world size (see ``micro_batch_size``).

    Args:
        dataset: Anything with ``len()``; the sampler yields indices into it.
        num_replicas: The world size. Default None: the process group's, read each time it
            is needed (1 without a process group).
        rank: This process's rank. Default None: the process group's (0 without one).
        shuffle: Default True: a random permutation per epoch from (``seed``, epoch);
            False: the dataset's order.
        seed: Default 0. The same on every rank and across restarts: it fixes each epoch's
            order.
        drop_last: Default False. With ``global_batch_size``, drop the epoch's last
            ``len(dataset) % global_batch_size`` positions so every step is full; without,
            trim the remainder to a multiple of the world size.
        global_batch_size: Default None. Samples per optimizer step over all ranks, the same
            at every world size; each rank takes its share (``micro_batch_size``,
            ``accumulation_steps``). None: a DistributedSampler-like split of what remains,
            and ``TrainingSession.step_done`` needs ``num_samples``.
        max_micro_batch_size: Default None: one micro-batch per step. Otherwise the largest
            batch one forward pass may take; a rank's share is split into micro-batches of at
            most this size, trained with gradient accumulation.

    Raises:
        ConfigError: ``drop_last=True`` with a global batch larger than the dataset (every
            epoch would be empty), or a global batch the world size cannot split (not
            divisible by it, or smaller than it).
        SamplerStateError: ``rank`` outside ``[0, num_replicas)``.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        global_batch_size: int | None = None,
        max_micro_batch_size: int | None = None,
    ) -> None:
        self.dataset = dataset
        self._num_replicas = num_replicas
        self._rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.global_batch_size = global_batch_size
        self.max_micro_batch_size = max_micro_batch_size
        self.epoch = 0
        self.cursor = 0
        self._perm: tuple[int, torch.Tensor] | None = None
        self._stream_start = 0  # plain mode: the cursor when the current iteration began
        self._rank_consumed = 0  # plain mode: this rank's samples consumed since then
        self._check_rank()
        if global_batch_size is not None:
            self.batch_plan()  # fail at construction on impossible combinations
            self._check_epoch_not_empty()

    # --- world ------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        """The world size: the constructor's ``num_replicas``, else the process group's, else 1."""
        if self._num_replicas is not None:
            return self._num_replicas
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        """This process's rank: the constructor's ``rank``, else the process group's, else 0."""
        if self._rank is not None:
            return self._rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _check_rank(self) -> None:
        if not 0 <= self.rank < self.num_replicas:
            raise SamplerStateError(
                f"rank {self.rank} is outside [0, {self.num_replicas - 1}] "
                f"(num_replicas={self.num_replicas}); pass a rank below num_replicas"
            )

    def _check_epoch_not_empty(self) -> None:
        if self.drop_last and len(self.dataset) < (self.global_batch_size or 0):
            raise ConfigError(
                f"drop_last=True with global_batch_size={self.global_batch_size} and only "
                f"{len(self.dataset)} samples: every epoch would be empty; use drop_last=False "
                "or a global batch <= the dataset length"
            )

    @property
    def num_samples_total(self) -> int:
        return len(self.dataset)

    def batch_plan(self) -> P.BatchPlan:
        """Per-rank share, micro-batch size and accumulation count at the current world.

        Returns:
            The plan for the current world size (it changes when the world size does).

        Raises:
            SamplerStateError: The sampler has no ``global_batch_size``.
            ConfigError: The world size cannot split the global batch (not divisible by it,
                or smaller than it).
        """
        if self.global_batch_size is None:
            raise SamplerStateError(
                "this ElasticSampler has no global_batch_size: pass global_batch_size=... "
                "to get a batch plan"
            )
        return P.batch_plan(self.global_batch_size, self.num_replicas, self.max_micro_batch_size)

    @property
    def micro_batch_size(self) -> int:
        """The DataLoader ``batch_size`` to use with a global batch (never straddles steps).

        Raises:
            SamplerStateError: The sampler has no ``global_batch_size``.
        """
        return self.batch_plan().micro_batch_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches this rank runs per optimizer step at the current world size."""
        return self.batch_plan().accumulation_steps

    # --- epoch & order ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; moving to another epoch starts it at cursor 0.

        ``TrainingSession.epochs`` calls it; a script without a session calls it before each
        epoch, as with DistributedSampler. The same epoch again keeps the cursor (a resume).

        Args:
            epoch: The epoch to iterate next (its order derives from ``seed`` and it).
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self.cursor = 0
            self._stream_start = 0
            self._rank_consumed = 0

    def permutation(self) -> torch.Tensor:
        """The epoch's order (cached: one randperm per epoch, not per resume position)."""
        if self._perm is None or self._perm[0] != self.epoch:
            order = P.epoch_permutation(
                self.num_samples_total, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle
            )
            self._perm = (self.epoch, order)
        return self._perm[1]

    @property
    def end(self) -> int:
        """Position where this epoch's training stops."""
        if self.global_batch_size is not None:
            return P.epoch_end(self.num_samples_total, self.global_batch_size, self.drop_last)
        start = min(self._stream_start, self.cursor)
        return P.plain_end(self.num_samples_total, start, self.num_replicas, self.drop_last)

    @property
    def epoch_done(self) -> bool:
        """True once the cursor has reached the epoch's end: every sample was trained."""
        return self.cursor >= self.end

    def _positions(self) -> torch.Tensor:
        """Permutation positions this rank reads from the cursor to the epoch end."""
        rank, world, end = self.rank, self.num_replicas, self.end
        if self.global_batch_size is None:
            return _arange(self.cursor + rank, end, world)
        full_end = end - (end - self.cursor) % self.global_batch_size
        # B % W == 0, so the strided shares of consecutive full steps form one arithmetic run.
        full = _arange(self.cursor + rank, full_end, world)
        if full_end == end:
            return full
        tail = _arange(full_end + rank, end, world)
        if len(tail) == 0:
            tail = torch.tensor([full_end])  # zero-weight padding, see the module docstring
        return torch.cat([full, tail])

    def __iter__(self) -> Iterator[int]:
        self._check_rank()
        self._stream_start = self.cursor
        self._rank_consumed = 0
        if self.cursor >= self.end:
            return iter(())
        return _chunked(self.permutation(), self._positions())

    def __len__(self) -> int:
        if self.cursor >= self.end:
            return 0
        if self.global_batch_size is None:
            return P.share_size(self.end - self.cursor, self.rank, self.num_replicas)
        return len(self._positions())

    def steps_until(self, num_epochs: int) -> int | None:
        """Optimizer steps from the cursor to the end of epoch ``num_epochs - 1`` (a global
        batch's count; None without one: the steps' sizes are agreed only as they end)."""
        batch = self.global_batch_size
        if batch is None:
            return None
        this_epoch = -(-max(0, self.end - self.cursor) // batch)
        return this_epoch + max(0, num_epochs - self.epoch - 1) * -(-self.end // batch)

    # --- progress -----------------------------------------------------------------------
    def current_share(self) -> P.StepShare:
        """This rank's part of the step at the cursor (fixed-global-batch mode)."""
        return P.step_share(self.cursor, end=self.end, plan=self.batch_plan(), rank=self.rank)

    def complete_step(
        self, *, local_samples: int | None = None, global_samples: int | None = None
    ) -> list[int]:
        """Advance the cursor past one completed optimizer step; return the dataset indices
        this rank trained in it. With a global batch the plan knows the counts; without one
        the caller gives this rank's sample count and the sum over all ranks.

        ``TrainingSession.step_done`` calls it; a script without a session calls it once per
        optimizer step on every rank.

        Args:
            local_samples: This rank's samples in the step (only without a global batch).
            global_samples: The step's samples summed over all ranks (only without a global
                batch).

        Returns:
            The dataset indices this rank trained in the step (empty for a padding sample).

        Raises:
            SamplerStateError: No global batch and the counts are missing.
        """
        if self.global_batch_size is not None:
            share = self.current_share()
            self.cursor += share.step_size
            return [] if share.padding else self._indices(share.positions)
        if local_samples is None or global_samples is None:
            raise SamplerStateError(
                "ElasticSampler without global_batch_size needs local_samples and "
                "global_samples per completed step; pass them or set global_batch_size"
            )
        first = self._stream_start + self.rank + self.num_replicas * self._rank_consumed
        mine = range(first, first + self.num_replicas * local_samples, self.num_replicas)
        self._rank_consumed += local_samples
        self.cursor = min(self.cursor + global_samples, self.end)
        return self._indices(mine)

    def after_step(self) -> dict[str, Any] | None:
        """The state once the step at the cursor completes, without advancing
        (``complete_step``): with a global batch the plan knows it; None without one (the
        step's sample counts are agreed only at its end)."""
        if self.global_batch_size is None:
            return None
        state = self.state_dict()
        state["cursor"] = self.cursor + self.current_share().step_size
        return state

    def step_indices(self, rank: int) -> list[int]:
        """The dataset indices ``rank`` trains in the step at the cursor (global batch).

        Args:
            rank: Any rank of the current world.

        Returns:
            Those indices; empty where ``rank`` holds only a padding sample.
        """
        share = P.step_share(self.cursor, end=self.end, plan=self.batch_plan(), rank=rank)
        return [] if share.padding else self._indices(share.positions)

    def _indices(self, positions: range) -> list[int]:
        return self.permutation()[positions.start : positions.stop : positions.step].tolist()

    # --- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The resumable state: epoch, cursor and the settings a resume must share.

        Returns:
            A plain dict (ints, bools, None): ``version``, ``epoch``, ``cursor``,
            ``num_samples``, ``seed``, ``shuffle``, ``drop_last``, ``global_batch_size`` and
            the ``world_size`` it was saved at (informational: any world size loads it).
        """
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "num_samples": self.num_samples_total,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "global_batch_size": self.global_batch_size,
            "world_size": self.num_replicas,  # informational: any world size may load it
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved epoch and cursor, at any world size.

        Args:
            state: What ``state_dict`` returned, of this or an older state version.

        Raises:
            SamplerStateError: The state was saved with another dataset length, seed,
                shuffle, ``drop_last`` or global batch (both values are named), is of a newer
                version, lacks a field, or its cursor does not fit the dataset.
        """
        state = migrate_state(state)
        current = self.state_dict()
        for field in _IDENTITY_FIELDS:
            if state[field] != current[field]:
                raise SamplerStateError(
                    f"saved sampler state has {field}={state[field]!r} but this sampler has "
                    f"{field}={current[field]!r}; use the same {field} as the saved run or "
                    "start from a fresh snapshot directory"
                )
        self._check_cursor(int(state["cursor"]))
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._stream_start = self.cursor
        self._rank_consumed = 0

    def _check_cursor(self, cursor: int) -> None:
        batch = self.global_batch_size
        end = P.epoch_end(self.num_samples_total, batch, self.drop_last)
        misaligned = batch is not None and cursor % batch and cursor != end
        if not 0 <= cursor <= self.num_samples_total or misaligned:
            raise SamplerStateError(
                f"saved sampler cursor {cursor} is invalid for {self.num_samples_total} "
                f"samples and global_batch_size={batch}; the state is corrupt"
            )


def _chunked(perm: torch.Tensor, positions: torch.Tensor, chunk: int = 8192) -> Iterator[int]:
    # Lazily, so the first batch after a resume costs one chunk, not the rest of the epoch.
    for start in range(0, len(positions), chunk):
        yield from perm[positions[start : start + chunk]].tolist()


def _arange(start: int, stop: int, step: int) -> torch.Tensor:
    # torch.arange rejects start > stop; a rank past the end simply has nothing.
    return torch.arange(start, max(start, stop), step, dtype=torch.int64)


def migrate_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Bring a saved state of any known version to the current one.

    Version 1 is the first format; a later version adds a ``_from_v<N>`` step here, so a
    state saved by any earlier release keeps loading.
    """
    version = state.get("version")
    if not isinstance(version, int) or not 1 <= version <= STATE_VERSION:
        raise SamplerStateError(
            f"sampler state version {version!r} is not one this release reads "
            f"(1..{STATE_VERSION}); upgrade elastic-train to load it"
        )
    missing = {"epoch", "cursor", *_IDENTITY_FIELDS} - set(state)
    if missing:
        raise SamplerStateError(
            f"sampler state (version {version}) lacks {sorted(missing)}; the state is corrupt"
        )
    return dict(state)
