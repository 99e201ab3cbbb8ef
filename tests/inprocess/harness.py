"""Several ranks as threads of the test's own process, for failure and recovery decisions.

Each rank is a thread with its own default process group: real gloo over loopback, its
peers found through one in-memory store per attempt, so the product's ``torch.distributed``
calls (``dist.all_reduce``, ``dist.get_rank``...) reach that rank's group unchanged. A
``FailureInjector`` raises inside a chosen rank's step (``fail_at``) or drops the rank from
the job (``lose_at``); the failing rank's group is then destroyed, its sockets close, and its
peers' collectives fail as they do when a worker process dies (gloo notices in
milliseconds). A ``Job`` runs attempt after attempt on shared snapshot and audit folders, as
the supervisor restarts and re-forms the group, so one test restores at another world size
in seconds instead of starting interpreters through the launcher.

The model is torchft's ``manager_integ_test.py`` (replicas as threads,
``FailureInjector().fail_at(rank, step)``, final states compared with ``assert_close``).

What only processes show stays in real-process tests (tests/dist, tests/e2e: through
the launcher): signals and exit codes, SIGKILL with no clean-up at all, process trees, the
supervisor. Threads also share one global RNG, so per-rank RNG streams are not tested here.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.contract.protocol import WorkerSettings
from elastic_trainer.worker.context import WorkerContext
from snapshots.storage import faults

# Seconds a collective (and the group's start) may wait for a peer: a bug that leaves a rank
# waiting fails the test in this time instead of pytest-timeout's.
COLLECTIVE_TIMEOUT_S = 30.0
# Seconds an attempt's threads may take to end once started.
ATTEMPT_TIMEOUT_S = 120.0
_UNUSED_PORT = 1  # WorkerContext wants an address; the group exists before the session


# --- torch's thread-local world ------------------------------------------------------------
# ``torch.distributed`` keeps the default group in process globals. torch's own threaded
# tests (torch/testing/_internal/common_distributed.py, ``spawn_threads_and_init_comms``)
# make them per thread with these two private pieces; torch itself changes them together.
# Checked against torch 2.14.1; tests/inprocess/test_harness.py probes that both still exist
# and work, and .ci/newest-torch.sh runs tests/inprocess on every newer torch release.
def _torch_thread_world() -> tuple[Callable[[bool], None], Callable[[], Any], Callable[[], None]]:
    from torch.testing._internal.distributed import multi_threaded_pg

    return (
        torch._C._distributed_c10d._set_thread_isolation_mode,
        multi_threaded_pg._install_threaded_pg,
        multi_threaded_pg._uninstall_threaded_pg,
    )


_INHERITED_WORLD = "_inprocess_world"


@contextlib.contextmanager
def _threads_inherit_their_world() -> Iterator[None]:
    """A thread that a rank starts (the snapshot writer, a sharded commit's worker) uses that
    rank's world, as a process's threads share its one: the writer's collectives on the
    snapshot group must find the group registered."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    local, get_world, start = (
        ThreadLocalWorld._world,
        ThreadLocalWorld._get_world,
        threading.Thread.start,
    )

    def start_inheriting(thread: threading.Thread) -> None:
        world = getattr(local, "world", None)
        if world is not None and world.default_pg is not None:  # a rank's, not the test's
            setattr(thread, _INHERITED_WORLD, world)
        start(thread)

    def get_inherited_world(world: Any) -> Any:
        inherited = getattr(threading.current_thread(), _INHERITED_WORLD, None)
        if not hasattr(local, "world") and inherited is not None:
            local.world = inherited
        return get_world(world)

    threading.Thread.start = start_inheriting  # type: ignore[method-assign]
    ThreadLocalWorld._get_world = get_inherited_world  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]
        ThreadLocalWorld._get_world = get_world  # type: ignore[method-assign]


