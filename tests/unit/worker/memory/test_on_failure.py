"""The just-in-time copy (``worker.memory.on_failure``): nothing copied while training goes
well; a failure copies the consistent state once, and the next session resumes from it.
A state torn by an optimizer step is never copied.

One process, a world of one (as tests/unit/worker/test_session_restart_stop.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer.contract import protocol
from elastic_trainer.supervisor.core import decisions
from elastic_trainer.worker import distributed
from elastic_trainer.worker.audit import read_audit_log
from elastic_trainer.worker.context import WorkerContext, WorkerSettings
from elastic_trainer.worker.memory import on_failure
from elastic_trainer.worker.memory.on_failure import FailureCopy, Phase
from elastic_trainer.worker.memory.plan import SLOTS
from elastic_trainer.worker.memory.tier import NodeCopies
from elastic_trainer.worker.sampler import ElasticSampler
from elastic_trainer.worker.session import TrainingSession


class Boom(Exception):
    pass


@pytest.fixture(autouse=True)
def _clean():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh worker
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _session(
    tmp_path: Path,
    model: nn.Module,
    optimizer,
    *,
    audit: Path | None = None,
    more: dict | None = None,
    **settings,
) -> TrainingSession:
    control = tmp_path / "control"
    control.mkdir(parents=True, exist_ok=True)
    worker = WorkerSettings(
        control_dir=str(control), memory_dir=str(tmp_path / "memory"), **settings
    )
    sampler = ElasticSampler(list(range(64)), global_batch_size=8, shuffle=False)
    return TrainingSession(
        {"model": model, "optimizer": optimizer, **(more or {})},
        sampler=sampler,
        context=WorkerContext(settings=worker),
        snapshot_dir=str(tmp_path / "snapshots"),
        snapshot_every=1000,
        audit_dir=str(audit) if audit is not None else None,
        configure_logs=False,
    )


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(
    session, model, optimizer, steps: int, *, fail_at: str | None = None, scheduler=None
) -> None:
    x = torch.arange(12.0).reshape(4, 3)
    for _ in range(steps):
        model(x).sum().backward()
        if fail_at == "backward":  # a peer lost in the all-reduce: nothing stepped
            raise Boom
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if fail_at == "counting":  # lost in step_done's all-reduce: stepped, not counted
            raise Boom
        session.step_done()


def _copies(tmp_path: Path) -> NodeCopies:
    return NodeCopies(str(tmp_path / "memory"))


def _run_then_fail(tmp_path: Path, fail_at: str) -> dict[str, torch.Tensor]:
    model, optimizer = _parts()
    audit = tmp_path / "audit"
    with pytest.raises(Boom), _session(tmp_path, model, optimizer, audit=audit) as session:
        _train(session, model, optimizer, 3)
        assert _copies(tmp_path).newest() is None  # no copy while training goes well
        _train(session, model, optimizer, 1, fail_at=fail_at)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("fail_at", "step"), [("backward", 3), ("counting", 4)])
def test_a_failure_copies_the_consistent_state_once_and_the_next_session_resumes_from_it(
    tmp_path, fail_at, step
):
    at_failure = _run_then_fail(tmp_path, fail_at)
    assert _copies(tmp_path).newest() == step
    # the stepped step's samples were trained: the audit says so (the group resumes after it)
    recorded = [r.step for r in read_audit_log(str(tmp_path / "audit"))]
    assert recorded == list(range(1, step + 1))
    model, optimizer = _parts(seed=1)  # other weights: the restore must replace them
    with _session(tmp_path, model, optimizer) as session:
        assert session.restored_step == step
        assert session.sampler.cursor == 8 * step  # the stepped one's batch is not retrained
        torch.testing.assert_close(model.state_dict(), at_failure, rtol=0, atol=0)
        assert optimizer.state_dict()["state"]  # the momentum came back too
        _train(session, model, optimizer, 1)


def test_the_node_s_memory_for_the_copy_is_reserved_once_training_goes_on(tmp_path):
    """At the first counted step the slot the failure's copy goes into gets its pages and is
    mapped: the copy at the failure then writes through that mapping, allocating nothing."""
    model, optimizer = _parts()
    slot = tmp_path / "memory" / SLOTS[0]
    with pytest.raises(Boom), _session(tmp_path, model, optimizer) as session:
        _train(session, model, optimizer, 2)
        session._memory.flush()  # the reservation runs on the tier's thread
        reserved = os.stat(slot)
        assert reserved.st_blocks > 0 and _copies(tmp_path).newest() is None
        _train(session, model, optimizer, 1, fail_at="backward")
    copied = os.stat(slot)
    assert _copies(tmp_path).newest() == 2
    assert (copied.st_ino, copied.st_blocks) == (reserved.st_ino, reserved.st_blocks)
    assert session._memory._whole.slots[SLOTS[0]].maps == 1  # written through that mapping


def test_the_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    model, optimizer = _parts()
    with _session(tmp_path / "straight", model, optimizer) as session:
        _train(session, model, optimizer, 6)
    straight = model.state_dict()
    _run_then_fail(tmp_path / "failed", "counting")  # 3 steps, a 4th stepped, then lost
    model, optimizer = _parts(seed=1)
    with _session(tmp_path / "failed", model, optimizer) as session:
        _train(session, model, optimizer, 6 - session.step)
    torch.testing.assert_close(model.state_dict(), straight, rtol=0, atol=0)


def test_a_state_torn_by_an_optimizer_step_is_never_copied(tmp_path):
    model, optimizer = _parts()

    def torn(*_):  # a failure inside optimizer.step(), after its pre-hooks
        raise Boom

    with pytest.raises(Boom), _session(tmp_path, model, optimizer) as session:
        _train(session, model, optimizer, 2)
        optimizer.register_step_pre_hook(torn)
        _train(session, model, optimizer, 1)
    assert _copies(tmp_path).newest() is None


def test_the_supervisors_request_is_answered_from_a_thread(tmp_path):
    model, optimizer = _parts()
    control = tmp_path / "control"
    with _session(tmp_path, model, optimizer) as session:
        _train(session, model, optimizer, 2)
        assert (control / protocol.copier_file(0)).exists()  # it says it will answer
        assert protocol.request_copy(str(control / protocol.copy_now_fifo(0)))  # the supervisor
        answer = control / protocol.copied_file(0)
        deadline = time.monotonic() + 30
        while not answer.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # the watcher thread's answer: a bounded wait for a condition
        assert answer.read_text() == "copied"
        assert _copies(tmp_path).newest() == 2


def test_a_graceful_restart_resumes_from_the_copy_made_at_the_steps_end(tmp_path):
    model, optimizer = _parts()
    control = tmp_path / "control"
    session = _session(tmp_path, model, optimizer)
    x = torch.randn(4, 3)
    while not session.should_stop:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        session.step_done()
        if session.step == 2:
            (control / protocol.RESTART_FILE).touch()
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit):
        session.finish()
    assert _copies(tmp_path).newest() == 3
    assert not list((tmp_path / "snapshots").glob("step-*"))  # no storage save to wait for


def _one_step(copy: FailureCopy) -> None:
    """Attach ``copy`` to a fresh optimizer and take one step: phase STEPPED."""
    model, optimizer = _parts()
    copy.attach([optimizer])
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()


def test_phases_order_the_copy_against_the_step():
    written = []
    copy = FailureCopy(lambda stepped: (5 + stepped, {}), lambda *a: written.append(a[0]) or 1)
    _one_step(copy)
    assert copy.phase is Phase.STEPPED
    assert copy.copy() and written == [6]
    assert copy.copy() and written == [6]  # once per step
    copy.counted()
    copy.phase = Phase.TORN
    assert not copy.copy()
    copy.close()


class FakeMark:
    """A GPU's step mark, scripted: whether the device has finished the last step (or the
    one before it, or begun the last one), and what ran inside ``reading``."""

    def __init__(self) -> None:
        self.finished, self.records, self.inside = False, 0, False
        self.finishes_within: float | None = None  # seconds the device still needs
        self.waits: list[float] = []
        self.begins, self.before_finished = 0, True
        self.begins_while_read = False  # the device begins the step during a read
        self.started = False

    def record(self) -> None:
        self.records += 1

    def begin(self) -> None:
        self.begins += 1
        self.started = False

    def done(self, within_s: float = 0.0) -> bool:
        self.waits.append(within_s)
        due = self.finishes_within
        return self.finished or (due is not None and due <= within_s)

    def before_done(self) -> bool:
        return self.before_finished

    def began(self) -> bool:
        return self.started

    @contextlib.contextmanager
    def reading(self, *, before: bool = False):
        self.inside = "before" if before else True
        self.started = self.started or self.begins_while_read
        yield
        self.inside = False


def test_on_a_gpu_a_step_still_queued_on_the_device_is_not_copied(monkeypatch):
    """The host's phase runs ahead of a GPU: ``optimizer.step()`` returns once its kernels
    are queued. A copy waits for nothing queued (a collective with a dead peer never ends)
    and describes only a step the device has finished, read on the copy's own stream."""
    mark = FakeMark()
    monkeypatch.setattr(on_failure, "step_mark_for", lambda optimizers: mark)
    written = []
    copy = FailureCopy(
        lambda stepped: (5 + stepped, {}), lambda *a: written.append((a[0], mark.inside)) or 1
    )
    _one_step(copy)
    assert mark.records == 1 and copy.phase is Phase.STEPPED
    assert not copy.copy() and written == []  # queued on the device: declined, at once
    mark.finished = True
    assert copy.copy() and written == [(6, True)]
    copy.close()


