"""The in-memory copy made just in time: nothing is copied while training goes well; when the
group ends (a peer lost, a rank crashed, the supervisor re-forming the group) every
surviving rank whose state is consistent writes it once into its node's memory, and the new
group restores the newest such copy any node holds (``tier``, ``plan``).

With replicated (DDP) state every rank holds the whole model and optimizer, so the
survivors' state *is* the checkpoint (JIT checkpointing, EuroSys 2024); so it is, shard by
shard, with HSDP replicas (``shards``). What makes it safe
is knowing, at every instant, what the state is (``Phase``): the end of the session's step
k (``CLEAN``: the next optimizer step has not begun), the end of step k+1 before the
session has counted it (``STEPPED``: the optimizer stepped with gradients every rank
all-reduced, so only the sampler and the counter lag behind, and they are advanced in a copy),
or torn (``TORN``: inside ``optimizer.step()``; with several optimizers, until the session's
``step_done`` says all have stepped), which is never copied. One lock orders the
copy against the optimizer's step and the session's count, so a copy taken from another
thread never sees either half done. The RNG states go with the step they belong to: taken
when the optimizer has stepped (and at the start), since by the time of a failure the next
step's forward pass (dropout, augmentation) may have drawn from them already.

On a GPU the device runs behind the host: the copy reads the state only after the device has
finished the step it describes (``step_mark``). When the step the host took is still queued
(a peer lost in its gradient all-reduce), the device still holds the state as that step
began, and the copy is of that one: the host's side of it is held at each step's pre-hook
(``held``), where the optimizers' counters and the schedulers have not moved on yet.

The copy is made on the training thread when the script raises (the session's ``abort``,
or ``bootstrap`` for a script without ``with``), or on a watcher thread when the supervisor
asks (it writes a byte into the rank's ``protocol.copy_now_fifo``: ``protocol.request_copy``;
a rank blocked in a collective with a frozen peer never returns to Python by itself); the
watcher then answers with ``protocol.copied_file``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from elastic_trainer.contract import protocol
from elastic_trainer.worker.memory.held import held_state, thawed
from elastic_trainer.worker.memory.step_mark import SETTLE_S, StepMark, step_mark_for
from snapshots.format.rng import FrozenRNGState


class Phase(enum.Enum):
    CLEAN = "clean"
    STEPPED = "stepped"
    TORN = "torn"


# (step, state) of the state now; ``stepped``: advance past the optimizer's step that the
# session has not counted yet. None: no consistent copy can be described. The per-rank part
# (the RNG states of that step) is this module's.
Capture = Callable[[bool], "tuple[int, Mapping[str, Any]] | None"]
# Report a failure (step, the error, what failed) once per streak: ``slots.FailureStreak``.
Failed = Callable[[int, Exception, str], None]
# Write (step, state, per-rank state) into the node's memory; True when the node holds it.
Write = Callable[[int, Mapping[str, Any], Mapping[str, Any]], bool]


class WriteChecked(Protocol):
    """A ``Write`` that asks ``valid`` after the tensors are read and before the copy is
    committed: False throws the copy away (the device moved on while it was read)."""

    def __call__(
        self,
        step: int,
        state: Mapping[str, Any],
        per_rank: Mapping[str, Any],
        *,
        valid: Callable[[], bool],
    ) -> bool: ...


@dataclass(frozen=True)
class Held:
    """The state as the step in progress began, its host side frozen (``held``)."""

    step: int
    state: Mapping[str, Any]
    rng: FrozenRNGState


_open: weakref.WeakSet[FailureCopy] = weakref.WeakSet()


def copy_all() -> None:
    """The copies of this process's open sessions: for a script that raised out of its
    loop without ``with TrainingSession(...)`` (``bootstrap`` calls it before exiting)."""
    for failure_copy in list(_open):
        failure_copy.copy(settle_s=SETTLE_S)


class FailureCopy:
    """One rank's just-in-time copy. ``attach`` the optimizers; the session calls
    ``counted`` (under ``lock``) once it has counted a step."""

    def __init__(
        self,
        capture: Capture,
        write: Write,
        *,
        write_held: WriteChecked | None = None,
        failed: Failed | None = None,
    ) -> None:
        self.lock = threading.RLock()
        self.phase = Phase.CLEAN
        self.copied: int | None = None  # the step this rank copied
        self._capture, self._write = capture, write
        self._handles: list[Any] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._writing: int | None = None  # our own write end of the FIFO (watch)
        # the RNG states as of the last step boundary: where the state stands now (the
        # session opens this copy once its restore is done) or the optimizer's last step
        self._rng = FrozenRNGState()
        self._mark: StepMark | None = None  # on a GPU: the step's end on the device
        # on a GPU, given ``write_held``: the state as the step in progress began
        # (``_copy_held``); a tier that cannot check a copy before its commit holds nothing
        self._write_held = write_held
        self._held: Held | None = None
        self._failed = failed
        self._optimizers = 0  # attached
        _open.add(self)

    def attach(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self._mark is None:
            self._mark = step_mark_for(optimizers)
        for optimizer in optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._entering))
            self._handles.append(optimizer.register_step_post_hook(self._stepped))
        self._optimizers += len(optimizers)

    def _entering(self, *_: Any) -> None:
        with self.lock:  # waits for a copy being taken from the watcher
            # the step's first optimizer (a second one's pre-hook finds the phase moved on)
            mark = self._mark
            if mark is not None and self._write_held is not None and self.phase is Phase.CLEAN:
                self._held = self._held_now()
                mark.begin()
            self.phase = Phase.TORN

    def _held_now(self) -> Held | None:
        """Never raises into the training step: a state dict that cannot be taken at every
        step (ZeroRedundancyOptimizer's, before it is consolidated) turns holding off, once,
        with a warning; the copies of finished steps go on."""
        captured = self._capture(False)
        if captured is None:
            return None
        step, state = captured
        try:
            return Held(step, held_state(state), self._rng)
        except Exception as exc:
            self._write_held = None
            if self._failed is not None:
                self._failed(step, exc, "holding the state as a step begins (now off): ")
            return None

    def _stepped(self, *_: Any) -> None:
        # One optimizer: its step ends the training step. Several: the state stays torn from
        # the first one's step until the session's step_done says all have stepped
        # (``steps_ended``): which of them step, and in what order, is the script's.
        if self._optimizers == 1:
            self._step_ended()

    def steps_ended(self) -> None:
        """The session's ``step_done``, first: every optimizer of the step has stepped."""
        if self.phase is Phase.TORN:
            self._step_ended()

    def _step_ended(self) -> None:
        with self.lock:
            self.phase = Phase.STEPPED
            self._rng = FrozenRNGState()
            if self._mark is not None:
                self._mark.record()

    def counted(self) -> None:
        self.phase = Phase.CLEAN

    def copy(self, settle_s: float = 0.0) -> bool:
        """Write the consistent state once (not when torn); True when this rank's copy of
        the state's step exists. On a GPU, ``settle_s``: how long to let the device finish
        the last step first (the training thread's copy after the script raised)."""
        with self.lock:
            if self.phase is Phase.TORN:
                return False
            if self._mark is None:
                return self._copy_now()
            if not self._mark.done(settle_s):  # the update is still queued on the device
                return self._copy_held()
            with self._mark.reading():
                return self._copy_now()

    def _copy_held(self) -> bool:
        """The state as the last step began, which the device still holds: read after the
        step before it ended, and kept only if the device has not begun the step meanwhile."""
        held, mark, write = self._held, self._mark, self._write_held
        if held is None or mark is None or write is None:
            return False
        if not mark.before_done() or mark.began():  # no read: it could only be thrown away
            return False
        if self.copied is not None and self.copied >= held.step:
            return True
        with mark.reading(before=True):
            state = thawed(held.state)
            done = write(held.step, state, {"rng": held.rng}, valid=lambda: not mark.began())
        if done:
            self.copied = held.step
        return done

    def _copy_now(self) -> bool:
        captured = self._capture(self.phase is Phase.STEPPED)
        if captured is None:
            return False
        step, state = captured
        if self.copied == step:
            return True
        if self._write(step, state, {"rng": self._rng}):
            self.copied = step
            return True
        return False

    def watch(self, control_dir: str | None, local_rank: int) -> None:
        """Answer the supervisor's request from a thread that sleeps in ``read`` of this
        rank's FIFO (``protocol.copy_now_fifo``) until a byte arrives: no polling, so no
        wake-ups: a poll wakes a core the training threads need, on every rank, all the
        time.

        Both ends are open before the copier file announces the FIFO: a request can never
        find nobody reading, and the read never ends early (our own write end is open)."""
        if control_dir is None:
            return
        fifo = os.path.join(control_dir, protocol.copy_now_fifo(local_rank))
        answer = os.path.join(control_dir, protocol.copied_file(local_rank))
        try:
            os.mkfifo(fifo, 0o600)  # in the supervisor's private control folder
            reading = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            self._writing = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        os.set_blocking(reading, True)
        _answer(os.path.join(control_dir, protocol.copier_file(local_rank)), True)

        def run() -> None:
            try:
                os.read(reading, 1)  # a request, or close()
            except OSError:
                return
            finally:
                os.close(reading)
            if not self._stop.is_set():
                _answer(answer, self.copy())

        self._watcher = threading.Thread(target=run, name="copy-on-failure", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        _open.discard(self)
        self._stop.set()
        writing, self._writing = self._writing, None
        if writing is not None:  # the watcher ends without copying, whenever it reads
            with contextlib.suppress(OSError):
                os.write(writing, b"x")
            os.close(writing)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _answer(path: str, done: bool) -> None:
    """Write ``path`` atomically (the supervisor lists and reads these files)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write("copied" if done else "none")
        os.replace(tmp, path)
    except OSError:
        pass  # the control folder is gone: the supervisor has stopped waiting
