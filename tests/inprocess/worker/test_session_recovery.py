"""Failure and recovery decisions with the ranks as threads of this process
(``tests/inprocess/harness.py``): the real TrainingSession, ElasticSampler and SnapshotStore
on gloo, attempts on shared snapshot and audit folders as the supervisor runs them, faults
injected inside a step.

The tiny DDP Linear job of ``tests/dist/workers/train_linear.py``: 61 samples, global batch
12 (5 full steps and a 1-sample step per epoch, so ranks holding only a padding sample are
exercised), 3 epochs = 18 steps, a storage snapshot every 3 steps.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastic_trainer as et
from elastic_trainer.worker.audit import check_exactly_once, effective_records, read_audit_log
from snapshots import SnapshotStore
from snapshots.storage import faults
from tests.inprocess.harness import (
    COLLECTIVE_TIMEOUT_S,
    FailureInjector,
    InjectedFailure,
    Job,
    NodeLost,
    Rank,
    SaveFault,
    SaveFaultAt,
    injected_save_fault,
    thread_local_world,
)

pytestmark = [pytest.mark.timeout(240)]

SAMPLES, EPOCHS, STEPS, EVERY = 61, 3, 18, 3


@pytest.fixture(autouse=True)
def ranks_in_threads():
    with thread_local_world():
        yield


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=generator)
    noise = 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + noise)


def build_model() -> nn.Module:
    """Initialised from its own generator: the global RNG is one for every thread."""
    model = nn.Linear(4, 1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def wrap(module: nn.Module, world_size: int, *, fsdp: bool) -> nn.Module:
    if not fsdp:
        return DDP(module)
    return fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))


def full_weights(model: nn.Module, *, fsdp: bool) -> dict[str, torch.Tensor]:
    """Under FSDP2 a collective; every rank gets the gathered weights."""
    if not fsdp:
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}


@dataclass(frozen=True)
class Training:
    """One job's folders and how far an attempt trains; called once per rank."""

    root: Path
    max_steps: int | None = None
    save_fault: SaveFaultAt | None = None
    fsdp: bool = False  # FSDP2 (fully_shard): sharded snapshots, every rank writes

    def __call__(self, rank: Rank) -> dict[str, torch.Tensor] | None:
        model = wrap(build_model(), rank.world_size, fsdp=self.fsdp)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = dataset()
        sampler = et.ElasticSampler(data, seed=3, global_batch_size=12, max_micro_batch_size=4)
        loader = DataLoader(data, batch_size=sampler.micro_batch_size, sampler=sampler)
        with et.TrainingSession(
            {"model": model, "optimizer": optimizer},
            sampler,
            context=rank.context,
            snapshot_dir=str(self.root / "snapshots"),
            snapshot_every=EVERY,
            audit_dir=str(self.root / "audit"),
            max_steps=self.max_steps,
            exit_on_stop=False,
            configure_logs=False,
        ) as session:
            for _epoch in session.epochs(EPOCHS):
                for x, y in loader:
                    with session.accumulate(model):
                        loss = nn.functional.mse_loss(model(x), y)
                        session.scale_loss(loss, len(x)).backward()
                    if session.step_ready:
                        self._inside_the_step(rank, session.step + 1)
                        optimizer.step()
                        optimizer.zero_grad()
                        session.step_done()
                        if session.should_stop:
                            break
            if session.stop_reason is not None:
                return None
            return full_weights(model, fsdp=self.fsdp)

    def _inside_the_step(self, rank: Rank, step: int) -> None:
        """After the gradients' all-reduce, before the update is counted."""
        rank.check(step)
        fault = self.save_fault
        if fault is not None and rank.rank == 0 and step == fault.save * EVERY + 1:
            # the writer runs behind training: wait for it to fail, then go down with it
            if not fault.hit.wait(COLLECTIVE_TIMEOUT_S):
                raise AssertionError(f"save {fault.save} never reached {fault.point}")
            raise NodeLost(f"rank 0 goes down with its writer ({fault.point})")