def test_the_training_threads_copy_lets_the_device_finish_the_step_first(monkeypatch):
    """After the script raised, the device is most often healthy and a step or less behind
    the host: that copy waits for it (bounded); the supervisor's request does not wait."""
    mark = FakeMark()
    mark.finishes_within = 0.01
    monkeypatch.setattr(on_failure, "step_mark_for", lambda optimizers: mark)
    written = []
    copy = FailureCopy(lambda stepped: (5 + stepped, {}), lambda *a: written.append(a[0]) or 1)
    _one_step(copy)
    assert not copy.copy() and written == []  # the watcher's: no wait
    on_failure.copy_all()  # bootstrap's, for a script that raised
    assert written == [6] and mark.waits == [0.0, on_failure.SETTLE_S]
    copy.close()


def test_a_session_aborted_by_an_error_copies_with_the_settle_wait(tmp_path, monkeypatch):
    waits = []
    monkeypatch.setattr(
        FailureCopy, "copy", lambda self, settle_s=0.0: waits.append(settle_s) or True
    )
    model, optimizer = _parts()
    with pytest.raises(Boom), _session(tmp_path, model, optimizer) as session:
        _train(session, model, optimizer, 2, fail_at="counting")
    assert waits == [on_failure.SETTLE_S]


def test_on_a_cpu_no_step_mark_is_made():
    _, optimizer = _parts()
    assert on_failure.step_mark_for([optimizer]) is None


