"""The in-memory snapshot tier through the real launcher on gloo (``worker.memory.tier``).

The tiny DDP model of ``train_linear.py`` (18 steps); storage snapshots every 6 steps, so a
restore from storage loses up to 5 steps where one from memory loses at most 1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import clean_worker_env
from tests.dist.workers.launcher import Launch, launch_workers
from tests.dist.workers.train_linear import KILL_MEMORY_WRITE_ENV, SLOW_MEMORY_WRITE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).parent / "workers" / "train_linear.py")
STORAGE_EVERY = 6


def run(
    root: Path, env: dict[str, str], nproc: int, *extra: str, supervisor: Sequence[str] = ()
) -> Launch:
    args = [
        "--snapshot-dir", str(root / "snapshots"),
        "--snapshot-every", str(STORAGE_EVERY),
        "--audit-dir", str(root / "audit"),
        "--out", str(root / "final.pt"),
        *extra,
    ]  # fmt: skip
    result = launch_workers(
        SCRIPT, nproc, args, env=env, max_restarts=1, timeout=150, supervisor_args=supervisor
    )
    assert result.returncode == 0, result.output[-4000:]
    return result


def final(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "final.pt", weights_only=True)


def assert_bit_identical(root: Path, reference: Path) -> None:
    ref = final(reference)
    for name, value in final(root).items():
        assert not value.isnan().any(), f"{name} is NaN: the run diverged, nothing to compare"
        assert torch.equal(value, ref[name]), f"{name} differs from the uninterrupted run"


def restored(result: Launch) -> list[dict[str, Any]]:
    return sorted(result.named("snapshot.restored"), key=lambda e: e["rank"])


def assert_every_rank_resumed_the_copy_of(
    step: int, result: Launch, root: Path, reference: Path
) -> None:
    """Both ranks restored ``step`` from memory: no step lost, the run bit-identical."""
    events = restored(result)
    assert [(e["source"], e["step"]) for e in events] == [("memory", step), ("memory", step)]
    (recovery,) = result.named("recovery.completed")
    assert recovery["steps_lost"] == 0
    assert_bit_identical(root, reference)


DROPOUT = ("--dropout", "0.3")  # the steps draw from each rank's RNG
EVERY_STEP = ("--memory-every", "1")  # periodic copies (replicated state's default: none)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, worker_env_module):
    """The uninterrupted run's folder, for the given extra arguments (one run each)."""
    runs: dict[tuple[int | str, ...], Path] = {}

    def get(*extra: str, nproc: int = 2) -> Path:
        key = (nproc, *extra)
        if key not in runs:
            root = tmp_path_factory.mktemp("reference")
            assert run(root, worker_env_module, nproc, *extra).named("snapshot.restored") == []
            runs[key] = root
        return runs[key]

    return get


@pytest.fixture(scope="module")
def worker_env_module() -> dict[str, str]:
    return clean_worker_env()


def test_worker_crash_restores_the_just_in_time_copy_bit_identical(
    tmp_path, reference, worker_env_module
):
    """The default: no copy until the failure; the survivor copies step 9 then. Without
    dropout: the crashed rank's own RNG streams die with it (it keeps its fresh ones)."""
    result = run(tmp_path, worker_env_module, 2, "--crash-at-step", "9", "--crash-rank", "1")
    assert_every_rank_resumed_the_copy_of(9, result, tmp_path, reference())


def test_a_survivor_whose_copy_outlasts_the_kill_grace_is_waited_for(
    tmp_path, reference, worker_env_module
):
    """Regression: when a rank crashed, the supervisor gave the rest of its node SIGTERM and
    1 s, then SIGKILL: a survivor still writing its just-in-time copy (a large state; here
    one made 3 s slow) was killed in it, and the next group restored step 6 from storage.
    The supervisor now asks for the copies and waits for their answers first."""
    env = {**worker_env_module, SLOW_MEMORY_WRITE_ENV: "9:3"}
    result = run(tmp_path, env, 2, "--crash-at-step", "9", "--crash-rank", "1")
    assert_every_rank_resumed_the_copy_of(9, result, tmp_path, reference())


def test_a_hang_restores_the_just_in_time_copy_of_the_rank_blocked_in_a_collective(
    tmp_path, reference, worker_env_module
):
    """Rank 1 freezes after step 9 (SIGSTOP); rank 0 blocks in the next step's all-reduce.
    The watchdog calls it a hang; before the kill the supervisor asks for the copies: rank 0's
    watcher thread copies step 9 (rank 1 cannot answer: the wait is bounded). Killed at once,
    the group restored step 6 from storage."""
    result = run(
        tmp_path, worker_env_module, 2, "--freeze-at-step", "9", supervisor=("--hang-timeout", "3")
    )
    assert result.named("worker.hung")
    assert_every_rank_resumed_the_copy_of(9, result, tmp_path, reference())


