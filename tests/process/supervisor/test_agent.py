"""The agent as a thin executor, driven by scripted observations (as torch's api_test.py does
for SimpleElasticAgent): no processes, no store, no sleeping. Each scenario scripts the
rendezvous rounds and what the workers do, then checks the events and the outcome."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs
from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, ProcessFailure

from elastic_trainer.contract import protocol
from elastic_trainer.contract.auth import JobKey
from elastic_trainer.contract.config import RestartTuning, RunConfig
from elastic_trainer.supervisor.agent import ElasticTrainAgent
from elastic_trainer.supervisor.core.watchdog import HangVerdict
from elastic_trainer.supervisor.processes.procs import ProcessTracker
from elastic_trainer.supervisor.processes.signals import StopRequest
from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch
from elastic_trainer.supervisor.rendezvous.presence import PeerWatch
from elastic_trainer.supervisor.warm.launcher import WarmPool

OK, RUNNING = 0, None


@dataclass
class Round:
    """One rendezvous round: how many nodes, and what each monitor tick sees afterwards."""

    nodes: int
    ticks: list[dict[int, int | None]]  # per tick: local rank -> exit code (None = running)
    waiting: list[int] = field(default_factory=list)  # nodes waiting, per tick
    hang_at: int | None = None  # tick at which the watchdog reports a hang


class FakeHandler:
    this_node = "node0"
    job_key = JobKey.generate()

    def __init__(self, agent_script: Script) -> None:
        self.script = agent_script
        self.round = 0
        self.left = False
        self.marked_dead: list[set[str]] = []  # per rejoin that had any

    def mark_dead(self, nodes: set[str]) -> None:
        self.marked_dead.append(set(nodes))

    def publish_presence(self, address: str) -> None:
        pass

    def presence_addresses(self, nodes: set[str]) -> dict[str, str]:
        return {}

    def store_host_member(self) -> str | None:
        return None  # a standalone store: failover never applies here

    def member_name(self) -> str:
        return self.this_node

    def leaving_host(self) -> str | None:
        return None

    def participants(self) -> set[str]:
        return {f"node{i}" for i in range(self.script.current.nodes)}

    def num_nodes_waiting(self) -> int:
        waiting = self.script.current.waiting
        tick = self.script.tick
        if self.script.store_lost:
            raise RuntimeError("Connection reset by peer")
        return waiting[tick] if tick < len(waiting) else 0

    def stale_peers(self, members: set[str]) -> set[str]:
        if self.script.silent_from is not None and self.script.tick >= self.script.silent_from:
            return set(self.script.silent) & members
        return set(self.script.lost_peers)

    def leave(self) -> bool:
        self.left = True
        return True

    def get_run_id(self) -> str:
        return "job"

    def get_backend(self) -> str:
        return "c10d"

    def shutdown(self) -> bool:
        return True


class FakeStop(StopRequest):
    """StopRequest without signals: ``wait`` never sleeps, it records and answers.
    ``on_wait(timeout)`` runs first: a test requests the stop or moves the clock there."""

    requested = False  # set by the test, not by a signal

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.on_wait: Callable[[float], None] = lambda timeout: None

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.on_wait(seconds)
        return self.requested

    def wait_for_change(self, seconds: float, fds: Any = ()) -> bool:
        return self.wait(seconds)  # the script says what changed: no fd to wait on

    def write_stop_file(self) -> None:
        pass


class FakePeers(PeerWatch):
    """presence.PeerWatch, scripted: which peers' connections closed, from which tick."""

    def __init__(self, script: Script) -> None:
        super().__init__(FakeHandler.job_key, FakeHandler.this_node)
        self.script = script

    def watch(self, peers: Any) -> None:
        pass

    def lost(self) -> set[str]:
        script = self.script
        first_round = script.index == 0
        return set(script.closed) if first_round and script.tick >= script.closed_from else set()

    def left(self) -> set[str]:
        return set(self.script.left) if self.script.index == 0 else set()

    def close(self) -> None:
        pass


class FakeProcs(ProcessTracker):
    """ProcessTracker without processes: records what it was asked to signal."""

    def __init__(self) -> None:
        super().__init__()
        self.terminated: list[int] = []

    def terminate(self, local_ranks: Any) -> list[int]:
        self.terminated += local_ranks
        return []

    def track(self, popens: dict[int, Any]) -> None:
        pass

    def kill(self, *, grace_s: float) -> None:
        pass

    def alive(self) -> list[Any]:
        return []

    def refresh(self) -> None:
        pass

    def resources(self) -> dict[int, Any]:
        return {}


class Script:
    def __init__(
        self,
        rounds: list[Round],
        *,
        lost_peers: tuple[str, ...] = (),
        silent: tuple[str, ...] = (),
        silent_from: int | None = None,
        closed: tuple[str, ...] = (),
        closed_from: int = 0,
        left: tuple[str, ...] = (),
    ) -> None:
        self.left = left  # peers that said goodbye on their presence connection
        self.silent, self.silent_from = silent, silent_from
        self.closed, self.closed_from = closed, closed_from  # presence connections closed
        self.rounds = rounds
        self.index = -1
        self.tick = 0
        self.lost_peers = lost_peers
        self.store_lost = False

    @property
    def current(self) -> Round:
        return self.rounds[self.index]