def test_the_copy_carries_the_rng_states_of_its_step_not_the_next_steps_draws():
    """Regression: the copy read the RNG states when it was written, after the next step's
    forward pass had drawn (dropout): the restored run then drew other masks than the
    uninterrupted one and ended elsewhere."""
    rngs = []
    copy = FailureCopy(lambda stepped: (1 + stepped, {}), lambda *a: rngs.append(a[2]) or True)
    model, optimizer = _parts()
    copy.attach([optimizer])
    torch.manual_seed(7)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    copy.counted()
    at_step = torch.get_rng_state()
    torch.rand(100)  # the next step's forward pass, before the failure
    assert copy.copy()
    saved = rngs[0]["rng"].state_dict()
    assert torch.equal(saved["torch"], at_step)
    assert not torch.equal(saved["torch"], torch.get_rng_state())
    copy.close()


def test_a_reform_waits_only_for_live_workers_that_can_answer_and_have_not():
    codes = {0: None, 1: None, 2: 1, 3: None}  # rank 3: a plain script, never answers
    copiers = {0, 1, 2}
    assert decisions.copies_pending(codes, copiers=copiers, answered={0}) == {1}
    assert decisions.copies_pending(codes, copiers=copiers, answered={0, 1}) == set()


def test_closing_wakes_the_watcher_without_a_copy(tmp_path):
    written = []
    copy = FailureCopy(lambda stepped: (1, {}), lambda *a: written.append(a[0]) or True)
    copy.watch(str(tmp_path), 3)
    assert (tmp_path / protocol.copy_now_fifo(3)).exists()
    copy.close()
    copy._watcher.join(timeout=30)
    assert not copy._watcher.is_alive() and written == []
    assert not (tmp_path / protocol.copied_file(3)).exists()