@contextlib.contextmanager
def thread_local_world() -> Iterator[None]:
    """While open, every thread has a ``torch.distributed`` world of its own (the C++ group
    registry too), as each process has, and gloo binds loopback only. Not re-entrant: one at
    a time per process."""
    isolate, install, uninstall = _torch_thread_world()
    interface = os.environ.get(_GLOO_INTERFACE)
    os.environ[_GLOO_INTERFACE] = "lo"
    isolate(True)
    install()
    try:
        with _threads_inherit_their_world():
            yield
    finally:
        uninstall()
        isolate(False)
        if interface is None:
            del os.environ[_GLOO_INTERFACE]
        else:
            os.environ[_GLOO_INTERFACE] = interface


_GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"


# --- faults --------------------------------------------------------------------------------
class InjectedFailure(Exception):
    """Raised inside a rank's step by ``FailureInjector.fail_at``: a script error."""


class NodeLost(InjectedFailure):
    """Raised inside a rank's step by ``FailureInjector.lose_at``: the rank's node is gone,
    the next attempt forms without it."""


@dataclass
class FailureInjector:
    """Where each rank fails, by (attempt, rank, step); each fault fires once. ``step`` is the
    step being trained (one more than ``session.step`` before its ``step_done``)."""

    _at: dict[tuple[int, int], tuple[int, type[InjectedFailure]]] = field(default_factory=dict)
    fired: list[tuple[int, int, int]] = field(default_factory=list)  # (attempt, rank, step)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fail_at(self, rank: int, step: int, *, attempt: int = 0) -> FailureInjector:
        self._at[(attempt, rank)] = (step, InjectedFailure)
        return self

    def lose_at(self, rank: int, step: int, *, attempt: int = 0) -> FailureInjector:
        self._at[(attempt, rank)] = (step, NodeLost)
        return self

    def check(self, attempt: int, rank: int, step: int) -> None:
        """Call inside every step of every rank; raises where a fault is due."""
        with self._lock:
            due = self._at.get((attempt, rank))
            if due is None or due[0] != step:
                return
            del self._at[(attempt, rank)]
            self.fired.append((attempt, rank, step))
        raise due[1](f"injected at attempt {attempt}, rank {rank}, step {step}")


class SaveFault(InjectedFailure):
    """Raised on rank 0's snapshot writer at a save point by ``SaveFaultAt``."""


@dataclass
class SaveFaultAt:
    """A ``snapshots.storage.faults`` injector for threads: raise ``SaveFault`` on the writer
    the first time the ``save``-th save of this process (1-based) reaches ``point`` (the
    crash tests' ``KillAt`` would SIGKILL the test process). Saves are told apart by their
    first point, ``before_data``: one save at a time runs, in order (``when_busy="wait"``).
    ``hit`` is set once it fired, for the rank to go down with its writer."""

    point: str
    save: int
    hit: threading.Event = field(default_factory=threading.Event)
    _saves: int = 0

    def __post_init__(self) -> None:
        if self.point not in faults.SAVE_POINTS:
            raise ValueError(f"{self.point!r} is not a save point: {faults.SAVE_POINTS}")

    def __call__(self, point: str, **_where: Any) -> None:
        if point == "before_data":
            self._saves += 1
        if self.hit.is_set() or point != self.point or self._saves != self.save:
            return
        self.hit.set()
        raise SaveFault(f"injected at {point} of save {self.save}")


@contextlib.contextmanager
def injected_save_fault(fault: SaveFaultAt) -> Iterator[SaveFaultAt]:
    faults.inject(fault)
    try:
        yield fault
    finally:
        faults.inject(None)


# --- ranks and attempts --------------------------------------------------------------------
@dataclass(frozen=True)
class Rank:
    """What a rank's function is given: its place and its attempt's context."""

    rank: int
    world_size: int
    attempt: int
    context: WorkerContext
    injector: FailureInjector

    def check(self, step: int) -> None:
        self.injector.check(self.attempt, self.rank, step)


@dataclass
class Outcome:
    rank: int
    value: Any = None
    error: BaseException | None = None
    trace: str = ""  # the error's traceback, as text (its frames are cleared)

    @property
    def lost(self) -> bool:
        return isinstance(self.error, NodeLost)