def final(attempt) -> dict[str, torch.Tensor]:
    """Rank 0's final parameters, after checking every rank ended with the same ones."""
    attempt.raise_first()
    first, *others = attempt.values()
    for other in others:
        torch.testing.assert_close(other, first, rtol=0, atol=0)
    return first


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """An uninterrupted run at world size 1: every run below must end where it ends."""
    with thread_local_world():
        return final(Job(Training(tmp_path_factory.mktemp("reference"))).attempt(1))


def assert_matches(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    torch.testing.assert_close(params, reference, rtol=1e-5, atol=1e-6)


def coverage_problems(root: Path) -> list[str]:
    records = read_audit_log(str(root / "audit"))
    return check_exactly_once(records, SAMPLES, complete_epochs=range(EPOCHS))


def step_sets(root: Path) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for record in effective_records(read_audit_log(str(root / "audit"))):
        steps.setdefault(record.step, []).extend(record.indices)
    return {step: sorted(indices) for step, indices in steps.items()}


def world_sizes(root: Path) -> dict[int, int]:
    return {r.step: r.world_size for r in effective_records(read_audit_log(str(root / "audit")))}


def committed(root: Path) -> list[int]:
    store = SnapshotStore(str(root / "snapshots"))
    try:
        return sorted(info.step for info in store.list())
    finally:
        store.close()


def restored_steps(root: Path) -> list[int | None]:
    """The step each attempt resumed from (None: a fresh start), in the attempts' order."""
    by_attempt = {r.attempt: r.restored_step for r in read_audit_log(str(root / "audit"))}
    return [by_attempt[attempt] for attempt in sorted(by_attempt)]


# --- stop, resume at other world sizes ------------------------------------------------------
def test_resume_at_other_world_sizes_trains_every_sample_once_and_matches(tmp_path, reference):
    reference_2 = tmp_path / "ref2"
    uninterrupted_2 = final(Job(Training(reference_2)).attempt(2))
    assert_matches(uninterrupted_2, reference)

    elastic = tmp_path / "elastic"
    stop_at_4 = Job(Training(elastic, max_steps=4)).attempt(2)
    assert stop_at_4.succeeded and stop_at_4.values() == [None, None]
    same_size = tmp_path / "same-size"
    shutil.copytree(elastic, same_size)  # the same job, continued another way
    Job(Training(elastic, max_steps=11)).attempt(3).raise_first()
    resumed = final(Job(Training(elastic)).attempt(1))
    resumed_same_size = final(Job(Training(same_size)).attempt(2))

    # world sizes really changed at the planned steps
    sizes = world_sizes(elastic)
    assert [sizes[s] for s in (1, 4, 5, 11, 12, 18)] == [2, 2, 3, 3, 1, 1]
    # the audit log proves exactly-once coverage of every epoch, across all three attempts
    assert coverage_problems(elastic) == []
    # every step trained the same samples whatever the world size
    assert len(step_sets(tmp_path / "ref2")) == STEPS
    assert step_sets(elastic) == step_sets(reference_2)
    # and the model ends where an uninterrupted run ends; bit for bit at the same world size
    assert_matches(resumed, reference)
    assert coverage_problems(same_size) == []
    for name, value in resumed_same_size.items():
        assert torch.equal(value, uninterrupted_2[name]), f"{name} differs after 2 -> stop -> 2"


def test_fsdp_resumes_at_other_world_sizes_from_sharded_snapshots_and_matches(tmp_path, reference):
    """Every rank writes its own shards; 2 ranks, then 3, then 1 read them resharded."""
    stopped = Job(Training(tmp_path, max_steps=4, fsdp=True)).attempt(2)
    assert stopped.succeeded and stopped.values() == [None, None]
    Job(Training(tmp_path, max_steps=11, fsdp=True)).attempt(3).raise_first()
    resumed = final(Job(Training(tmp_path, fsdp=True)).attempt(1))
    assert restored_steps(tmp_path) == [None, 4, 11]
    assert coverage_problems(tmp_path) == []
    assert_matches(resumed, reference)


# --- a failure inside a step ------------------------------------------------------------------
# rank 0 (the one that writes snapshots) and another rank; the world shrinks and grows
@pytest.mark.parametrize(
    ("failing_rank", "before", "after"),
    [(0, 3, 2), (1, 2, 3)],
    ids=["rank0-of-3-ranks-to-2", "rank1-of-2-ranks-to-3"],
)
def test_a_failure_at_step_k_resumes_at_the_committed_step_at_a_new_world_size(
    tmp_path, reference, before, after, failing_rank
):
    job = Job(Training(tmp_path), FailureInjector().fail_at(failing_rank, 8))
    failed = job.attempt(before)
    # every rank of the group fails with it: the injected error, or a peer's closed socket
    assert isinstance(failed.outcomes[failing_rank].error, InjectedFailure)
    assert all(o.error is not None for o in failed.outcomes)
    committed_then = committed(tmp_path)
    assert committed_then and max(committed_then) == 6  # the step-6 save, not step 7

    resumed = final(job.attempt(after))
    assert restored_steps(tmp_path) == [None, 6]
    # steps up to the commit count as the first world trained them, the rest as the second
    sizes = world_sizes(tmp_path)
    assert {sizes[s] for s in range(1, 7)} == {before}
    assert {sizes[s] for s in range(7, STEPS + 1)} == {after}
    assert coverage_problems(tmp_path) == []
    assert_matches(resumed, reference)


def test_a_lost_node_shrinks_the_world_and_the_job_finishes_where_it_would_have(
    tmp_path, reference
):
    job = Job(Training(tmp_path), FailureInjector().lose_at(2, 11))
    last = job.run(3)
    assert [a.world_size for a in job.attempts] == [3, 2]
    assert job.injector.fired == [(0, 2, 11)]
    assert isinstance(job.attempts[0].outcomes[2].error, NodeLost)
    assert restored_steps(tmp_path) == [None, 9]
    assert coverage_problems(tmp_path) == []
    assert_matches(final(last), reference)


# --- a failure while a snapshot is written ----------------------------------------------------
# The second save (step 6) fails at each point of its writing, on rank 0's writer thread, and
# rank 0 goes down with it at the step after: the next world (2 ranks) must load a whole,
# committed snapshot, the newest one, and train to the reference's end.
@pytest.mark.parametrize("point", faults.SAVE_POINTS)
def test_a_failure_while_a_snapshot_is_written_never_leaves_one_that_loads_wrong(
    tmp_path, reference, point
):
    fault = SaveFaultAt(point, save=2)
    training = Training(tmp_path, save_fault=fault)
    job = Job(training)
    with injected_save_fault(fault):
        failed = job.attempt(3)
    assert fault.hit.is_set(), f"the save never reached {point}"
    assert isinstance(failed.outcomes[0].error, NodeLost)
    assert not failed.succeeded

    # a manifest written whole is a commit; anything short of it is not
    expected = 6 if point == "after_manifest" else 3
    assert max(committed(tmp_path)) == expected
    resumed = final(Job(replace(training, save_fault=None)).attempt(2))
    assert restored_steps(tmp_path) == [None, expected]
    assert coverage_problems(tmp_path) == []
    assert_matches(resumed, reference)


def test_the_save_fault_reaches_the_writer(tmp_path):
    """The fault tests above test something only if the writer really failed."""
    fault = SaveFaultAt("before_manifest", save=1)
    with injected_save_fault(fault):
        failed = Job(Training(tmp_path, save_fault=fault)).attempt(1)
    assert fault.hit.is_set()
    assert isinstance(failed.outcomes[0].error, NodeLost)
    assert committed(tmp_path) == []
    assert SaveFault.__mro__[1] is InjectedFailure