_START = threading.Thread.start  # the real one, before a test swaps the class


class _HeldBack(threading.Thread):
    """A watcher thread that runs only when the test says: what a busy machine may do."""

    held: ClassVar[list[threading.Thread]] = []

    def start(self) -> None:
        _HeldBack.held.append(self)


def _run_held_back() -> threading.Thread:
    (thread,) = _HeldBack.held
    _HeldBack.held.clear()
    _START(thread)
    thread.join(timeout=30)
    return thread


def test_a_close_before_the_watcher_runs_still_ends_it(tmp_path, monkeypatch):
    """A watcher that sleeps in ``open`` of the FIFO, woken by close() opening the other end,
    would miss a close that comes before the thread gets there (nobody there: ENXIO) and sleep
    forever; this close still ends it."""
    _HeldBack.held.clear()
    monkeypatch.setattr(on_failure.threading, "Thread", _HeldBack)
    written = []
    copy = FailureCopy(lambda stepped: (1, {}), lambda *a: written.append(a[0]) or True)
    copy.watch(str(tmp_path), 3)
    copy.close()
    assert not _run_held_back().is_alive() and written == []


def test_a_request_before_the_watcher_runs_is_answered(tmp_path, monkeypatch):
    _HeldBack.held.clear()
    monkeypatch.setattr(on_failure.threading, "Thread", _HeldBack)
    written = []
    copy = FailureCopy(lambda stepped: (1, {}), lambda *a: written.append(a[0]) or True)
    copy.watch(str(tmp_path), 0)
    assert (tmp_path / protocol.copier_file(0)).exists()  # announced: requests may come
    assert protocol.request_copy(str(tmp_path / protocol.copy_now_fifo(0)))
    assert not _run_held_back().is_alive()
    assert (tmp_path / protocol.copied_file(0)).read_text() == "copied" and written == [1]
    copy.close()