@dataclass
class Attempt:
    world_size: int
    outcomes: list[Outcome]

    @property
    def succeeded(self) -> bool:
        return all(o.error is None for o in self.outcomes)

    @property
    def survivors(self) -> int:
        return sum(not o.lost for o in self.outcomes)

    def values(self) -> list[Any]:
        return [o.value for o in self.outcomes]

    def raise_first(self) -> None:
        """An attempt that should have succeeded: its first error, with its traceback."""
        for outcome in self.outcomes:
            if outcome.error is not None:
                raise AssertionError(f"rank {outcome.rank} failed:\n{outcome.trace}")


RankFn = Callable[[Rank], Any]


def run_attempt(
    fn: RankFn,
    world_size: int,
    *,
    attempt: int = 0,
    injector: FailureInjector | None = None,
    settings: WorkerSettings | None = None,
) -> Attempt:
    """``fn`` on ``world_size`` ranks, each a thread with its own gloo group; every thread
    has ended when this returns. A rank that raises destroys its group at once, so its peers'
    collectives fail instead of waiting (a dead process's sockets close the same way)."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    injector = injector or FailureInjector()
    outcomes = [Outcome(rank) for rank in range(world_size)]
    # ranks that succeeded leave together: one leaving while a peer still reads the last
    # collective's bytes would fail that peer (as D.shutdown's barrier avoids for processes)
    all_done = threading.Barrier(world_size, timeout=ATTEMPT_TIMEOUT_S)

    def body(rank: int) -> None:
        context = WorkerContext(
            rank=rank,
            local_rank=rank,
            world_size=world_size,
            local_world_size=world_size,
            master_addr="127.0.0.1",
            master_port=_UNUSED_PORT,
            restart_count=attempt,
            settings=settings or WorkerSettings(),
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            outcomes[rank].value = fn(Rank(rank, world_size, attempt, context, injector))
        except BaseException as exc:  # the outcome carries it to the test
            outcomes[rank].error, outcomes[rank].trace = exc, traceback.format_exc()
            _close_group_now(exc)
        with contextlib.suppress(threading.BrokenBarrierError):
            all_done.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    threads = [
        threading.Thread(target=body, args=(rank,), name=f"attempt{attempt}-rank{rank}")
        for rank in range(world_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(ATTEMPT_TIMEOUT_S)
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise TimeoutError(f"{stuck} still running after {ATTEMPT_TIMEOUT_S} s")
    return Attempt(world_size, outcomes)


def _close_group_now(error: BaseException) -> None:
    """Destroy the failed rank's group so that its sockets close and its peers' collectives
    fail at once, as a dead process's do. gloo closes them only when the last reference to
    the group goes (``abort``/``shutdown`` leave them open), and the failed frames still hold
    one (a DDP model, the session): their locals are dropped first (the trace is kept as
    text)."""
    traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None
    dist.destroy_process_group()
    gc.collect()


@dataclass
class Job:
    """Attempts of one job, numbered as the supervisor's restarts are; ``fn`` shares the
    job's folders between them through its closure."""

    fn: RankFn
    injector: FailureInjector = field(default_factory=FailureInjector)
    attempts: list[Attempt] = field(default_factory=list)
    settings: WorkerSettings | None = None

    def attempt(self, world_size: int) -> Attempt:
        done = run_attempt(
            self.fn,
            world_size,
            attempt=len(self.attempts),
            injector=self.injector,
            settings=self.settings,
        )
        self.attempts.append(done)
        return done

    def run(self, world_size: int, *, max_attempts: int = 5) -> Attempt:
        """Attempts until one succeeds: a failed rank is restarted (same world size), a lost
        one is not (the world shrinks), as the supervisor does."""
        for _ in itertools.repeat(None, max_attempts):
            done = self.attempt(world_size)
            if done.succeeded:
                return done
            world_size = done.survivors
        raise AssertionError(f"no attempt of {max_attempts} succeeded")
