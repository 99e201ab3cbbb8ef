"""The in-memory tier for sharded (FSDP2) state through the real launcher on gloo
(``worker.memory.shards``): ``train_linear.py --fsdp`` (18 steps), storage snapshots every
6 steps, so a restore from storage loses up to 5 steps where one from memory loses at most 1.
"""

from __future__ import annotations

import json

import pytest

from tests.dist import test_session_memory_tier as tier
from tests.dist.test_session_memory_tier import DROPOUT, assert_bit_identical, restored, run

reference = tier.reference  # the fixtures: one uninterrupted run per set of arguments
worker_env_module = tier.worker_env_module

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# uneven shards (rank 1's of the last layer are empty); each step draws from the RNG; a
# copy every step (the default, auto, spaces copies out by their cost against the step's)
FSDP = ("--fsdp", "--width", "8", "--lr", "0.01", *DROPOUT, "--memory-every", "1")


def test_fsdp_worker_crash_restores_every_rank_from_memory_bit_identical(
    tmp_path, reference, worker_env_module
):
    result = run(tmp_path, worker_env_module, 2, *FSDP, "--crash-at-step", "9")
    events = restored(result)
    assert [e["source"] for e in events] == ["memory", "memory"], events
    assert len({e["step"] for e in events}) == 1 and events[0]["step"] >= 8  # storage: 6
    (recovery,) = result.named("recovery.completed")
    assert recovery["steps_lost"] <= 1
    assert_bit_identical(tmp_path, reference(*FSDP))  # shards, momentum and RNG restored


# HSDP, a (replicate, shard) mesh: ranks 1 and 3 hold the same shards; periodic copies every
# 3 steps (storage: 6), and the copy made just in time by the survivors when rank 3 crashes
HSDP = ("--fsdp", "--hsdp", "--width", "8", "--lr", "0.01", "--memory-every", "3")


def test_hsdp_worker_crash_restores_the_replicas_just_in_time_copies_bit_identical(
    tmp_path, reference, worker_env_module
):
    result = run(tmp_path, worker_env_module, 4, *HSDP, "--crash-at-step", "8", "--crash-rank", "3")
    events = restored(result)
    assert [(e["source"], e["step"]) for e in events] == [("mirror", 8)] * 4, events
    (recovery,) = result.named("recovery.completed")
    assert recovery["steps_lost"] == 0
    assert_bit_identical(tmp_path, reference(*HSDP, nproc=4))


def test_fsdp_a_damaged_copy_on_one_rank_sends_every_rank_to_storage(
    tmp_path, reference, worker_env_module
):
    extra = ("--crash-at-step", "9", "--damage-memory-on-restart", "1")
    result = run(tmp_path, worker_env_module, 2, *FSDP, *extra)
    events = restored(result)
    assert [(e["source"], e["step"]) for e in events] == [("storage", 6), ("storage", 6)]
    assert all("rank 1" in e["fallback_reason"] for e in events), events
    assert all("checksum" in e["fallback_reason"] for e in events), events
    assert_bit_identical(tmp_path, reference(*FSDP))


def test_fsdp_memory_stays_bounded_with_a_copy_every_step(tmp_path, worker_env_module):
    probe = tmp_path / "rss.json"
    run(
        tmp_path, worker_env_module, 2, "--fsdp", "--lr", "0.001",
        "--memory-dir-per-rank", "--width", "512", "--samples", "1200", "--epochs", "1",
        "--max-micro-batch", "12", "--snapshot-every", "100", "--rss-out", str(probe),
        "--memory-every", "1",
    )  # fmt: skip
    figures = json.loads(probe.read_text())
    rss, tier, state = figures["rss"], figures["tier"], figures["state_bytes"]
    assert len(rss) == 100
    # Each rank plays a node: rank 0's folder holds at most two copies of its half of the
    # state (weights and momentum) and two of rank 1's half, its mirror: two states in all,
    # whatever the step. More than one state shows that the mirror is there.
    assert 1.5 * state <= max(tier) <= 2 * state * 1.2 + 1_000_000, (max(tier), state)
    warm = rss[20]
    assert max(rss[20:]) - warm <= 10 * state, (warm, max(rss[20:]), state)
