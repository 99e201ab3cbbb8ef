"""ElasticSampler: drop-in behaviour, state round trips, mismatch errors and versions."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from elastic_trainer.errors import ConfigError, SamplerStateError
from elastic_trainer.worker.plan import epoch_permutation
from elastic_trainer.worker.sampler import STATE_VERSION, ElasticSampler

# A state as written by sampler state version 1. Never edit: later releases must load it.
V1_STATE = {
    "version": 1,
    "epoch": 2,
    "cursor": 8,
    "num_samples": 20,
    "seed": 7,
    "shuffle": True,
    "drop_last": False,
    "global_batch_size": 4,
    "world_size": 2,
}


def _sampler(n=20, **kwargs):
    defaults = dict(num_replicas=1, rank=0, seed=7, global_batch_size=4)
    return ElasticSampler(range(n), **{**defaults, **kwargs})


def test_version_1_state_loads_and_resumes_at_its_cursor():
    sampler = _sampler(num_replicas=2, rank=1)
    sampler.load_state_dict(V1_STATE)
    perm = epoch_permutation(20, seed=7, epoch=2, shuffle=True).tolist()
    assert (sampler.epoch, sampler.cursor) == (2, 8)
    assert list(sampler) == perm[9:20:2]


def test_state_round_trip_carries_version_epoch_and_cursor():
    sampler = _sampler()
    sampler.set_epoch(3)
    sampler.complete_step()
    state = sampler.state_dict()
    assert state["version"] == STATE_VERSION
    fresh = _sampler()
    fresh.load_state_dict(state)
    assert (fresh.epoch, fresh.cursor) == (3, 4)
    assert list(fresh) == list(sampler)


@pytest.mark.parametrize(
    ("field", "saved", "kwargs"),
    [
        ("num_samples", 20, dict(n=21)),
        ("seed", 7, dict(seed=8)),
        ("shuffle", True, dict(shuffle=False)),
        ("drop_last", False, dict(drop_last=True)),
        ("global_batch_size", 4, dict(global_batch_size=8)),
    ],
)
def test_mismatched_state_names_both_values(field, saved, kwargs):
    sampler = _sampler(**kwargs)
    with pytest.raises(SamplerStateError) as info:
        sampler.load_state_dict(V1_STATE)
    message = str(info.value)
    assert f"{field}={saved!r}" in message
    assert f"{field}={sampler.state_dict()[field]!r}" in message


@pytest.mark.parametrize("version", [None, 0, STATE_VERSION + 1, "1"])
def test_unknown_versions_are_refused(version):
    state = {k: v for k, v in V1_STATE.items() if k != "version"}
    if version is not None:
        state["version"] = version
    with pytest.raises(SamplerStateError, match="version"):
        _sampler().load_state_dict(state)


def test_state_missing_fields_is_corrupt():
    state = {k: v for k, v in V1_STATE.items() if k != "cursor"}
    with pytest.raises(SamplerStateError, match="lacks \\['cursor'\\]"):
        _sampler().load_state_dict(state)


@pytest.mark.parametrize("cursor", [-1, 6, 21])
def test_cursor_off_a_step_boundary_is_corrupt(cursor):
    with pytest.raises(SamplerStateError, match=f"cursor {cursor}"):
        _sampler().load_state_dict({**V1_STATE, "cursor": cursor})


def test_prefetching_does_not_move_the_cursor():
    sampler = _sampler(num_replicas=2, rank=0)
    loader = DataLoader(range(20), batch_size=sampler.micro_batch_size, sampler=sampler)
    batches = list(loader)  # the whole epoch fetched, no step completed
    assert len(batches) == 5
    assert sampler.cursor == 0
    assert sampler.state_dict()["cursor"] == 0


def test_set_epoch_restarts_only_when_the_epoch_changes():
    sampler = _sampler()
    sampler.complete_step()
    sampler.set_epoch(0)
    assert sampler.cursor == 4
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.cursor) == (1, 0)


def test_epoch_done_and_len_follow_the_cursor():
    sampler = _sampler(n=10, num_replicas=2, rank=1)  # steps of 4, 4, 2
    assert len(sampler) == len(list(sampler)) == 5
    sampler.complete_step()
    sampler.complete_step()
    assert len(sampler) == len(list(sampler)) == 1
    sampler.complete_step()
    assert sampler.epoch_done
    assert len(sampler) == 0
    assert list(sampler) == []


def test_tail_with_fewer_samples_than_ranks_yields_a_padding_sample():
    samplers = [_sampler(n=9, num_replicas=4, rank=r, shuffle=False) for r in range(4)]
    for s in samplers:
        s.load_state_dict({**V1_STATE, "num_samples": 9, "shuffle": False, "cursor": 8})
    assert [list(s) for s in samplers] == [[8], [8], [8], [8]]
    assert [s.current_share().padding for s in samplers] == [False, True, True, True]
    assert [s.complete_step() for s in samplers] == [[8], [], [], []]


def test_sampler_matches_distributed_sampler_when_nothing_is_left_over():
    # Same set per rank as torch's (order differs: we mix the seed differently).
    from torch.utils.data.distributed import DistributedSampler

    for rank in range(2):
        ours = ElasticSampler(range(12), num_replicas=2, rank=rank, shuffle=False)
        theirs = DistributedSampler(range(12), num_replicas=2, rank=rank, shuffle=False)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def test_plain_mode_never_pads():
    lengths = [len(list(ElasticSampler(range(10), num_replicas=4, rank=r))) for r in range(4)]
    assert lengths == [3, 3, 2, 2]
    everything = [i for r in range(4) for i in ElasticSampler(range(10), num_replicas=4, rank=r)]
    assert sorted(everything) == list(range(10))


def test_plain_mode_drop_last_trims_to_the_world_size():
    lengths = [
        len(list(ElasticSampler(range(10), num_replicas=4, rank=r, drop_last=True)))
        for r in range(4)
    ]
    assert lengths == [2, 2, 2, 2]


def test_plain_mode_needs_sample_counts_to_advance():
    with pytest.raises(SamplerStateError, match="local_samples and global_samples"):
        ElasticSampler(range(10), num_replicas=1, rank=0).complete_step()


def test_plain_mode_advance_returns_this_ranks_consumed_indices():
    samplers = [ElasticSampler(range(10), num_replicas=2, rank=r, seed=1) for r in range(2)]
    streams = [list(s) for s in samplers]
    got = [s.complete_step(local_samples=3, global_samples=6) for s in samplers]
    assert got == [streams[0][:3], streams[1][:3]]
    assert samplers[0].cursor == 6


def test_impossible_global_batch_fails_at_construction():
    with pytest.raises(ConfigError, match="not divisible by the world size 3"):
        ElasticSampler(range(10), num_replicas=3, rank=0, global_batch_size=4)
    with pytest.raises(ConfigError, match="every epoch would be empty"):
        ElasticSampler(range(3), num_replicas=1, rank=0, global_batch_size=4, drop_last=True)


def test_rank_outside_the_world_is_rejected():
    with pytest.raises(SamplerStateError, match="rank 2 is outside"):
        ElasticSampler(range(10), num_replicas=2, rank=2)


def test_permutation_is_computed_once_per_epoch(monkeypatch):
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(1) or real(*a, **k))
    sampler = _sampler()
    list(sampler)
    sampler.complete_step()
    list(sampler)
    assert len(calls) == 1


def test_steps_until_counts_the_optimizer_steps_left_to_the_runs_last_epoch():
    sampler = _sampler(n=22, global_batch_size=4)  # 6 steps an epoch: 5 of 4, one of 2
    counted = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        while not sampler.epoch_done:
            assert sampler.steps_until(3) == 18 - counted
            sampler.complete_step()
            counted += 1
    assert counted == 18 and sampler.steps_until(3) == 0
    assert _sampler(global_batch_size=None).steps_until(3) is None