def _adam_parts(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def test_on_a_gpu_a_step_still_queued_is_copied_as_it_began(monkeypatch):
    """The host took the step (Adam's counters moved on, then the scheduler) while the
    device still waits to begin it (its gradient all-reduce waits for a lost peer): the
    device holds the state as the step began, and the copy is of that state, read after
    the step before it ended, with the host's side as the pre-hook held it."""
    mark = FakeMark()
    mark.finished = True
    monkeypatch.setattr(on_failure, "step_mark_for", lambda optimizers: mark)
    model, optimizer, scheduler = _adam_parts()
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    counted = [0]

    def capture(stepped: bool):
        return counted[0] + stepped, {**state, "session": {"step": counted[0] + stepped}}

    written = []

    def write_held(step, held, per_rank, *, valid):
        written.append((step, held, mark.inside, valid()))
        return True

    copy = FailureCopy(
        capture, lambda *a: pytest.fail("the device is behind"), write_held=write_held
    )
    copy.attach([optimizer])
    x = torch.ones(2, 3)

    def one_step() -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    one_step()
    counted[0] = 1
    copy.counted()
    lr_of_step_2 = optimizer.param_groups[0]["lr"]
    mark.finished = False  # the device has not finished step 2 (nor begun it)
    one_step()
    assert copy.phase is Phase.STEPPED and mark.begins == 2
    assert copy.copy()
    ((step, held, inside, valid),) = written
    assert step == 1 and inside == "before" and valid
    assert held["model"] is model  # its tensors are the device's: read at the copy
    assert {s["step"].item() for s in held["optimizer"]["state"].values()} == {1.0}
    assert held["optimizer"]["param_groups"][0]["lr"] == lr_of_step_2
    assert optimizer.param_groups[0]["lr"] == lr_of_step_2 / 2  # the host moved on
    assert held["scheduler"]["last_epoch"] == 1 and held["session"] == {"step": 1}
    assert copy.copy() and len(written) == 1  # once
    copy.close()


def test_on_a_gpu_a_copy_of_the_step_as_it_began_is_declined_where_it_cannot_be_sure(
    monkeypatch,
):
    """No copy when the device has not finished the step before either or has begun the
    step already (nothing is read then), and when nothing was held (a tier that cannot check
    a copy before its commit)."""
    mark = FakeMark()
    monkeypatch.setattr(on_failure, "step_mark_for", lambda optimizers: mark)
    written = []
    copy = FailureCopy(
        lambda stepped: (5 + stepped, {}),
        lambda *a: written.append(a[0]) or True,
        write_held=lambda *a, valid: written.append(a[0]) or True,
    )
    _one_step(copy)
    mark.before_finished = False
    assert not copy.copy() and written == []
    mark.before_finished, mark.started = True, True  # the device has begun the step
    assert not copy.copy() and written == []  # not even read
    copy.close()
    plain = FailureCopy(lambda stepped: (5 + stepped, {}), lambda *a: written.append(a[0]) or 1)
    _one_step(plain)
    assert mark.begins == 1  # only the first copy holds
    assert not plain.copy() and written == [] and plain._held is None
    plain.close()


def test_on_a_cpu_nothing_is_held(tmp_path):
    model, optimizer, scheduler = _adam_parts()
    with _session(tmp_path, model, optimizer, more={"scheduler": scheduler}) as session:
        _train(session, model, optimizer, 2, scheduler=scheduler)
        assert session._on_failure._write_held is not None and session._on_failure._held is None


def _run_behind_the_host(tmp_path: Path, mark: FakeMark) -> None:
    """Three steps, then a fourth the host takes while the device does not finish it, and
    the script is lost in step_done's all-reduce (the session's copy after it raised)."""
    mark.finished = True
    model, optimizer, scheduler = _adam_parts()
    more = {"scheduler": scheduler}
    with pytest.raises(Boom), _session(tmp_path, model, optimizer, more=more) as session:
        _train(session, model, optimizer, 3, scheduler=scheduler)
        mark.finished = False
        _train(session, model, optimizer, 1, fail_at="counting", scheduler=scheduler)


def test_a_session_whose_device_is_behind_resumes_from_the_step_as_it_began(tmp_path, monkeypatch):
    mark = FakeMark()
    monkeypatch.setattr(on_failure, "step_mark_for", lambda optimizers: mark)
    _run_behind_the_host(tmp_path, mark)
    assert _copies(tmp_path).newest() == 3
    model, optimizer, scheduler = _adam_parts(seed=1)
    with _session(tmp_path, model, optimizer, more={"scheduler": scheduler}) as session:
        assert session.restored_step == 3 and session.sampler.cursor == 8 * 3
        steps = {s["step"].item() for s in optimizer.state_dict()["state"].values()}
        assert steps == {3.0}  # not the 4th step's counters the host had moved on to
        assert scheduler.last_epoch == 3
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_a_copy_the_device_began_the_step_under_is_never_committed(tmp_path, monkeypatch):
    """The device reached the step's beginning while its state was read: the read may hold
    some of the step's updates. Nothing is committed; the next group starts elsewhere."""
    mark = FakeMark()
    mark.begins_while_read = True
    monkeypatch.setattr(on_failure, "step_mark_for", lambda optimizers: mark)
    _run_behind_the_host(tmp_path, mark)
    assert _copies(tmp_path).newest() is None
    model, optimizer, scheduler = _adam_parts(seed=1)
    with _session(tmp_path, model, optimizer, more={"scheduler": scheduler}) as session:
        assert session.restored_step is None


def test_with_two_optimizers_the_state_between_their_steps_is_torn():
    """Regression: the first optimizer's post-hook made the phase STEPPED, so a copy taken
    before the second one stepped described step k+1 with half the parameters at step k."""
    written = []
    copy = FailureCopy(lambda stepped: (5 + stepped, {}), lambda *a: written.append(a[0]) or 1)
    torch.manual_seed(0)
    first, second = nn.Linear(3, 1), nn.Linear(3, 1)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
    copy.attach(optimizers)
    (first(torch.ones(1, 3)) + second(torch.ones(1, 3))).sum().backward()
    optimizers[0].step()
    assert copy.phase is Phase.TORN and not copy.copy() and written == []
    optimizers[1].step()
    assert not copy.copy() and written == []  # the script may step another one yet
    copy.steps_ended()  # step_done: all have stepped
    assert copy.phase is Phase.STEPPED and copy.copy() and written == [6]
    copy.close()


def test_a_session_with_two_optimizers_copies_the_step_once_step_done_began(tmp_path, monkeypatch):
    """Lost in step_done's all-reduce, after both optimizers stepped: the copy is of that
    step; lost between the two optimizers' steps: no copy (the state is torn)."""

    def parts():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
        return model, [torch.optim.SGD(layer.parameters(), lr=0.1) for layer in model]

    x = torch.arange(12.0).reshape(4, 3)

    def run(folder: Path, *, lost_between: bool) -> None:
        model, (a, b) = parts()
        session = _session(folder, model, a, more={"second": b})
        with pytest.raises(Boom), session:
            for _ in range(2):
                model(x).sum().backward()
                a.step()
                b.step()
                a.zero_grad()
                b.zero_grad()
                session.step_done()
            model(x).sum().backward()
            a.step()
            if lost_between:
                raise Boom
            b.step()
            monkeypatch.setattr(distributed, "all_reduce_ints", _raise_boom)
            session.step_done()

    run(tmp_path / "in-step-done", lost_between=False)
    monkeypatch.undo()
    assert _copies(tmp_path / "in-step-done").newest() == 3
    run(tmp_path / "between", lost_between=True)
    assert _copies(tmp_path / "between").newest() is None


def _raise_boom(*_, **__):
    raise Boom


class Unconsolidated(torch.optim.SGD):
    """An optimizer whose state dict cannot be taken at every step, as
    ZeroRedundancyOptimizer's before ``consolidate_state_dict()``."""

    reads = 0

    def state_dict(self):
        Unconsolidated.reads += 1
        raise RuntimeError("optimizer state has not been consolidated")


def test_holding_never_breaks_the_training_step(monkeypatch):
    """On a GPU the pre-hook takes the optimizer's state dict at every step: one that raises
    turns holding off, reported once, and training goes on."""
    mark = FakeMark()
    mark.finished = True
    monkeypatch.setattr(on_failure, "step_mark_for", lambda optimizers: mark)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = Unconsolidated(model.parameters(), lr=0.1)
    reported = []
    copy = FailureCopy(
        lambda stepped: (1 + stepped, {"optimizer": optimizer}),
        lambda *a: True,
        write_held=lambda *a, valid: pytest.fail("nothing is held"),
        failed=lambda step, exc, what: reported.append((step, str(exc), what)),
    )
    copy.attach([optimizer])
    before = model.weight.detach().clone()
    for _ in range(3):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()  # does not raise
        copy.counted()
    assert not torch.equal(model.weight, before)  # it trained
    assert Unconsolidated.reads == 1 and len(reported) == 1
    assert "now off" in reported[0][2] and "consolidated" in reported[0][1]
    mark.finished = False
    assert not copy.copy()  # nothing held: declined, as before the hold existed
    copy.close()