class ScriptedMembership(MembershipWatch):
    """MembershipWatch whose presence connections are scripted: no server, no sockets."""

    def __init__(self, handler: Any, peers: PeerWatch, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.scripted_peers = peers

    def open_presence(self, bind_host: str, key: JobKey, *, max_nodes: int) -> None:
        self.peers = self.scripted_peers


class ScriptedAgent(ElasticTrainAgent):
    def __init__(
        self,
        script: Script,
        cfg: RunConfig,
        tmp_path: Any,
        nproc: int = 1,
        pool: WarmPool | None = None,
    ) -> None:
        self.script = script
        self.error_file = "/nonexistent"  # torch's: what the worker wrote under @record
        spec = WorkerSpec(
            role="trainer",
            local_world_size=nproc,
            entrypoint=sys.executable,
            args=(),
            rdzv_handler=FakeHandler(script),  # type: ignore[arg-type]
            max_restarts=cfg.max_restarts,
            monitor_interval=cfg.monitor_interval,
        )
        self.stop = FakeStop()
        self.procs = FakeProcs()
        self.clock = 0.0  # one second per monitor tick, for the silent-peer checks
        membership = ScriptedMembership(
            spec.rdzv_handler,
            FakePeers(script),
            endpoint="127.0.0.1:1",
            check_every_s=1.0,
            dead_after_s=3.0,
            clock=lambda: self.clock,
        )
        super().__init__(
            spec=spec,
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
            cfg=cfg,
            stop=self.stop,
            control_root=str(tmp_path),
            procs=self.procs,
            membership=membership,
            pool=pool,
        )

    def _join_round(self, worker_group: Any) -> None:
        self.script.index += 1
        self.script.tick = 0
        nodes, nproc = self.script.current.nodes, worker_group.spec.local_world_size
        worker_group.group_rank, worker_group.group_world_size = 0, nodes
        worker_group.workers = [
            Worker(
                local_rank=lr,
                global_rank=lr,
                role_rank=lr,
                world_size=nodes * nproc,
                role_world_size=nodes * nproc,
            )
            for lr in range(nproc)
        ]

    def _spawn(self, worker_group: Any) -> tuple[dict[int, Any], dict[int, Any]]:
        return {lr: 1000 + lr for lr in range(worker_group.spec.local_world_size)}, {}

    def _codes(self) -> dict[int, int | None]:
        ticks = self.script.current.ticks
        return ticks[min(self.script.tick, len(ticks) - 1)]

    def _poll_codes(self) -> dict[int, int | None]:
        return self._codes()

    def _collect(self, worker_group: Any) -> RunResult:
        codes = self._codes()
        self.script.tick += 1
        self.clock += 1.0
        failed = {lr: c for lr, c in codes.items() if c not in (None, 0)}
        if failed:
            return RunResult(
                state=WorkerState.FAILED,
                failures={
                    lr: ProcessFailure(
                        local_rank=lr, pid=1000 + lr, exitcode=c, error_file=self.error_file
                    )
                    for lr, c in failed.items()
                },
            )
        if all(c == OK for c in codes.values()):
            return RunResult(state=WorkerState.SUCCEEDED)
        return RunResult(state=WorkerState.HEALTHY)

    def _observe(self) -> HangVerdict | None:
        if self.script.current.hang_at == self.script.tick - 1:
            return HangVerdict(local_rank=0, last_step=7, stalled_s=301.0)
        return None

    def _exit_barrier(self) -> None:
        pass


def run(
    rounds: list[Round],
    tmp_path: Any,
    *,
    max_restarts: int = 3,
    prepare: Callable[[ScriptedAgent], None] | None = None,
    **script_kwargs: Any,
) -> tuple[Any, list[dict[str, Any]], ScriptedAgent]:
    cfg = RunConfig(
        max_restarts=max_restarts,
        monitor_interval=0.01,
        restart=RestartTuning(backoff_base_s=1.0, backoff_max_s=8.0),
    )
    agent = ScriptedAgent(Script(rounds, **script_kwargs), cfg, tmp_path)
    if prepare is not None:
        prepare(agent)
    with capture_logs() as logs:
        outcome = agent.supervise()
    return outcome, logs, agent


def named(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def test_a_failure_restarts_the_group_and_counts(tmp_path) -> None:
    outcome, logs, _ = run(
        [Round(nodes=1, ticks=[{0: RUNNING}, {0: 1}]), Round(nodes=1, ticks=[{0: OK}])], tmp_path
    )
    assert (outcome.status, outcome.exit_code, outcome.restarts) == ("succeeded", 0, 1)
    (failed,) = named(logs, "worker.failed")
    assert (failed["cause"], failed["exit_code"], failed["rank"]) == ("error", 1, 0)
    (restarting,) = named(logs, "group.restarting")
    assert (restarting["reason"], restarting["restart_count"], restarting["restarts_left"]) == (
        "failure",
        1,
        2,
    )
    assert not named(logs, "membership.changed")


def test_a_crash_loop_backs_off_exponentially(tmp_path) -> None:
    crash = Round(nodes=1, ticks=[{0: -9}])
    outcome, logs, agent = run([crash, crash, crash, Round(nodes=1, ticks=[{0: OK}])], tmp_path)
    assert outcome.status == "succeeded" and outcome.restarts == 3
    assert [e["backoff_s"] for e in named(logs, "group.restarting")] == [0.0, 1.0, 2.0]
    assert [e["signal"] for e in named(logs, "worker.failed")] == ["SIGKILL"] * 3
    assert {1.0, 2.0} <= set(agent.stop.waits)  # the back-off was waited, interruptibly


def test_the_job_fails_once_the_budget_is_spent(tmp_path) -> None:
    crash = Round(nodes=1, ticks=[{0: 1}])
    outcome, logs, _ = run([crash, crash], tmp_path, max_restarts=1)
    assert (outcome.status, outcome.exit_code, outcome.restarts) == ("failed", 1, 1)
    assert len(named(logs, "worker.failed")) == 2 and len(named(logs, "group.restarting")) == 1


def test_a_node_lost_with_the_budget_spent_is_a_free_membership_change(tmp_path) -> None:
    rounds = [Round(nodes=2, ticks=[{0: 1}]), Round(nodes=1, ticks=[{0: OK}])]
    outcome, logs, _ = run(rounds, tmp_path, max_restarts=0, lost_peers=("node1",))
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    (restarting,) = named(logs, "group.restarting")
    assert restarting["reason"] == "membership"
    (changed,) = named(logs, "membership.changed")
    assert (changed["old_world_size"], changed["new_world_size"], changed["reason"]) == (
        2,
        1,
        "node_lost",
    )


def test_a_counted_failure_explained_by_a_smaller_world_is_refunded(tmp_path) -> None:
    rounds = [Round(nodes=2, ticks=[{0: -6}]), Round(nodes=1, ticks=[{0: OK}])]
    outcome, logs, _ = run(rounds, tmp_path)
    assert outcome.restarts == 0  # charged at the failure, refunded when the world shrank
    assert named(logs, "group.restarting")[0]["restart_count"] == 1
    assert named(logs, "membership.changed")[0]["reason"] == "node_lost"


def test_a_node_joining_re_forms_the_group_for_free(tmp_path) -> None:
    rounds = [
        Round(nodes=1, ticks=[{0: RUNNING}, {0: RUNNING}], waiting=[0, 1]),
        Round(nodes=2, ticks=[{0: OK}]),
    ]
    outcome, logs, _ = run(rounds, tmp_path)
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    assert named(logs, "group.restarting")[0]["reason"] == "membership"
    (changed,) = named(logs, "membership.changed")
    assert (changed["new_world_size"], changed["reason"]) == (2, "node_joined")
    assert not named(logs, "worker.failed")


def test_a_peer_preemption_is_a_membership_change_not_a_failure(tmp_path) -> None:
    exit_75 = protocol.EXIT_PEER_PREEMPTED
    rounds = [Round(nodes=2, ticks=[{0: exit_75}]), Round(nodes=1, ticks=[{0: OK}])]
    outcome, logs, agent = run(rounds, tmp_path, max_restarts=0, left=("node1",))
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    assert named(logs, "worker.failed")[0]["cause"] == "preempted"
    assert named(logs, "membership.changed")[0]["reason"] == "peer_preempted"
    assert not named(logs, "peer.lost")  # it said goodbye: gone, not lost ...
    assert agent._worker_group.spec.rdzv_handler.marked_dead == [{"node1"}]  # ... not waited for


def test_a_hang_kills_and_restarts_with_reason_hang(tmp_path) -> None:
    rounds = [Round(nodes=1, ticks=[{0: RUNNING}], hang_at=0), Round(nodes=1, ticks=[{0: OK}])]
    outcome, logs, _ = run(rounds, tmp_path)
    assert outcome.restarts == 1
    (hung,) = named(logs, "worker.hung")
    assert (hung["last_step"], hung["stalled_s"]) == (7, 301.0)
    assert named(logs, "worker.failed")[0]["cause"] == "hang"
    assert named(logs, "group.restarting")[0]["reason"] == "hang"


def test_a_hang_asks_the_workers_for_their_copies_before_the_kill(tmp_path) -> None:
    """A rank hung in a collective never returns to its loop, but its watcher thread copies
    the end of its last step when asked: a hang killed at once lost the steps since the last
    storage snapshot."""
    requested_at_kill: list[bytes] = []

    def answering_session(agent: ScriptedAgent) -> None:
        observe = agent._observe

        def announce_then_observe() -> HangVerdict | None:
            control = Path(agent._stop.control_dir or "")
            if not (control / protocol.copier_file(0)).exists():
                os.mkfifo(control / protocol.copy_now_fifo(0))
                fifo = os.open(control / protocol.copy_now_fifo(0), os.O_RDONLY | os.O_NONBLOCK)
                agent.fifos.append(fifo)
                (control / protocol.copier_file(0)).touch()
                (control / protocol.copied_file(0)).write_text("copied")
            return observe()

        def kill(*, grace_s: float) -> None:
            try:
                requested_at_kill.append(os.read(agent.fifos[0], 8))
            except BlockingIOError:
                requested_at_kill.append(b"")

        agent.fifos = []  # type: ignore[attr-defined]
        agent._observe = announce_then_observe  # type: ignore[method-assign]
        agent.procs.kill = kill  # type: ignore[method-assign]

    rounds = [Round(nodes=1, ticks=[{0: RUNNING}], hang_at=0), Round(nodes=1, ticks=[{0: OK}])]
    outcome, logs, agent = run(rounds, tmp_path, prepare=answering_session)
    for fd in agent.fifos:  # type: ignore[attr-defined]
        os.close(fd)
    assert outcome.restarts == 1 and named(logs, "worker.hung")
    assert requested_at_kill[0] == b"x"  # asked before the hung worker was killed


def test_a_lost_store_is_reported_once_and_the_workers_go_on(tmp_path) -> None:
    def lose_store(agent: ScriptedAgent) -> None:
        agent.script.store_lost = True

    rounds = [Round(nodes=1, ticks=[{0: RUNNING}, {0: RUNNING}, {0: RUNNING}, {0: OK}])]
    outcome, logs, _ = run(rounds, tmp_path, prepare=lose_store)
    assert outcome.status == "succeeded"
    (lost,) = named(logs, "store.unreachable")
    assert "Connection reset" in lost["error"]


def test_a_worker_refusing_its_configuration_ends_the_job_at_once(tmp_path) -> None:
    rounds = [Round(nodes=1, ticks=[{0: protocol.EXIT_CONFIG}])]
    outcome, logs, _ = run(rounds, tmp_path)
    assert (outcome.status, outcome.exit_code, outcome.restarts) == ("config_error", 2, 0)
    assert named(logs, "worker.failed")[0]["cause"] == "config"
    assert not named(logs, "group.restarting")
    assert outcome.error.startswith("worker rank 0 refused its configuration (exit 2)")


class TailedSpecs(DefaultLogsSpecs):
    """torch's specs with what console.RelayedLogsSpecs adds: each worker's stderr tail."""

    def __init__(self, lines: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lines = lines

    def stderr_tail(self, local_rank: int) -> list[str]:
        return self.lines


_TRACEBACK = [
    "loading the model",
    "Traceback (most recent call last):",
    '  File "/job/train.py", line 3, in <module>',
    "    from transformers import Trainer",
    "ImportError: Using the Trainer with PyTorch requires accelerate>=1.1.0",
]


def test_a_plain_scripts_failure_is_summed_up_by_its_exception_line(tmp_path) -> None:
    def prepare(agent: ScriptedAgent) -> None:
        agent._logs_specs = TailedSpecs(_TRACEBACK, log_dir=str(tmp_path / "logs"))

    rounds = [Round(nodes=1, ticks=[{0: 1}])]
    outcome, logs, _ = run(rounds, tmp_path, max_restarts=0, prepare=prepare)
    (failed,) = named(logs, "worker.failed")
    assert failed["error_summary"] == _TRACEBACK[-1]
    assert outcome.error == f"worker rank 0 failed: {_TRACEBACK[-1]}"  # job.finished.error


def test_a_configuration_error_from_the_error_file_is_one_line_without_its_callstack(
    tmp_path, monkeypatch
) -> None:
    """Regression: job.finished's error was the repr of @record's dict, py_callstack and all."""
    from elastic_trainer.errors import ConfigError
    from elastic_trainer.worker.failure import record_error

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise ConfigError("--batch-size=0 must be positive: pass --batch-size 1 or more")
    except ConfigError as exc:
        record_error(exc)  # what the worker's session does before it exits 2

    def prepare(agent: ScriptedAgent) -> None:
        agent.error_file = str(error_file)

    rounds = [Round(nodes=1, ticks=[{0: protocol.EXIT_CONFIG}])]
    outcome, logs, _ = run(rounds, tmp_path, prepare=prepare)
    line = "ConfigError: --batch-size=0 must be positive: pass --batch-size 1 or more"
    assert named(logs, "worker.failed")[0]["error_summary"] == line
    assert outcome.error == f"worker rank 0 refused its configuration (exit 2): {line}"


@pytest.mark.parametrize("in_session", [True, False], ids=["session", "plain-script"])
@pytest.mark.parametrize("requested_at_tick", [0, 1])
def test_a_stop_request_preempts_and_leaves_the_rendezvous(
    tmp_path, requested_at_tick, in_session
) -> None:
    def stop_soon(agent: ScriptedAgent) -> None:
        def request(timeout: float) -> None:
            if agent.script.tick >= requested_at_tick:
                agent.stop.requested, agent.stop.signal_name = True, "SIGTERM"
                if in_session:  # what a TrainingSession publishes when it starts
                    progress = Path(agent.stop.control_dir) / protocol.progress_file(0)
                    progress.write_text('{"step": 0, "epoch": 0, "restored_step": null}')

        agent.stop.on_wait = request

    rounds = [Round(nodes=1, ticks=[{0: RUNNING}] * 3)]
    outcome, logs, agent = run(rounds, tmp_path, prepare=stop_soon)
    assert (outcome.status, outcome.exit_code) == ("preempted", 143)
    (received,) = named(logs, "preemption.received")
    assert received["signal"] == "SIGTERM"
    assert agent._worker_group.spec.rdzv_handler.left
    # a session reads the stop file; an unmodified script gets SIGTERM at once, as torchrun's
    assert received["signalled_ranks"] == agent.procs.terminated == ([] if in_session else [0])


def test_a_silent_peer_is_dropped_once_confirmed_without_waiting_for_a_timeout(tmp_path) -> None:
    """node1 stops beating (frozen or cut off: no reset, our worker just blocks): after two
    checks one interval apart the group re-forms without it, for free."""
    running = {0: RUNNING}
    rounds = [Round(nodes=2, ticks=[running] * 12), Round(nodes=1, ticks=[{0: OK}])]
    outcome, logs, agent = run(rounds, tmp_path, silent=("node1",), silent_from=5)
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    assert agent._worker_group.spec.rdzv_handler.marked_dead == [{"node1"}]  # no last call
    (silent,) = named(logs, "peer.silent")
    assert silent["nodes"] == ["node1"]
    assert named(logs, "group.restarting")[0]["reason"] == "membership"
    assert named(logs, "membership.changed")[0]["reason"] == "node_lost"
    assert not named(logs, "worker.failed")


def test_a_peer_whose_connection_closed_is_dropped_at_once(tmp_path) -> None:
    """node1's process died: its presence connection closed. We re-form at the next tick,
    for free, before our worker's collective fails, and the rendezvous is told it is dead."""
    ticks = [{0: RUNNING}] * 5 + [{0: 1}]  # our worker would fail on the dead peer later
    rounds = [Round(nodes=2, ticks=ticks), Round(nodes=1, ticks=[{0: OK}])]
    outcome, logs, agent = run(rounds, tmp_path, closed=("node1",), closed_from=2)
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    (lost,) = named(logs, "peer.lost")
    assert (lost["nodes"], lost["how"]) == (["node1"], "connection_closed")
    assert named(logs, "membership.changed")[0]["reason"] == "node_lost"
    assert not named(logs, "worker.failed")
    assert agent._worker_group.spec.rdzv_handler.marked_dead == [{"node1"}]


def test_a_failure_with_the_budget_spent_and_a_closed_peer_needs_no_heartbeat_wait(
    tmp_path,
) -> None:
    """Our worker failed and the budget is spent: a lost peer would explain it. Its closed
    connection says so at once; no waiting for its heartbeats to expire."""
    rounds = [Round(nodes=2, ticks=[{0: 1}]), Round(nodes=1, ticks=[{0: OK}])]

    def clock_moves_with_waits(agent: ScriptedAgent) -> None:
        def advance(timeout: float) -> None:
            agent.clock += timeout

        agent.stop.on_wait = advance

    outcome, logs, agent = run(
        rounds, tmp_path, max_restarts=0, closed=("node1",), prepare=clock_moves_with_waits
    )
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    assert 0.5 not in agent.stop.waits  # wait_for_lost_peer's polls never ran
    assert named(logs, "membership.changed")[0]["reason"] == "node_lost"


def test_a_peer_whose_connection_closes_while_we_check_is_a_lost_node(tmp_path) -> None:
    """A node's whole tree SIGKILLed, our budget spent: our worker's collective saw its worker
    die before the kernel had closed its agent's connection (tearing a large process down
    takes a moment). The peer check must see the connection close while it waits, not only
    the heartbeats' expiry: a lost node, re-formed for free, not a failed job."""
    rounds = [Round(nodes=2, ticks=[{0: 1}]), Round(nodes=1, ticks=[{0: OK}])]

    def closes_during_the_peer_check(agent: ScriptedAgent) -> None:
        def wait(timeout: float) -> None:
            if timeout == 0.5:  # wait_for_lost_peer's poll: the connection closes now
                agent.script.closed = ("node1",)
            agent.clock += timeout

        agent.stop.on_wait = wait

    outcome, logs, agent = run(
        rounds, tmp_path, max_restarts=0, prepare=closes_during_the_peer_check
    )
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    assert agent.stop.waits.count(0.5) == 1  # seen at the next poll, not at the expiry
    (lost,) = named(logs, "peer.lost")
    assert (lost["nodes"], lost["how"]) == (["node1"], "connection_closed")
    assert named(logs, "membership.changed")[0]["reason"] == "node_lost"


def test_a_peer_whose_connection_closes_after_our_restart_began_is_still_named(tmp_path):
    """Regression (a flaky e2e test): the lost node's workers died a moment before its agent,
    so our worker failed first and the restart began (budget left: no peer check) before its
    connection closed. ``peer.lost`` still names it, once, when we re-form."""
    rounds = [Round(nodes=2, ticks=[{0: 1}]), Round(nodes=1, ticks=[{0: OK}])]

    def closes_as_we_restart(agent: ScriptedAgent) -> None:
        stop_workers = agent._stop_workers

        def stopping(worker_group: Any, *args: Any, **kwargs: Any) -> None:
            agent.script.closed = ("node1",)
            stop_workers(worker_group, *args, **kwargs)

        agent._stop_workers = stopping

    outcome, logs, _ = run(rounds, tmp_path, prepare=closes_as_we_restart)
    assert outcome.status == "succeeded"
    assert named(logs, "worker.failed") and named(logs, "group.restarting")
    (lost,) = named(logs, "peer.lost")
    assert (lost["nodes"], lost["how"]) == (["node1"], "connection_closed")


def test_one_late_heartbeat_is_not_a_lost_node(tmp_path) -> None:
    """Stale on one check only (a loaded machine): no re-formation."""
    from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch

    now = [10.0]
    stale = [{"node1"}, set(), {"node1"}, {"node1"}]

    class Handler:
        this_node = "node0"

        def participants(self):
            return {"node0", "node1"}

        def stale_peers(self, members):
            return stale.pop(0)

    watch = MembershipWatch(
        Handler(), endpoint="x", check_every_s=1.0, dead_after_s=3.0, clock=lambda: now[0]
    )
    watch.round_formed()
    seen = []
    for _ in range(4):
        now[0] += 3.0
        seen.append(watch.silent_peers())
    assert seen == [set(), set(), set(), {"node1"}]


def test_a_member_checks_the_heartbeats_of_the_two_next_members_only(tmp_path) -> None:
    """Every member read every member's heartbeat each second: N² reads through the store.
    Each checks the next two in node order; each member is checked by two others."""
    from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch

    now = [10.0]
    asked: list[set[str]] = []

    class Handler:
        this_node = "node1"

        def participants(self):
            return {f"node{i}" for i in range(6)}

        def stale_peers(self, members):
            asked.append(set(members))
            return {"node5"} & set(members)

    watch = MembershipWatch(
        Handler(), endpoint="x", check_every_s=1.0, dead_after_s=3.0, clock=lambda: now[0]
    )
    watch.round_formed()
    for _ in range(2):
        now[0] += 3.0
        assert watch.silent_peers() == set()  # node5 is not ours to check
    assert asked == [{"node2", "node3"}] * 2
    Handler.this_node = "node4"
    watch.round_formed()
    for _ in range(2):
        now[0] += 3.0
        found = watch.silent_peers()
    assert asked[-1] == {"node5", "node0"} and found == {"node5"}


def test_a_new_round_reads_the_names_and_addresses_of_its_new_members_only(tmp_path) -> None:
    """Every member read every member's name and presence address after each round: N²
    reads per re-form. A node's never change: only a new member's are read."""
    from elastic_trainer.contract.auth import JobKey
    from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch

    asked: list[tuple[str, set[str]]] = []
    members = [{"node0", "node1", "node2"}]

    class Handler:
        this_node = "node0"
        job_key = JobKey.generate()

        def participants(self):
            return set(members[0])

        def node_labels(self, nodes):
            asked.append(("labels", set(nodes)))
            return {n: n.upper() for n in nodes}

        def presence_addresses(self, nodes):
            asked.append(("presence", set(nodes)))
            return {n: "127.0.0.1:1" for n in nodes}  # nothing listens: lost, not read again

        def publish_presence(self, address):
            pass

        def store_host_member(self):
            return None

    watch = MembershipWatch(Handler(), endpoint="x", check_every_s=1.0, dead_after_s=3.0)
    watch.open_presence("127.0.0.1", Handler.job_key, max_nodes=4)
    try:
        watch.round_formed()
        members[0] = {"node0", "node1", "node2", "node3"}
        watch.round_formed()
        members[0] = {"node0", "node2", "node3"}
        watch.round_formed()
    finally:
        watch.close()
    assert asked == [
        ("labels", {"node0", "node1", "node2"}),
        ("presence", {"node1", "node2"}),
        ("labels", {"node3"}),
        ("presence", {"node3"}),
    ]
    assert watch.label("node3") == "NODE3"
    assert len(watch.addresses) == 3  # the two others' and ours


def test_a_peer_that_said_goodbye_is_leaving_not_silent_for_its_grace_period(tmp_path) -> None:
    """Regression: Ctrl-C of a TrainingSession node stopped its heartbeats at once, and after
    dead_after_s its peers re-formed without it (peer.silent, node_lost) while its workers
    were still finishing the step of their final snapshot, which then never came. Past its
    grace period it is silent after all (regression: a thawed node whose peers had finished
    waited for them forever)."""
    from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch

    now = [10.0]

    class Handler:
        this_node = "node0"

        def participants(self):
            return {"node0", "node1"}

        def stale_peers(self, members):
            return {"node1"} & set(members)

    class Peers:
        def lost(self):
            return set()

        def left(self):
            return {"node1"}

    watch = MembershipWatch(
        Handler(),
        endpoint="x",
        check_every_s=1.0,
        dead_after_s=3.0,
        leaving_grace_s=25.0,
        clock=lambda: now[0],
    )
    watch.round_formed()
    watch.peers = Peers()  # type: ignore[assignment]  # only its lost() and left()
    seen = []
    for _ in range(8):  # every 3 s: the goodbye is heard at 13 s, its grace ends at 38 s
        now[0] += 3.0
        seen.append(watch.silent_peers())
    assert seen == [set()] * 8 and watch.left_peers() == {"node1"}
    later = []
    for _ in range(3):
        now[0] += 3.0
        later.append(watch.silent_peers())
    assert later[-1] == {"node1"}


class _Pool(WarmPool):
    """A warm pool without a process: counts the waits for it to be ready."""

    def __init__(self) -> None:  # no process, no socket: nothing of WarmPool's own state
        self.waits = 0
        self.proc = SimpleNamespace(pid=4242)  # type: ignore[assignment]  # only its pid

    @property
    def ready(self) -> bool:
        return False

    def wait_ready(self, timeout: float, cancelled: Callable[[], bool] = lambda: False) -> bool:
        self.waits += 1
        return True


class _Holder:
    def __init__(self, state: Any) -> None:
        self.state = state

    def sync(self) -> None:
        if isinstance(self.state, Exception):
            raise self.state


class _Rdzv:
    """What torch_compat.rendezvous_state reads of a DynamicRendezvousHandler."""

    def __init__(self, state: Any) -> None:
        self._heartbeat_lock = threading.Lock()
        self._state_holder = _Holder(state)


def _first_join(state: Any, tmp_path: Path) -> int:
    pool = _Pool()
    script = Script([Round(nodes=1, ticks=[{0: OK}])])
    agent = ScriptedAgent(script, RunConfig(), tmp_path, pool=pool)
    agent._warm_up_before_joining(_Rdzv(state))
    agent._warm_up_before_joining(_Rdzv(state))
    return pool.waits


def test_a_first_join_into_a_running_job_waits_for_the_pool_once(tmp_path):
    running = SimpleNamespace(complete=True, participants={"other": 0})
    starting = SimpleNamespace(complete=False, participants={})
    assert _first_join(running, tmp_path / "running") == 1  # a second join re-forms: no wait
    assert _first_join(starting, tmp_path / "starting") == 0


def test_a_store_that_does_not_answer_yet_is_joined_at_once_as_before(tmp_path):
    assert _first_join(ConnectionError("store not up yet"), tmp_path) == 0


@pytest.mark.parametrize(("nodes", "announced"), [(("1", "4"), True), (("2", "2"), False)])
def test_a_first_round_that_waits_for_more_nodes_says_why(nodes, announced):
    from elastic_trainer.supervisor.cli import args as args_mod

    cfg = args_mod.parse(["--min-nodes", nodes[0], "--max-nodes", nodes[1], "x.py"])
    with capture_logs() as logs:
        ElasticTrainAgent._announce_first_round(SimpleNamespace(_cfg=cfg))
    waiting = [e for e in logs if e["event"] == "rendezvous.waiting"]
    assert bool(waiting) is announced
    if announced:
        assert waiting[0]["wait_s"] == cfg.rdzv.first_last_call_timeout
        assert "--max-nodes equal to --min-nodes starts at once" in waiting[0]["hint"]


def test_a_reform_never_waits_for_a_copy_from_a_plain_script(tmp_path, monkeypatch):
    """Regression: every restart of a plain script waited the whole COPY_WAIT_S."""
    from elastic_trainer.supervisor.agent import control_files

    def no_wait(_s: float) -> None:
        raise AssertionError("waited for a worker that never answers")

    monkeypatch.setattr(control_files.time, "sleep", no_wait)
    alive = lambda: {0: None, 1: None}  # noqa: E731
    control_files.await_copies(str(tmp_path), alive)  # neither said it would answer
    (tmp_path / protocol.copier_file(1)).touch()  # a session that will answer
    with pytest.raises(AssertionError, match="never answers"):
        control_files.await_copies(str(tmp_path), alive)
    (tmp_path / protocol.copied_file(1)).write_text("copied")
    control_files.await_copies(str(tmp_path), alive)


class OldWorkers:
    """The tracker a join hands the old attempt's workers to (``ProcessTracker.handover``),
    scripted: they hand off when signalled, or (``stuck``) never; records what happened when."""

    def __init__(self, journal: list[str], new_dir: Callable[[], str], stuck: bool) -> None:
        self.journal, self.new_dir, self.stuck = journal, new_dir, stuck
        self.signalled = False

    def _released(self) -> bool:
        return not (Path(self.new_dir()) / protocol.HANDOFF_FILE).exists()

    def signal_roots(self, sig: Any) -> None:
        ready = (Path(self.new_dir()) / protocol.handoff_ready_file(0)).exists()
        self.journal.append(f"signal old (new ready: {ready}, released: {self._released()})")
        self.signalled = True

    def poll_codes(self) -> dict[int, int | None]:
        return {0: 0 if self.signalled and not self.stuck else None}

    def kill(self, *, grace_s: float, reap: bool = True) -> None:
        self.journal.append(f"kill old (released: {self._released()}, reap: {reap})")


def _join_alongside(tmp_path, *, stuck: bool) -> tuple[list[dict[str, Any]], list[str]]:
    from elastic_trainer.contract.config import TorchrunOptions

    cfg = RunConfig(
        max_restarts=3,
        monitor_interval=0.01,
        torchrun=TorchrunOptions(shutdown_timeout=0.05),  # the old workers' grace, here
    )
    rounds = [
        Round(nodes=1, ticks=[{0: RUNNING}, {0: RUNNING}], waiting=[0, 1]),
        Round(nodes=2, ticks=[{0: RUNNING}, {0: OK}]),
    ]
    agent = ScriptedAgent(Script(rounds), cfg, tmp_path)
    journal: list[str] = []
    alongside: list[str] = []  # the new attempt's control folder
    old = OldWorkers(journal, lambda: alongside[0], stuck)
    agent.procs.handover = lambda: old  # type: ignore[method-assign]
    spawn_sessions(agent, journal, alongside, gets_ready=lambda: True)
    with capture_logs() as logs:
        outcome = agent.supervise()
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    return logs, journal


def spawn_sessions(
    agent: ScriptedAgent, journal: list[str], alongside: list[str], gets_ready: Callable[[], bool]
) -> None:
    """The agent's workers, as TrainingSessions: each says its successor waits; one started
    alongside (its folder goes to ``alongside``) says it is ready if ``gets_ready()``."""
    spawn = agent._spawn

    def spawn_session(worker_group: Any) -> Any:
        folder = Path(agent._stop.control_dir or "")
        (folder / protocol.handoff_aware_file(0)).touch()
        if (folder / protocol.HANDOFF_FILE).exists():
            alongside.append(str(folder))
            journal.append(f"new started alongside (round {agent.script.index})")
            if gets_ready():
                (folder / protocol.handoff_ready_file(0)).touch()
        return spawn(worker_group)

    agent._spawn = spawn_session  # type: ignore[method-assign]


def test_a_join_starts_the_new_sessions_alongside_and_stops_the_old_once_they_are_ready(tmp_path):
    logs, journal = _join_alongside(tmp_path, stuck=False)
    assert journal == [
        "new started alongside (round 1)",
        "signal old (new ready: True, released: False)",  # the new ones wait meanwhile
        "kill old (released: True, reap: False)",  # only their exit was left
    ]
    started = named(logs, "workers.started")
    assert [(e["world_size"], e["alongside"]) for e in started] == [(1, False), (2, True)]
    (handed,) = named(logs, "group.handed_over")
    assert handed["ready"] is True
    # the scripted workers report no step: the event comes as their attempt ends, no pause
    assert handed["pause_s"] is None


def test_old_workers_that_do_not_hand_over_are_killed_before_the_new_ones_go_on(tmp_path):
    logs, journal = _join_alongside(tmp_path, stuck=True)
    assert journal[:3] == [
        "new started alongside (round 1)",
        "signal old (new ready: True, released: False)",
        "kill old (released: False, reap: False)",  # a snapshot write of theirs must not
    ]  # outlive the hand-over
    assert named(logs, "group.handed_over")


def test_a_round_that_moves_on_before_the_new_workers_are_ready_keeps_the_old_ones(tmp_path):
    """A joining node whose worker dies while the new group forms leaves the round and
    waits for the next: the running nodes' new workers can never get their group. The old
    ones, never stopped, train on (not 60 s of waiting, then a group that waits in
    ``init_process_group`` for the collective timeout), and the next round forms alongside
    them again."""
    from elastic_trainer.contract.config import TorchrunOptions

    cfg = RunConfig(
        max_restarts=3,
        monitor_interval=0.01,
        torchrun=TorchrunOptions(shutdown_timeout=0.05),
    )
    rounds = [
        Round(nodes=1, ticks=[{0: RUNNING}, {0: RUNNING}], waiting=[0, 1]),
        Round(nodes=2, ticks=[{0: RUNNING}, {0: RUNNING}], waiting=[1, 1]),  # it left again
        Round(nodes=2, ticks=[{0: RUNNING}, {0: OK}]),
    ]
    agent = ScriptedAgent(Script(rounds), cfg, tmp_path)
    journal: list[str] = []
    alongside: list[str] = []
    old = OldWorkers(journal, lambda: alongside[-1], stuck=False)
    agent.procs.handover = lambda: old  # type: ignore[method-assign]
    agent.procs.take_back = lambda tracker: journal.append("old kept")  # type: ignore[method-assign]
    kill = agent.procs.kill

    def kill_new(*, grace_s: float, reap: bool = True) -> None:
        journal.append(f"kill new (grace {grace_s}, reap: {reap})")
        kill(grace_s=grace_s)

    agent.procs.kill = kill_new  # type: ignore[method-assign]
    # only the round after the one that moved on forms
    spawn_sessions(agent, journal, alongside, gets_ready=lambda: agent.script.index == 2)
    with capture_logs() as logs:
        outcome = agent.supervise()
    assert (outcome.status, outcome.restarts) == ("succeeded", 0)
    assert journal[:5] == [
        "new started alongside (round 1)",
        # they never touched any state: no grace; and the old ones, which it no longer
        # tracks, are no strays to reap
        "kill new (grace 0, reap: False)",
        "old kept",  # never signalled: they trained on
        "new started alongside (round 2)",
        "signal old (new ready: True, released: False)",
    ], journal
    (abandoned,) = named(logs, "group.handover_abandoned")
    assert abandoned["reason"] == "round_moved_on"
    assert not Path(alongside[0]).exists()  # the abandoned attempt's folder is gone
    (handed,) = named(logs, "group.handed_over")
    assert handed["ready"] is True
    restarts = named(logs, "group.restarting")
    assert [e["reason"] for e in restarts] == ["membership", "membership"]  # no failure


def test_a_crash_asks_the_survivors_for_their_copies_before_killing_them(tmp_path):
    """Regression: a rank's crash gave the rest of the node SIGTERM and 1 s, then SIGKILL,
    without asking for their just-in-time copies: a survivor still writing one (a large
    state) was killed in it and the next group restored from storage."""
    fifo = tmp_path / protocol.copy_now_fifo(1)
    os.mkfifo(fifo)
    reading = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the survivor's watcher
    (tmp_path / protocol.copier_file(1)).touch()
    (tmp_path / protocol.copied_file(1)).write_text("copied")  # its answer: no wait
    requested_at_kill: list[bytes] = []

    def kill(*, grace_s: float) -> None:
        try:
            requested_at_kill.append(os.read(reading, 8))
        except BlockingIOError:
            requested_at_kill.append(b"")

    agent = SimpleNamespace(
        _poll_codes=lambda: {0: 1, 1: RUNNING},  # rank 0 crashed, rank 1 runs on
        _peer_stop_seen=None,
        _cfg=RunConfig(),
        _stop=SimpleNamespace(control_dir=str(tmp_path)),
        _procs=SimpleNamespace(kill=kill),
        _collect=lambda wg: RunResult(state=WorkerState.FAILED),
    )
    agent._await_copies = lambda: ElasticTrainAgent._await_copies(agent)
    try:
        result = ElasticTrainAgent._monitor_workers(agent, None)
    finally:
        os.close(reading)
    assert result.state == WorkerState.FAILED
    assert requested_at_kill == [b"x"]  # the copy was asked for before the kill
