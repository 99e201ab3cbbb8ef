"""TrainingSession in one process (a world of one on an in-memory store, no launcher)."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_trainer.contract import protocol
from elastic_trainer.errors import ConfigError, SamplerStateError
from elastic_trainer.supervisor.core.watchdog import parse_progress
from elastic_trainer.worker.context import WorkerContext, WorkerSettings
from elastic_trainer.worker.progress import (
    STOP_VOTE_PREEMPTED,
    peer_stop_reason,
    stop_exit_code,
    stop_vote,
)
from elastic_trainer.worker.sampler import ElasticSampler
from elastic_trainer.worker.session import TrainingSession


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _data(n=10):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Job:
    def __init__(self, tmp_path, *, max_micro=None, control_dir=None, memory_dir=None, **kwargs):
        torch.manual_seed(0)
        self.data = _data()
        self.model = nn.Linear(3, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.sampler = ElasticSampler(
            self.data, seed=1, global_batch_size=4, max_micro_batch_size=max_micro
        )
        self.session = TrainingSession(
            {"model": self.model, "optimizer": self.optimizer},
            self.sampler,
            context=WorkerContext(
                settings=WorkerSettings(control_dir=control_dir, memory_dir=memory_dir)
            ),
            snapshot_dir=str(tmp_path / "snapshots"),
            audit_dir=str(tmp_path / "audit"),
            configure_logs=False,
            **kwargs,
        )

    def train(self, epochs=10, steps=None):
        loader = DataLoader(
            self.data, batch_size=self.sampler.micro_batch_size, sampler=self.sampler
        )
        done = 0
        for _ in self.session.epochs(epochs):
            for x, y in loader:
                with self.session.accumulate(self.model):
                    loss = nn.functional.mse_loss(self.model(x), y)
                    self.session.scale_loss(loss, len(x)).backward()
                if self.session.step_ready:
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                    self.session.step_done()
                    done += 1
                    if self.session.should_stop or done == steps:
                        return


def test_a_new_session_resumes_model_sampler_and_step(tmp_path):
    first = Job(tmp_path, snapshot_every=2)
    first.train(steps=4)  # epoch 0 has steps of 4, 4, 2 samples; step 4 is epoch 1's first
    assert (first.session.step, first.sampler.epoch, first.sampler.cursor) == (4, 1, 4)
    first.session.finish()
    with capture_logs() as logs:
        second = Job(tmp_path)
    assert (second.session.step, second.session.restored_step) == (4, 4)
    assert (second.sampler.epoch, second.sampler.cursor) == (1, 4)
    for name, value in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], value)
    restored = [e for e in logs if e["event"] == "snapshot.restored"]
    assert restored and restored[0]["step"] == 4
    second.session.finish()


def test_resumed_training_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    whole = Job(tmp_path / "whole")
    whole.train(epochs=3)
    whole.session.finish()
    part = Job(tmp_path / "parts", max_steps=5)
    part.train(epochs=3)
    part.session.finish()
    rest = Job(tmp_path / "parts")
    rest.train(epochs=3)
    assert rest.session.step == whole.session.step == 9
    for name, value in whole.model.state_dict().items():
        assert torch.equal(rest.model.state_dict()[name], value)
    rest.session.finish()


def test_gradient_accumulation_gives_the_same_update_as_one_batch(tmp_path):
    one = Job(tmp_path / "one")
    one.train(epochs=2)
    one.session.finish()
    accumulated = Job(tmp_path / "acc", max_micro=1)  # 4 micro-batches of 1 per step
    assert accumulated.sampler.accumulation_steps == 4
    accumulated.train(epochs=2)
    accumulated.session.finish()
    for name, value in one.model.state_dict().items():
        torch.testing.assert_close(accumulated.model.state_dict()[name], value)


def test_stop_file_stops_with_a_final_snapshot_and_the_exit_code(tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    job = Job(tmp_path, control_dir=str(control), snapshot_every=100)
    (control / protocol.STOP_FILE).touch()
    with capture_logs() as logs:
        job.train(steps=5)
    assert job.session.should_stop and job.session.step == 1
    assert any(e["event"] == "session.stopping" and e["step"] == 1 for e in logs)
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["step-000000000001"]
    progress = parse_progress((control / protocol.progress_file(0)).read_text())
    assert progress is not None
    assert (progress.step, progress.epoch, progress.restored_step) == (1, 0, None)
    with pytest.raises(SystemExit) as exited:
        job.session.finish()
    assert exited.value.code == protocol.EXIT_PREEMPTED


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_the_worker_is_an_own_node_stop(tmp_path, sig):
    signal.signal(sig, signal.SIG_DFL)  # as in a fresh worker (other tests may leave theirs)
    job = Job(tmp_path, snapshot_every=100)
    job.train(steps=2)
    os.kill(os.getpid(), sig)  # Slurm / a forwarding init signals the worker itself
    with capture_logs() as logs:
        job.train(steps=5)
    # the step in progress finishes, the ranks agree, one final snapshot, the stop exit code
    assert (job.session.stop_reason, job.session.step) == ("preempted", 3)
    stopping = [e for e in logs if e["event"] == "session.stopping"]
    assert [(e["step"], e["signal"]) for e in stopping] == [(3, sig.name)]
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["step-000000000003"]
    with pytest.raises(SystemExit) as exited:
        job.session.finish()
    assert exited.value.code == protocol.EXIT_PREEMPTED
    assert signal.getsignal(sig) is signal.SIG_DFL  # handed back once the session is done


def test_a_sigterm_from_the_supervisor_restarting_is_labelled_restarting(tmp_path):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    control = tmp_path / "control"
    control.mkdir()
    job = Job(tmp_path, control_dir=str(control), snapshot_every=100)
    job.train(steps=2)
    (control / protocol.RESTART_FILE).touch()  # what the agent writes before stopping workers
    os.kill(os.getpid(), signal.SIGTERM)
    with capture_logs() as logs:
        job.train(steps=5)
    # same stop as a preemption (step boundary, final snapshot), but not called one
    assert (job.session.stop_reason, job.session.step) == ("restarting", 3)
    stopping = [e for e in logs if e["event"] == "session.stopping"]
    assert [(e["reason"], e["signal"]) for e in stopping] == [("restarting", "SIGTERM")]
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["step-000000000003"]
    with pytest.raises(SystemExit):
        job.session.finish()


def test_a_scripts_own_signal_handler_is_left_alone(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        job = Job(tmp_path, snapshot_every=100)
        job.train(steps=1)
        os.kill(os.getpid(), signal.SIGTERM)
        job.train(steps=2)
        assert seen == [signal.SIGTERM]
        assert job.session.stop_reason is None and job.session.step == 3
        assert job.session.finish() == 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_max_steps_is_a_normal_finish(tmp_path):
    job = Job(tmp_path, max_steps=2, exit_on_stop=True)
    job.train()
    assert job.session.stop_reason == "max_steps"
    assert job.session.finish() == 0
    assert (tmp_path / "snapshots" / "step-000000000002").is_dir()


@pytest.mark.parametrize(
    ("reasons", "peer_reason"),
    [
        (["restarting"], "peer_restarting"),
        (["restarting"] * 4096, "peer_restarting"),  # however many restart
        (["preempted"], "peer_preempted"),
        (["restarting", "preempted", None], "peer_preempted"),  # one node goes away: storage
    ],
)
def test_a_peer_stop_says_whether_any_node_goes_away(reasons, peer_reason):
    votes = sum(stop_vote(r) for r in reasons)
    assert votes > 0
    assert peer_stop_reason(votes) == peer_reason
    assert (votes >= STOP_VOTE_PREEMPTED) == ("preempted" in reasons)
    assert stop_vote(None) == 0


def test_a_job_that_ends_commits_its_final_snapshot_with_the_memory_tier_on(tmp_path):
    """Regression: the restart stop's "resume from memory" check ran at every finish, and a
    job that ended took its just-in-time copy in memory (freed at exit) for its final
    snapshot: nothing was saved to storage."""
    memory = tmp_path / "memory"
    memory.mkdir(mode=0o700)
    job = Job(tmp_path, max_steps=3, memory_dir=str(memory))
    assert job.session._memory is not None  # the tier is on, as under the supervisor
    job.train()
    assert job.session.stop_reason == "max_steps"
    assert job.session.finish() == 0
    assert (tmp_path / "snapshots" / "step-000000000003").is_dir()


def test_exit_codes_of_a_coordinated_stop():
    assert stop_exit_code("preempted") == protocol.EXIT_PREEMPTED
    assert stop_exit_code("peer_preempted") == protocol.EXIT_PEER_PREEMPTED
    # a peer's restart is no reason for this node's supervisor to think the job is done
    assert stop_exit_code("peer_restarting") == protocol.EXIT_PEER_PREEMPTED
    assert stop_exit_code("max_steps") is None
    assert stop_exit_code(None) is None


class _FakeDDP:
    def __init__(self):
        self.no_sync_calls = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.no_sync_calls += 1
        yield


def test_accumulate_skips_the_all_reduce_on_all_but_the_last_micro_batch(tmp_path):
    job = Job(tmp_path, max_micro=1)
    fake = _FakeDDP()
    readiness = []
    for _ in range(4):
        with job.session.accumulate(fake):
            pass
        readiness.append(job.session.step_ready)
    assert fake.no_sync_calls == 3
    assert readiness == [False, False, False, True]
    job.session.step_done()
    assert not job.session.step_ready
    job.session.close()


def test_step_done_after_too_few_micro_batches_names_the_fix(tmp_path):
    job = Job(tmp_path, max_micro=2)
    with job.session.accumulate(job.model):
        pass
    with pytest.raises(ConfigError, match="after 1 micro-batches but this rank's share needs 2"):
        job.session.step_done()
    job.session.close()


def test_plain_sampler_needs_the_step_sample_count(tmp_path):
    sampler = ElasticSampler(range(10))
    session = TrainingSession({}, sampler, context=WorkerContext(), configure_logs=False)
    with pytest.raises(ConfigError, match="step_done\\(num_samples=len\\(batch\\)\\)"):
        session.step_done()
    session.step_done(num_samples=3)
    assert sampler.cursor == 3
    assert session.scale_loss(2.0, 3) == 2.0  # plain mode leaves the loss alone
    session.finish()


def test_reserved_state_names_are_refused():
    with pytest.raises(ConfigError, match="reserved"):
        TrainingSession({"elastic_sampler": 1}, context=WorkerContext(), configure_logs=False)


def test_padding_rank_has_zero_loss_scale():
    # rank 3 of 4 holds only a padding sample in the epoch's 2-sample last step
    sampler = ElasticSampler(range(10), num_replicas=4, rank=3, global_batch_size=8)
    sampler.complete_step()
    assert sampler.current_share().padding
    assert sampler.current_share().loss_scale == 0.0


def test_an_error_in_the_loop_skips_the_final_snapshot(tmp_path):
    job = Job(tmp_path, snapshot_every=2)
    with pytest.raises(RuntimeError, match="boom"), job.session:
        job.train(steps=3)
        raise RuntimeError("boom")
    # the periodic snapshot of step 2 committed; no final one at the crashed step 3
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["step-000000000002"]


def test_resuming_at_max_steps_trains_nothing_more(tmp_path):
    first = Job(tmp_path, max_steps=2)
    first.train()
    first.session.finish()
    again = Job(tmp_path, max_steps=2)
    assert again.session.should_stop
    again.train()
    assert again.session.step == 2
    again.session.finish()


def test_a_snapshot_without_sampler_state_is_refused_with_a_sampler(tmp_path):
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = TrainingSession(
        {"model": model, "optimizer": optimizer},
        context=WorkerContext(),
        snapshot_dir=str(tmp_path / "snapshots"),
        configure_logs=False,
    )
    plain.step_done()
    plain.finish()
    with pytest.raises(SamplerStateError, match="has no sampler state"):
        Job(tmp_path)


def test_a_second_signal_takes_the_default_action(monkeypatch):
    from elastic_trainer.worker import progress

    killed = []
    monkeypatch.setattr(progress.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # other tests may leave theirs
    signals = progress.StopSignals()
    signals.install()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)
        assert (signals.received, killed) == ("SIGTERM", [])
        handler(signal.SIGTERM, None)  # asked again: hand the signal back and re-raise it
        assert killed == [(os.getpid(), signal.SIGTERM)]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signals.uninstall()
        signal.signal(signal.SIGTERM, previous)


def test_the_operators_flag_wins_over_the_scripts_keyword_and_says_so(tmp_path):
    operator = WorkerSettings(snapshot_every=5, snapshot_dir=str(tmp_path / "ops"))
    with capture_logs() as logs:
        session = TrainingSession(
            {"model": nn.Linear(1, 1)},
            context=WorkerContext(settings=operator),
            snapshot_dir=str(tmp_path / "script"),
            snapshot_every=50,
            keep=2,
            configure_logs=False,
        )
    session.close()
    assert session.snapshot_every == 5
    assert session._snapshots.url.endswith("/ops")
    overridden = {e["setting"]: e for e in logs if e["event"] == "session.setting_overridden"}
    assert overridden.keys() == {"snapshot_every", "snapshot_dir"}  # keep: operator said nothing
    assert (
        overridden["snapshot_every"]["script_value"],
        overridden["snapshot_every"]["operator_value"],
    ) == (50, 5)


def test_without_flags_the_script_keyword_then_the_default_applies(tmp_path):
    session = TrainingSession(
        {"model": nn.Linear(1, 1)}, context=WorkerContext(), snapshot_every=50, configure_logs=False
    )
    session.close()
    assert session.snapshot_every == 50
    default = TrainingSession(
        {"model": nn.Linear(1, 1)}, context=WorkerContext(), configure_logs=False
    )
    default.close()
    assert default.snapshot_every == protocol.DEFAULT_SNAPSHOT_EVERY


def test_another_jobs_snapshot_folder_is_a_configuration_error(tmp_path):
    from snapshots import Owner, SnapshotStore

    folder = str(tmp_path / "snaps")
    SnapshotStore(folder, owner=Owner(job_id="job-a", run_token="1")).close()
    theirs = WorkerSettings(job_id="job-b", snapshot_dir=folder)
    with pytest.raises(ConfigError, match="job-a") as info:
        TrainingSession(
            {"model": nn.Linear(1, 1)}, context=WorkerContext(settings=theirs), configure_logs=False
        )
    assert info.value.exit_code == 2 and "job-b" in str(info.value)


@pytest.mark.parametrize("ending", ["max_steps", "preempted"])
def test_disk_kept_for_the_next_save_is_freed_only_when_training_ends(tmp_path, ending):
    control = tmp_path / "control"
    control.mkdir()
    job = Job(tmp_path, snapshot_every=1, keep=1, max_steps=3, control_dir=str(control),
              exit_on_stop=False)  # fmt: skip
    job.model.register_buffer("big", torch.zeros(1 << 20))  # 4 MiB: a file worth reusing
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if ending == "preempted":
            job.train(steps=2)
            (control / protocol.STOP_FILE).touch()
            os.kill(os.getpid(), signal.SIGTERM)
        job.train()
        with capture_logs() as logs:
            job.session.finish()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert job.session.stop_reason == ending
    aside = tmp_path / "snapshots" / ".reuse"
    released = [e for e in logs if e["event"] == "snapshot.reserved_released"]
    if ending == "max_steps":
        assert not aside.exists() and released and released[0]["bytes"] > 1 << 22
    else:
        assert any(aside.iterdir()) and not released  # the job goes on: its next save uses it


class KilledAfterTheCount(Exception):
    """The rank dies the instant the step's all-reduce has completed."""


