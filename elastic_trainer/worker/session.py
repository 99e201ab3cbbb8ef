"""TrainingSession: what a training script adds to become restartable and elastic.

Per completed optimizer step (``step_done``): advance the sampler's global cursor, append to
the audit log, rewrite the progress file, agree on a stop with one tiny all-reduce, and save a
snapshot every N steps (asynchronously). At start it restores the newest verified snapshot.
See README "Make an existing torchrun script fault tolerant".
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist

from elastic_trainer.contract import protocol
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ConfigError, SamplerStateError
from elastic_trainer.worker import distributed as D
from elastic_trainer.worker.audit import AuditLog, AuditRecord
from elastic_trainer.worker.context import WorkerContext
from elastic_trainer.worker.handoff import await_handoff, say_aware, say_handed_off
from elastic_trainer.worker.interval import Interval
from elastic_trainer.worker.memory.shards import ShardedMemoryTier as ShardedTier
from elastic_trainer.worker.memory.step_mark import SETTLE_S
from elastic_trainer.worker.memory.tier import MemoryTier
from elastic_trainer.worker.progress import (
    RESTART_STOPS,
    STOP_MAX_STEPS,
    STOP_PREEMPTED,
    STOP_RESTARTING,
    STOP_VOTE_PREEMPTED,
    EventForwarder,
    MetricsReporter,
    ProgressFile,
    StopSignals,
    figures_of,
    peer_stop_reason,
    stop_exit_code,
    stop_vote,
)
from elastic_trainer.worker.sampler import ElasticSampler
from elastic_trainer.worker.snapshotting import (
    open_failure_copy,
    open_memory_tier,
    open_snapshots,
    opens_before_handoff,
    restore_state,
)
from elastic_trainer.worker.straggler_watch import StragglerWatch
from snapshots import RNGState

SAMPLER_KEY = "elastic_sampler"
SESSION_KEY = "elastic_session"


class TrainingSession:
    """Restores, counts steps, snapshots, publishes progress and coordinates stops.

    ``state`` maps names to Statefuls (model, optimizer, scheduler, scaler...) saved by rank 0
    and restored on every rank. Arguments left as None come from the environment the
    supervisor sets (``WorkerContext``); the operator's flags win over ``snapshot_every`` and
    ``snapshot_keep`` given here (``protocol.WorkerSettings``).

    Creating it initialises the worker (``init_worker``) and restores the newest verified
    snapshot, from node memory or storage, into ``state`` and ``sampler`` in place. Every
    setting below that is also an operator flag takes the flag's value when the flag is
    given (``session.setting_overridden`` says so where they differ), this keyword's
    otherwise, and the default where neither is. docs/api.md explains each keyword.

    Args:
        state: Name -> object with ``state_dict()``/``load_state_dict()``: model, optimizer,
            LR scheduler, GradScaler, your own Statefuls. Replicated state is saved by rank 0,
            FSDP2-sharded state by every rank; it is restored on every rank.
            ``elastic_sampler`` and ``elastic_session`` are reserved names.
        sampler: Default None. An ``ElasticSampler`` whose cursor is saved and restored with
            the state (exactly-once data at any world size); ``epochs()``, ``step_ready`` and
            ``scale_loss`` use its global batch. None: the script orders its data itself.
        context: Default None: ``init_worker()`` reads it from the environment.
        snapshot_dir: Default None (``--snapshot-dir`` wins). A path or fsspec URL
            (``s3://...``) for storage snapshots; None without the flag: no storage
            snapshots, only the copies in node memory.
        snapshot_every: Default None: 100 (``--snapshot-every`` wins). Optimizer steps
            between periodic storage snapshots, or ``"auto"`` (from their measured cost and
            the failure rate).
        snapshot_keep: Default None: 3 (``--snapshot-keep`` wins). Newest committed
            snapshots kept. ``keep`` is its former name, still accepted (it warns once).
        memory_snapshot_every: Default None (``--memory-snapshot-every`` wins): no periodic
            copies for replicated state (it is copied into node memory just in time, when
            the group ends), ``"auto"`` for sharded state. Steps between periodic copies of
            the state into node memory; 0: none.
        audit_dir: Default None. A folder for the exactly-once audit log (which samples each
            step trained; ``python -m elastic_trainer.worker.audit`` checks it).
        max_steps: Default None. Stop (``should_stop`` on every rank) once the run has
            completed this many optimizer steps, restored ones included.
        exit_on_stop: Default True: after a coordinated stop ``finish()`` ends the process
            with the exit code the supervisor expects; False: it returns that code.
        configure_logs: Default True: set up elastic-train's logging in this process (see
            ``init_worker``).

    Raises:
        ConfigError: A reserved state name, or a setting out of range (exit 2: the
            supervisor ends the job with that line).
        SamplerStateError: The snapshot's sampler state does not fit ``sampler`` (another
            dataset length, seed, shuffle, drop_last or global batch), or the snapshot has
            none while a sampler is given.
        EnvironmentProblem: The launcher's environment is partial or inconsistent.
    """

    # seconds between two train.progress events of log_metrics (the built-in job's default)
    METRICS_EVERY_S = 10.0

    def __init__(
        self,
        state: Mapping[str, Any],
        sampler: ElasticSampler | None = None,
        *,
        context: WorkerContext | None = None,
        snapshot_dir: str | None = None,
        snapshot_every: int | None = None,
        snapshot_keep: int | None = None,
        keep: int | None = None,
        memory_snapshot_every: int | None = None,
        audit_dir: str | None = None,
        max_steps: int | None = None,
        exit_on_stop: bool = True,
        configure_logs: bool = True,
    ) -> None:
        _check_keys(state)
        self.context = D.init_worker(context, configure_logs=configure_logs)
        self.state = dict(state)
        # a node joining, the previous workers still train meanwhile (``worker.handoff``): a
        # replicated state's tier opens now (it only names and checks the node's folder)
        memory_every = self._setting("memory_snapshot_every", memory_snapshot_every)
        early = opens_before_handoff(self.state)
        memory_dir = self.context.settings.memory_dir
        self._memory = open_memory_tier(memory_dir, memory_every, self.state) if early else None
        # the group's run token, agreed while any previous workers still train (a node joins),
        # one collective fewer in the pause: it is later than their own token, which is all
        # the snapshot folder's ownership and the audit's "newest attempt wins" compare
        self.attempt = D.all_reduce_ints([time.time_ns()], op=dist.ReduceOp.MAX)[0]
        # started while the previous workers still train (a node joins): they stop first
        await_handoff(self.context.control_dir, self.context.local_rank)
        say_aware(self.context.control_dir, self.context.local_rank)
        self.sampler = sampler
        self.max_steps = max_steps
        self._num_epochs: int | None = None  # the run's, once ``epochs`` is iterated
        self.exit_on_stop = exit_on_stop
        self._interval = Interval.of(
            self._setting("snapshot_every", snapshot_every), self.context.settings.mtbf_s
        )
        self._last_periodic = 0  # the step of the last periodic storage snapshot
        self._save_cost_s = 0.0  # its stall on this rank, until the group has averaged it
        self._step_ended: float | None = None  # when the previous step_done ran
        self.step = 0  # completed optimizer steps of the whole run
        self.restored_step: int | None = None
        self.stop_reason: str | None = None
        self._stopped_for_restart = False  # see _stop
        self._micro = 0  # micro-batches of the step in progress seen by accumulate()
        self._held_at: int | None = None  # the step the stop left in memory for the next group
        url = self._setting("snapshot_dir", snapshot_dir)
        keep = self._setting("snapshot_keep", _snapshot_keep(snapshot_keep, keep))
        self._snapshots = open_snapshots(url, keep, self.context, self.attempt) if url else None
        if not early:  # sharded: after the previous workers stopped, as before
            self._memory = open_memory_tier(memory_dir, memory_every, self.state)
        # the sharded tier's periodic copies within a budget of the step time (worker.interval)
        sharded_auto = memory_every in (None, "auto") and isinstance(self._memory, ShardedTier)
        self._memory_interval = Interval.memory() if sharded_auto else None
        self._memory_cost_s = 0.0  # the last copy's stall on this rank
        self._progress = ProgressFile(self.context.progress_path)
        # snapshot/progress events for the supervisor's metrics (protocol.events_file)
        self._forwarder = EventForwarder.install(self.context.control_dir, self.context.local_rank)
        self._reporter = MetricsReporter(every_s=self.METRICS_EVERY_S)
        # compute vs waiting per rank, compared across the group (docs/stragglers.md)
        self._stragglers = StragglerWatch(self.context.device, self.attempt)
        self._signals = StopSignals()  # SIGTERM/SIGUSR1 to the worker = this node stops
        self._signals.install()
        self._audit = self._open_audit(audit_dir)
        self._restore()
        self._last_periodic = self.step
        self._on_failure = open_failure_copy(
            self._memory, self.state, self._consistent_state, self.context
        )
        # the tier whose slot for that copy is made ready at the first counted step (``reserve``)
        memory, jit = self._memory, self._on_failure is not None
        self._reserve_in = memory if isinstance(memory, MemoryTier) and jit else None
        self._started(url)

    # --- start ----------------------------------------------------------------------------
    def _setting(self, name: str, script_value: Any) -> Any:
        """The operator's flag, else the script's keyword, else the default (see
        ``protocol.WorkerSettings`` for why the operator wins)."""
        operator_value = getattr(self.context.settings, name)
        if operator_value is None:
            if script_value is not None:
                return script_value
            return protocol.setting_of(protocol.WorkerSettings, name).fallback
        if script_value is not None and script_value != operator_value and D.rank() == 0:
            emit(
                "session.setting_overridden",
                level="warning",
                setting=name,
                script_value=script_value,
                operator_value=operator_value,
            )
        return operator_value

    def _final_deadline(self) -> float:
        """Seconds the final snapshot of a stop may take: what is left of the grace period
        before the supervisor kills (it keeps a margin), counted from the stop file."""
        grace = self.context.settings.grace_period_s
        budget = grace - min(2.0, grace * 0.2)
        stop_file = self.context.stop_file
        with contextlib.suppress(OSError):
            if stop_file is not None:
                budget -= max(0.0, time.time() - os.path.getmtime(stop_file))
        return max(1.0, budget)

    def _open_audit(self, directory: str | None) -> AuditLog | None:
        if directory is None:
            return None
        return AuditLog(
            directory,
            rank=D.rank(),
            restart_count=self.context.restart_count,
            attempt=self.attempt,
        )

    def _restore(self) -> None:
        """The newest state any node holds in memory (``worker.memory.tier``), else the
        newest loadable storage snapshot; snapshot.restored says which and why."""
        restored = restore_state(self._memory, self._snapshots, self.state)
        if self._memory is not None:
            self._memory.after_restore(None if restored is None else restored[0])
        if restored is None:
            return
        step, state = restored
        if self.sampler is not None:
            if SAMPLER_KEY not in state:
                raise SamplerStateError(
                    f"snapshot of step {step} has no sampler state; resume it "
                    "without a sampler or start from a fresh snapshot directory"
                )
            self.sampler.load_state_dict(state[SAMPLER_KEY])
        self.step = int(state[SESSION_KEY]["step"])
        self.restored_step = self.step  # snapshot.restored is emitted by the snapshotter
        if self.max_steps is not None and self.step >= self.max_steps:
            self.stop_reason = STOP_MAX_STEPS  # already there: train nothing more

    def _started(self, url: str | None) -> None:
        self._progress.write(step=self.step, epoch=self.epoch, restored_step=self.restored_step)
        if D.rank() == 0:
            emit(
                "session.started",
                world_size=D.world_size(),
                backend=self.context.backend,
                snapshot_dir=url,
            )

    # --- properties -----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The sampler's current epoch (0 without a sampler)."""
        return self.sampler.epoch if self.sampler is not None else 0

    @property
    def should_stop(self) -> bool:
        """True on every rank at the same step once a stop is agreed (or max_steps reached)."""
        return self.stop_reason is not None

    @property
    def loss_scale(self) -> float:
        """Factor for a *sum*-reduced loss so the update is the mean over the global batch
        whatever the world size (0 on a rank that only holds a padding sample)."""
        if self.sampler is None or self.sampler.global_batch_size is None:
            return 1.0
        return self.sampler.current_share().loss_scale

    def scale_loss(self, loss: Any, batch_size: int) -> Any:
        """Scale a *mean*-reduced micro-batch loss of ``batch_size`` samples (see loss_scale).

        Without a global batch (plain mode) the loss is returned as is, like DistributedSampler.

        Args:
            loss: The micro-batch's loss, a mean over its samples (``F.cross_entropy``'s
                default).
            batch_size: The samples in this micro-batch (``len(x)``).

        Returns:
            The loss to call ``backward()`` on: the step's gradient is then the mean over the
            global batch at any world size and micro-batching.
        """
        if self.sampler is None or self.sampler.global_batch_size is None:
            return loss
        return loss * (batch_size * self.loss_scale)

    @property
    def micro_batches_per_step(self) -> int:
        """DataLoader batches this rank reads for the current step (1 without a global batch)."""
        if self.sampler is None or self.sampler.global_batch_size is None:
            return 1
        return self.sampler.current_share().micro_batches

    @property
    def step_ready(self) -> bool:
        """After ``accumulate``: the current step's last micro-batch has been processed."""
        return self._micro >= self.micro_batches_per_step

    # --- the loop -------------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yield the epochs still to train, from the restored one; stop when should_stop.

        Args:
            num_epochs: The epochs the whole run trains (not those left).

        Yields:
            Each epoch number still to train, the sampler already set to it.

        Raises:
            ConfigError: The session has no sampler.
        """
        if self.sampler is None:
            raise ConfigError("TrainingSession.epochs needs a sampler: pass sampler=...")
        self._num_epochs = num_epochs
        epoch = self.sampler.epoch + (1 if self.sampler.epoch_done else 0)
        while epoch < num_epochs and not self.should_stop:
            self.sampler.set_epoch(epoch)
            set_dataset_epoch = getattr(self.sampler.dataset, "set_epoch", None)
            if callable(set_dataset_epoch):
                set_dataset_epoch(epoch)
            yield epoch
            if not self.sampler.epoch_done:
                break  # the loop left the epoch early (should_stop, or the caller broke out)
            epoch += 1

    @contextlib.contextmanager
    def accumulate(self, model: Any) -> Iterator[None]:
        """Wrap one micro-batch's forward/backward: DDP ``no_sync`` on all but the last one
        of the step, so gradients are all-reduced once per optimizer step."""
        self._stragglers.watch(model)
        last = self._micro + 1 >= self.micro_batches_per_step
        no_sync = getattr(model, "no_sync", None)
        context = no_sync() if (callable(no_sync) and not last) else contextlib.nullcontext()
        with context:
            yield
        self._micro += 1

    def watch(self, model: Any) -> bool:
        """Time ``model``'s waits in collectives (DDP's gradient all-reduce, FSDP2's
        all-gathers) so that a slow rank is told by its compute, not by the wall time every
        rank shares; ``accumulate`` does it itself. Call before the first forward. False:
        no probe fits, only the session's own all-reduce is timed (docs/stragglers.md)."""
        return self._stragglers.watch(model)

    def step_done(self, num_samples: int | None = None) -> None:
        """Call after every ``optimizer.step()``. ``num_samples`` (this rank's samples of the
        step) is needed only without a global batch.

        Collective: every rank calls it once per optimizer step. It advances the sampler's
        cursor, publishes progress (the hang watchdog, ``status``), takes the periodic
        snapshot when one is due and agrees on a stop (``should_stop``).

        Args:
            num_samples: This rank's samples in the step; only without a global batch.

        Raises:
            ConfigError: The step ended after another number of micro-batches than the
                rank's share needs, or ``num_samples`` is missing without a global batch.
        """
        if self._on_failure is not None:
            self._on_failure.steps_ended()
        self._check_micro_batches()
        own_stop = self._own_stop_reason() if self._own_stop_requested() else None
        plain = self.sampler is not None and self.sampler.global_batch_size is None
        if plain and num_samples is None:
            raise ConfigError(
                "ElasticSampler without global_batch_size: call step_done(num_samples=len(batch))"
            )
        if not plain:
            # recorded before the all-reduce that counts the step: a rank killed just after
            # it has trained its share (its gradients are in the update every survivor
            # keeps), yet would leave no record; a step that never counts is trained again
            # by a newer attempt, whose records win (audit.effective_records)
            self._record(self._planned_indices(), step=self.step + 1)
        interval, timing = self._interval_figures(), self._stragglers.figures()
        votes, total, *figures = D.all_reduce_ints(
            [stop_vote(own_stop), num_samples or 0, *interval, *timing]
        )
        self._stragglers.observe(
            self.step + 1, figures[len(interval) :], steps_left=self._steps_left(self.step + 1)
        )
        self._observe_interval(figures[: len(interval)])
        with self._counting():
            indices = self._advance_sampler(num_samples, total)
            self.step += 1
            self._micro = 0
            if plain:
                self._record(indices)
        if self._memory is not None and self._memory.due(self.step):
            began = time.perf_counter()
            self._memory.save(self.step, self._snapshot_state(), {"rng": RNGState()})
            self._memory_cost_s = time.perf_counter() - began
        if self._reserve_in is not None:
            tier, self._reserve_in = self._reserve_in, None
            tier.reserve(self.step, self._snapshot_state())
        self._progress.write(step=self.step, epoch=self.epoch, restored_step=self.restored_step)
        if votes:
            preempted = votes >= STOP_VOTE_PREEMPTED  # some node goes away: storage
            self._stop(own_stop or peer_stop_reason(votes), anyone_preempted=preempted)
        elif self.max_steps is not None and self.step >= self.max_steps:
            self.stop_reason = STOP_MAX_STEPS
        elif self._interval.due(self.step, self._last_periodic):
            began = time.perf_counter()
            self._save(blocking=False)
            self._save_cost_s = time.perf_counter() - began
            self._last_periodic = self.step

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """Counting a step: a just-in-time copy (``on_failure``) waits, then sees it done."""
        if self._on_failure is None:
            yield
            return
        with self._on_failure.lock:
            yield
            self._on_failure.counted()

    def _consistent_state(self, stepped: bool) -> tuple[int, Mapping[str, Any]] | None:
        """(step, state) as of the last counted step, or (``stepped``) of the
        step the optimizer has just taken, which the session has not counted yet: its
        sampler state is the plan's (None without a global batch: the counts are agreed at
        the step's end). The audit then records that step for every rank: its all-reduce
        completed, so each rank's share went into the update, whether or not that rank lives
        to record it (the audit keeps one of identical records)."""
        state = self._snapshot_state()
        step = self.step
        if stepped:
            sampler = self.sampler
            after = sampler.after_step() if sampler is not None else None
            if sampler is not None and after is None:
                return None
            step += 1
            if sampler is not None and after is not None:
                state[SAMPLER_KEY] = after
                for rank in range(D.world_size()):
                    self._record(sampler.step_indices(rank), step=step, rank=rank)
            state[SESSION_KEY] = {"step": step, "epoch": self.epoch}
        return step, state

    @property
    def snapshot_every(self) -> int:
        """Steps between periodic storage snapshots (with ``auto``: the current choice)."""
        return self._interval.every

    def _interval_figures(self) -> list[int]:
        """With an ``auto`` interval: this rank's step time, last storage save stall and
        last in-memory copy stall (µs), summed over the group by the step's all-reduce (the
        same list length on every rank: the settings are); nothing otherwise."""
        if not (self._interval.auto or self._memory_interval is not None):
            return []
        now = time.perf_counter()
        step_s = now - self._step_ended if self._step_ended is not None else 0.0
        self._step_ended = now
        figures = (step_s, self._save_cost_s, self._memory_cost_s)
        self._save_cost_s = self._memory_cost_s = 0.0
        return [round(f * 1e6) for f in figures]

    def _observe_interval(self, figures: list[int]) -> None:
        if not figures:
            return
        world = D.world_size()
        step_s, cost_s, memory_s = (f / world / 1e6 if f else None for f in figures)
        if self._interval.auto:
            self._interval = self._chosen(self._interval, cost_s, step_s, "storage")
        if self._memory_interval is not None and self._memory is not None:
            self._memory_interval = self._chosen(self._memory_interval, memory_s, step_s, "memory")
            self._memory.every = self._memory_interval.every

    def _chosen(
        self, interval: Interval, cost_s: float | None, step_s: float | None, tier: str
    ) -> Interval:
        """``interval`` with the group's figures; ``snapshot.interval`` when it moved."""
        chosen = interval.observed(cost_s=cost_s, step_s=step_s)
        if chosen.every != interval.every and D.rank() == 0:
            emit(
                "snapshot.interval",
                step=self.step,
                tier=tier,
                every=chosen.every,
                cost_s=round(chosen.cost_s or 0.0, 4),
                step_s=round(chosen.step_s or 0.0, 4),
                mtbf_s=round(chosen.mtbf_s),
            )
        return chosen

    def _check_micro_batches(self) -> None:
        expected = self.micro_batches_per_step
        if self._micro and self._micro != expected:
            raise ConfigError(
                f"step {self.step + 1} ended after {self._micro} micro-batches but this rank's "
                f"share needs {expected}: use DataLoader(batch_size=sampler.micro_batch_size) "
                "and call step_done once per optimizer step"
            )

    def _own_stop_requested(self) -> bool:
        if self._signals.received is not None:
            return True
        stop_file = self.context.stop_file
        return stop_file is not None and os.path.exists(stop_file)

    def _own_stop_reason(self) -> str:
        """A signal that came with the supervisor's restart marker (and no stop file) is the
        supervisor restarting the group, not this node being preempted."""
        stop_file, restart_file = self.context.stop_file, self.context.restart_file
        restarting = restart_file is not None and os.path.exists(restart_file)
        preempting = stop_file is not None and os.path.exists(stop_file)
        return STOP_RESTARTING if restarting and not preempting else STOP_PREEMPTED

    def _advance_sampler(self, local: int | None, total: int) -> list[int]:
        if self.sampler is None:
            return []
        if self.sampler.global_batch_size is not None:
            return self.sampler.complete_step()
        return self.sampler.complete_step(local_samples=local, global_samples=total)

    def _steps_left(self, step: int) -> int | None:
        """Steps the run has left after ``step`` (None: unknown, as without a global batch
        or a step budget): the work a straggler's eviction would be paid back over."""
        left = []
        if self.max_steps is not None:
            left.append(max(0, self.max_steps - step))
        if self.sampler is not None and self._num_epochs is not None:
            after = self.sampler.steps_until(self._num_epochs)
            if after is not None:
                left.append(max(0, after - 1))  # the cursor is still at ``step``'s start
        return min(left, default=None)

    def _planned_indices(self) -> list[int]:
        """This rank's indices in the step at the sampler's cursor (none without a sampler)."""
        return self.sampler.step_indices(self.sampler.rank) if self.sampler is not None else []

    def _record(
        self, indices: list[int], *, step: int | None = None, rank: int | None = None
    ) -> None:
        if self._audit is None:
            return
        self._audit.write(
            AuditRecord(
                epoch=self.epoch,
                step=self.step if step is None else step,
                rank=D.rank() if rank is None else rank,
                world_size=D.world_size(),
                restart_count=self.context.restart_count,
                indices=tuple(indices),
                attempt=self.attempt,
                restored_step=self.restored_step,
            )
        )

    def _stop(self, reason: str, *, anyone_preempted: bool) -> None:
        self.stop_reason = reason
        # every stopping rank's supervisor restarts the group: all ranks know it from the
        # step's all-reduce, so all of them (and none else) enter _resumes_from_memory
        self._stopped_for_restart = not anyone_preempted and reason in RESTART_STOPS
        received = self._signals.received
        if D.rank() == 0 or received is not None:
            emit("session.stopping", step=self.step, reason=reason, signal=received)
        if self._resumes_from_memory():
            self._held_at = self.step  # agreed by every rank: ``finish`` need not ask again
        else:
            self._save(blocking=True, deadline_s=self._final_deadline())

    def _resumes_from_memory(self) -> bool:
        """Collective: supervisors restart the group (no node is going away: every stopping
        rank said so in the step's all-reduce, so every rank gets here) and every rank holds
        its part of this step's in-memory copy (taken in this ``step_done``): the new group
        resumes from it, a storage save would only lengthen the pause. A copy that failed or
        was skipped on any rank (tmpfs full, a sharded write still running) means the storage
        save after all, on every rank together. A preemption still saves: the memory copy dies
        with the node."""
        memory = self._memory
        if not self._stopped_for_restart or memory is None:
            return False  # the same on every rank: none enters the agreement below
        if memory.due(self.step):
            held = memory.holds(self.step)
        elif self._on_failure is not None:  # replicated state on every rank, or on none
            held = self._on_failure.copy(settle_s=SETTLE_S)  # at a step's end: consistent
        else:
            return False
        return D.all_reduce_ints([int(held)], op=dist.ReduceOp.MIN)[0] == 1

    # --- the script's own figures -----------------------------------------------------------
    def log_metrics(self, **figures: Any) -> None:
        """The script's figures (``loss=loss.item()``, any name) in a ``train.progress`` event
        of this step: rank 0, at most one per ``METRICS_EVERY_S`` (call it every step).
        ``elastic-train report`` plots ``loss``.

        Args:
            **figures: Name -> number (``loss=loss.item()``, ``lr=...``, your own).

        Raises:
            ConfigError: A figure is not a number, or its name is one of the event's own
                fields.
        """
        try:
            values = figures_of(figures)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if D.rank() != 0:
            return
        global_batch = self.sampler.global_batch_size if self.sampler is not None else None
        report = self._reporter.report(
            values,
            step=self.step,
            epoch=self.epoch,
            max_steps=self.max_steps,
            samples_per_step=global_batch,
        )
        if report is not None:
            emit("train.progress", **report)

    # --- snapshots ------------------------------------------------------------------------
    def _snapshot_state(self) -> dict[str, Any]:
        state: dict[str, Any] = dict(self.state)
        if self.sampler is not None:
            state[SAMPLER_KEY] = self.sampler.state_dict()
        state[SESSION_KEY] = {"step": self.step, "epoch": self.epoch}
        return state

    def _save(self, *, blocking: bool, deadline_s: float | None = None) -> None:
        if self._snapshots is None or self._snapshots.last_saved_step == self.step:
            return
        self._snapshots.save(
            self.step,
            self._snapshot_state(),
            epoch=self.epoch,
            blocking=blocking,
            deadline_s=deadline_s,
        )

    def finish(self) -> int:
        """Commit a final snapshot (synchronously) and close. After a coordinated stop the
        process exits with the supervisor's code (protocol.EXIT_PREEMPTED /
        EXIT_PEER_PREEMPTED) unless ``exit_on_stop=False``; returns that code otherwise.

        Returns:
            0 after training that ran to its end; after a coordinated stop with
            ``exit_on_stop=False``, the exit code the supervisor expects (exit with it).
        """
        if self._held_at != self.step and not self._resumes_from_memory():
            self._save(blocking=True)
        code = stop_exit_code(self.stop_reason)
        self.close(ended=code is None)
        if code is not None and self.exit_on_stop:  # nothing a successor uses is left open
            say_handed_off(self.context.control_dir, self.context.local_rank)
        D.shutdown()
        if code is not None and self.exit_on_stop:
            sys.exit(code)
        return code if code is not None else 0

    def close(self, *, ended: bool = False) -> None:
        """Collective: flush the in-flight snapshot and close files, without a final one.
        ``ended``: training is over (not stopped to go on later), so the disk space local
        storage keeps for the next save is freed."""
        self._stragglers.summarize()
        self._signals.uninstall()
        if self._on_failure is not None:
            self._on_failure.close()
        if self._memory is not None:
            self._memory.close()  # every rank at once: the sharded tier's mirrors end too
        if self._snapshots is not None:
            if ended:
                self._snapshots.release_reserved()
            else:
                self._snapshots.close()
        if self._audit is not None:
            self._audit.close()

    def abort(self) -> None:
        """After an error: local clean-up only. No collective (a peer may be stuck in another
        one); rank 0 still lets its in-flight snapshot commit, it was taken at a good step.
        A consistent state is first copied into the node's memory (``on_failure``): the
        group's failure is what the copy is for."""
        if self._on_failure is not None:
            self._on_failure.copy(settle_s=SETTLE_S)  # the training thread: let a GPU finish
            self._on_failure.close()
        self._signals.uninstall()
        if self._memory is not None:
            self._memory.flush()
        if self._snapshots is not None:
            self._snapshots.close_local()
        if self._audit is not None:
            self._audit.close()

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()  # a storage snapshot, no; a consistent state, copied to memory


def _check_keys(state: Mapping[str, Any]) -> None:
    reserved = {SAMPLER_KEY, SESSION_KEY} & set(state)
    if reserved:
        raise ConfigError(
            f"state names {sorted(reserved)} are reserved by TrainingSession; rename them"
        )


_keep_warned = False


def _snapshot_keep(snapshot_keep: int | None, keep: int | None) -> int | None:
    """``snapshot_keep``, or ``keep``: its former name, accepted with one warning per process
    (a public keyword is never removed)."""
    global _keep_warned
    if keep is None:
        return snapshot_keep
    if snapshot_keep is not None and snapshot_keep != keep:
        raise ConfigError(
            f"TrainingSession(keep={keep}, snapshot_keep={snapshot_keep}): give snapshot_keep "
            "only (keep is its former name)"
        )
    if not _keep_warned:
        _keep_warned = True
        warnings.warn(
            "TrainingSession(keep=...) is now snapshot_keep=...; keep still works",
            FutureWarning,
            stacklevel=3,
        )
    return keep