def test_worker_crash_restores_from_memory_bit_identical(tmp_path, reference, worker_env_module):
    """Periodic copies: every rank's RNG streams are in the copy of step 9, the crashed
    rank's too."""
    extra = ("--crash-at-step", "9", "--crash-rank", "1", *EVERY_STEP)
    result = run(tmp_path, worker_env_module, 2, *DROPOUT, *extra)
    events = restored(result)
    assert [e["source"] for e in events] == ["memory", "memory"]
    assert {e["step"] for e in events} <= {8, 9}  # storage has only step 6
    (recovery,) = result.named("recovery.completed")
    assert recovery["steps_lost"] <= 1
    assert_bit_identical(tmp_path, reference(*DROPOUT))  # RNG streams restored too


def test_a_node_without_its_copy_gets_a_peers_copy(tmp_path, reference, worker_env_module):
    """Each rank plays a node with a memory tier of its own; rank 1's is lost with the crash
    (without dropout: rank 1's RNG streams are lost with its folder)."""
    result = run(
        tmp_path, worker_env_module, 2,
        "--memory-dir-per-rank", "--crash-at-step", "9", "--drop-memory-on-restart", "1",
    )  # fmt: skip
    events = restored(result)
    assert [e["source"] for e in events] == ["memory", "mirror"]
    assert len({e["step"] for e in events}) == 1 and events[0]["step"] >= 8
    assert_bit_identical(tmp_path, reference())


def test_both_copies_lost_restores_from_storage_and_says_why(
    tmp_path, reference, worker_env_module
):
    result = run(
        tmp_path, worker_env_module, 2, *DROPOUT,
        "--memory-dir-per-rank", "--crash-at-step", "9", "--drop-memory-on-restart", "0,1",
    )  # fmt: skip
    events = restored(result)
    assert [(e["source"], e["step"]) for e in events] == [("storage", 6), ("storage", 6)]
    assert all("no node holds an in-memory copy" in e["fallback_reason"] for e in events)
    (recovery,) = result.named("recovery.completed")
    assert recovery["steps_lost"] == 9 - 6
    assert_bit_identical(tmp_path, reference(*DROPOUT))


def test_a_kill_while_a_copy_is_written_never_uses_the_half_copy(
    tmp_path, reference, worker_env_module
):
    env = {**worker_env_module, KILL_MEMORY_WRITE_ENV: "9"}  # each rank, mid-copy of its part
    result = run(tmp_path, env, 2, *DROPOUT, *EVERY_STEP)
    events = restored(result)
    assert [e["source"] for e in events] == ["memory", "memory"]
    assert {e["step"] for e in events} <= {7, 8}  # the copy of step 9 was torn
    assert_bit_identical(tmp_path, reference(*DROPOUT))


def test_a_second_failure_during_the_just_in_time_copy_never_uses_the_half_copy(
    tmp_path, reference, worker_env_module
):
    """Rank 1 crashes after step 9; rank 0, the survivor, is killed in the middle of writing
    its just-in-time copy of that step (a second failure during the dump). No whole copy of
    step 9 exists anywhere: the next group restores from storage (step 6, or nothing where
    rank 0 died before its asynchronous write of step 6 committed: timing), says why, and
    trains to the same result as the uninterrupted run."""
    env = {**worker_env_module, KILL_MEMORY_WRITE_ENV: "9"}
    result = run(tmp_path, env, 2, *DROPOUT, "--crash-at-step", "9", "--crash-rank", "1")
    killed = [e for e in result.named("worker.failed") if e["rank"] == 0]
    assert killed and killed[0]["signal"] == "SIGKILL", killed  # died in its copy, not of error
    events = restored(result)
    assert all(e["source"] == "storage" and e["fallback_reason"] for e in events), events
    assert [e["step"] for e in events] in ([6, 6], [])
    (recovery,) = result.named("recovery.completed")
    assert recovery["steps_lost"] == 9 - (events[0]["step"] if events else 0)
    assert_bit_identical(tmp_path, reference(*DROPOUT))


def test_memory_stays_bounded_with_a_copy_every_step(tmp_path, worker_env_module):
    probe = tmp_path / "rss.json"
    run(
        tmp_path, worker_env_module, 2,
        "--memory-dir-per-rank", "--width", "1024", "--samples", "2400", "--epochs", "1",
        "--max-micro-batch", "12", "--snapshot-every", "100", "--rss-out", str(probe),
        *EVERY_STEP,
    )  # fmt: skip
    figures = json.loads(probe.read_text())
    rss, tier, state = figures["rss"], figures["tier"], figures["state_bytes"]
    assert len(rss) == 200
    # at least one copy, at most two on tmpfs (the latest and the one being written)
    assert state <= max(tier) <= 2 * state * 1.2 + 1_000_000, (max(tier), state)
    # after warm-up the process holds one staging copy; one copy kept per step would grow
    # by 180 copies: allow 10 (allocator and pickling noise)
    warm = rss[20]
    assert max(rss[20:]) - warm <= 10 * state, (warm, max(rss[20:]), state)