def test_a_rank_killed_just_after_the_steps_all_reduce_has_recorded_its_share(
    tmp_path, monkeypatch
):
    from elastic_trainer.worker import distributed
    from elastic_trainer.worker.audit import read_audit_log

    job = Job(tmp_path)
    job.train(steps=1)
    counted = distributed.all_reduce_ints

    def count_then_die(values):
        counted(values)  # the peers count the step: this rank's share went into it
        raise KilledAfterTheCount

    monkeypatch.setattr(distributed, "all_reduce_ints", count_then_die)
    planned = job.sampler.step_indices(0)
    with pytest.raises(KilledAfterTheCount):
        job.train(steps=1)
    records = {r.step: r for r in read_audit_log(str(tmp_path / "audit"))}
    assert sorted(records) == [1, 2]
    assert list(records[2].indices) == planned and records[2].rank == 0


def test_the_steps_left_after_a_step_come_from_the_epochs_and_the_step_budget(tmp_path):
    job = Job(tmp_path / "epochs")
    job.train(epochs=10, steps=2)  # 3 steps an epoch (4, 4 and 2 samples)
    assert job.session._steps_left(job.session.step + 1) == 10 * 3 - 3
    budget = Job(tmp_path / "budget", max_steps=5)
    budget.train(epochs=10, steps=2)
    assert budget.session._steps_left(budget.session.step + 1) == 2


def test_the_run_token_is_agreed_before_the_hand_over_wait(monkeypatch):
    """A node joins: the new workers wait for the old ones' stop (``worker.handoff``); the
    run token's all-reduce is done before that wait, not inside the group's pause."""
    from elastic_trainer.worker import distributed as D
    from elastic_trainer.worker import session as session_module

    calls: list[str] = []
    real_reduce, real_wait = D.all_reduce_ints, session_module.await_handoff

    def reduce(values, op=None):
        calls.append("all_reduce")
        return real_reduce(values, op)

    def wait(*args, **kwargs):
        calls.append("hand-over wait")
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(D, "all_reduce_ints", reduce)
    monkeypatch.setattr(session_module, "await_handoff", wait)
    session = TrainingSession({}, context=WorkerContext(), configure_logs=False)
    assert calls[:2] == ["all_reduce", "hand-over wait"]
    assert session.attempt > 0
    session.finish()
