"""bench/goodput.py's arithmetic on made-up runs: schedule, steps lost, goodput."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import goodput
from _goodput_calc import (
    Run,
    due_at,
    failure_free_step_time,
    failure_kind,
    incarnations,
    plain_env,
    restart_losses,
    steps_for,
    summarize,
    table,
)


def group(first: int, last: int, world: int, start: float, step: float = 0.1) -> list:
    """Audit rows of one worker group: steps first..last on each of ``world`` ranks."""
    return [
        (s, rank, world, start + step * (s - first) + 0.001 * rank)
        for s in range(first, last + 1)
        for rank in range(world)
    ]


# a 30-step job: at world size 2 to step 13; a node loss, the survivor resumes from its snapshot
# of step 10 at world size 1 and goes to step 20; the replacement joins and the group resumes
# where it stopped (step 20) and finishes
G0 = group(1, 13, 2, start=10.0)
G1 = group(11, 20, 1, start=30.0)
G2 = group(21, 30, 2, start=50.0)
RESTORED = [9.5, 9.6, 29.0, 49.0, 49.2]


def test_plain_env_drops_thread_tuning_and_keeps_the_rest() -> None:
    env = plain_env({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2", "PATH": "/bin"}, A="x")
    assert env == {"PATH": "/bin", "A": "x"}


def test_steps_fill_the_duration() -> None:
    assert steps_for(300, 0.1) == 3000
    with pytest.raises(ValueError, match="must be > 0"):
        steps_for(0, 0.1)


def test_schedule_alternates_node_loss_and_worker_crash_at_a_fixed_period() -> None:
    assert [failure_kind(i) for i in range(4)] == [
        "node_loss", "worker_crash", "node_loss", "worker_crash",
    ]  # fmt: skip
    assert [due_at(100.0, 60.0, i) for i in range(3)] == [160.0, 220.0, 280.0]


def test_failure_free_step_time_is_first_to_last_completion() -> None:
    assert failure_free_step_time(group(1, 11, 2, start=5.0)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="did not train"):
        failure_free_step_time(group(1, 1, 2, start=5.0))


def test_markers_split_the_rows_into_groups_and_losses_per_restart() -> None:
    groups = incarnations([*G2, *G0, *G1], RESTORED)
    assert [len(g) for g in groups] == [len(G0), len(G1), len(G2)]
    assert restart_losses(groups) == [3, 0]


def test_a_restart_redoing_only_the_last_step_counts_one() -> None:
    # the new group's first step repeats the old group's last: only the markers tell them apart
    groups = incarnations([*group(1, 13, 2, 10.0), *group(13, 20, 2, 30.0)], [9.5, 29.0])
    assert restart_losses(groups) == [1]


def test_a_group_that_wrote_no_row_is_no_restart() -> None:
    groups = incarnations([*G0, *G1], [9.5, 25.0, 29.0])  # 25.0: a start that failed at once
    assert restart_losses(groups) == [3]


def test_goodput_and_losses_of_an_arm() -> None:
    free = Run(steps=30, wall=6.0, rows=group(1, 30, 2, start=2.0), restored=[1.0])
    failed = Run(
        steps=30, wall=15.0, rows=[*G0, *G1, *G2], restored=RESTORED,
        failures=[("node_loss", 11.3), ("worker_crash", 40.0)], relaunches=[45.0],
    )  # fmt: skip
    got = summarize("arm", free, failed)
    assert got.step_time == pytest.approx(0.1)
    assert got.goodput == pytest.approx(30 * 0.1 / 15.0)
    assert got.goodput_failure_free == pytest.approx(30 * 0.1 / 6.0)
    assert (got.failures, got.restarts, got.relaunches, got.steps_lost) == (2, 2, 1, 3)
    assert got.steps_lost_per_failure == pytest.approx(1.5)
    assert got.time_lost_per_failure == pytest.approx(4.5)
    cells = table([got]).splitlines()[2].split(" | ")
    assert (cells[6], cells[7], cells[8]) == ("0.200", "0.500", "0.400")  # × failure-free last


def test_no_failures_leaves_the_per_failure_columns_empty() -> None:
    free = Run(steps=30, wall=6.0, rows=group(1, 30, 2, start=2.0), restored=[1.0])
    got = summarize("arm", free, free)
    assert got.steps_lost_per_failure is None
    assert table([got]).splitlines()[2].endswith("| - | - |")


def test_unknown_arm_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        goodput.parse(["--arms", "torchrun,slurm"])
    assert "--arms: unknown ['slurm']; choose from" in capsys.readouterr().err


def test_an_arm_that_never_recovered_is_a_row_saying_why() -> None:
    free = Run(steps=30, wall=6.0, rows=group(1, 30, 2, start=2.0), restored=[1.0])
    got = summarize("elastic", free, free)
    lines = table([got], [("torchrun", "never trained at world size 2 again")]).splitlines()
    assert len(lines) == 4 and lines[3].startswith(
        "| torchrun: did not recover (never trained at world size 2 again) |"
    )
    assert lines[3].count("|") == lines[2].count("|")  # the same columns as a measured row
