"""bench/ettr.py's model and validation arithmetic, against hand-computed cases."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ettr as bench
from _ettr_measure import Measured, join_pause, launch_time, measure_failure, predict, start_time
from _ettr_model import (
    NODE_LOSS,
    WORKER_CRASH,
    Failure,
    Job,
    KindCost,
    Recovery,
    ettr,
    intervals,
    kind_costs,
    parse_trace,
    poisson_failures,
    replay,
)

from elastic_trainer.worker.interval import budget_steps, young_daly_steps

CRASH = {WORKER_CRASH: KindCost(downtime_s=5.0)}


def one_replay(*failures: Failure, costs=CRASH, **kw):
    args = {"steps": 100, "step_s": 1.0, "start_s": 10.0} | kw
    return replay(failures=list(failures), costs=costs, **args)


def test_one_failure_resuming_from_the_step_it_interrupted() -> None:
    # 20.5 steps done at 30.5 s; the half step is redone; 5 s down; 80 steps left
    got = one_replay(Failure(30.5, WORKER_CRASH))
    assert got.wall_s == pytest.approx(30.5 + 5 + 80)
    assert got.goodput == pytest.approx(100 / 115.5)
    assert (got.failures, got.redone_steps) == (1, pytest.approx(0.5))


def test_one_failure_resuming_from_a_copy_every_8_steps() -> None:
    got = one_replay(
        Failure(30.5, WORKER_CRASH), costs={WORKER_CRASH: KindCost(downtime_s=5.0, every=8)}
    )
    assert got.redone_steps == pytest.approx(4.5)  # back to step 16
    assert got.wall_s == pytest.approx(35.5 + 84)


def test_a_failure_during_a_recovery_starts_it_again_and_one_after_the_end_is_no_failure() -> None:
    got = one_replay(Failure(30.5, WORKER_CRASH), Failure(32.0, WORKER_CRASH),
                     Failure(500.0, WORKER_CRASH))  # fmt: skip
    assert got.wall_s == pytest.approx(32 + 5 + 80)
    assert got.failures == 2


def test_stall_slows_every_step_and_counts_as_lost() -> None:
    got = one_replay(stall_s=0.25)
    assert got.wall_s == pytest.approx(10 + 125)
    assert got.goodput == pytest.approx(100 / 135)


def test_a_failure_kind_without_a_cost_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="node_loss"):
        one_replay(Failure(30.0, NODE_LOSS))


REC = Recovery(detect_s=1.0, reform_base_s=2.0, reform_per_node_s=0.5, workers_s=3.0,
               restore_s=4.0, first_step_extra_s=0.5, join_pause_s=1.0, start_s=100.0)  # fmt: skip


def test_expected_ettr_of_a_hand_computed_job() -> None:
    # one node, a failure every 1000 s, nothing to copy or read, no stall (no state)
    job = Job(gpus=8, step_s=10.0, gpu_mtbf_s=8000.0, wall_s=1e6, sharded=False)
    est = ettr(job, REC)
    # per failure: 1 + 2.5 + 3 + 4 + 0.5 + half a step redone (5) + the join (1) = 17 s
    assert est.per_failure_s == pytest.approx(17.0)
    assert est.ettr == pytest.approx(1 - 17 / 1000 - 102.5 / 1e6)
    assert est.dominant == "redo"
    assert est.ettr + sum(est.losses.values()) == pytest.approx(1.0)


def test_the_re_form_grows_with_the_nodes_and_comes_to_dominate() -> None:
    small, large = (Job(gpus=g, step_s=10.0, sharded=False) for g in (8, 8 * 10_000))
    assert ettr(large, REC).losses["reform"] > ettr(small, REC).losses["reform"]
    assert ettr(large, REC).dominant == "reform"
    assert ettr(large, REC).failures == pytest.approx(10_000 * ettr(small, REC).failures)


def test_intervals_are_the_products_own() -> None:
    job = Job(gpus=16, step_s=1.0, state_gb_per_gpu=1.0, memory_stall_s_per_gb=0.1,
              storage_stall_s_per_gb=8.0, snapshot_every="auto", gpu_mtbf_s=57_600.0)  # fmt: skip
    iv = intervals(job)
    assert iv.memory_every == budget_steps(cost_s=0.1, step_s=1.0)
    assert iv.storage_every == young_daly_steps(cost_s=8.0, mtbf_s=3600.0, step_s=1.0)
    assert iv.stall_per_step_s == pytest.approx(0.1 / iv.memory_every + 8.0 / iv.storage_every)
    # a choice within 20 % of the first interval (100) is not taken, as the product does
    near = Job(**{**job.__dict__, "storage_stall_s_per_gb": 2.0})
    assert young_daly_steps(cost_s=2.0, mtbf_s=3600.0, step_s=1.0) == 120
    assert intervals(near).storage_every == 100
    assert intervals(Job(gpus=16, step_s=1.0, sharded=False)).memory_every is None


def test_sharded_state_redoes_the_steps_since_the_last_periodic_copy() -> None:
    job = Job(gpus=8, step_s=1.0, state_gb_per_gpu=1.0, memory_stall_s_per_gb=0.1)
    every = intervals(job).memory_every
    stall = intervals(job).stall_per_step_s
    redo = ettr(job, REC.__class__(**{**REC.__dict__})).losses["redo"] * job.mtbf_s
    assert redo == pytest.approx((0.5 + (every - 1) / 2) * (1.0 + stall))


def test_the_expected_value_matches_a_long_poisson_replay() -> None:
    job = Job(gpus=8, step_s=1.0, gpu_mtbf_s=8 * 500.0, wall_s=1e6, sharded=False)
    rec = Recovery(**{**REC.__dict__, "start_s": 0.0, "reform_base_s": 0.0,
                      "reform_per_node_s": 0.0})  # fmt: skip
    steps = 400_000
    trace = poisson_failures(rate_per_s=1 / 500, horizon_s=2 * steps, seed=7)
    got = replay(steps=steps, step_s=1.0, start_s=0.0, failures=trace, costs=kind_costs(job, rec))
    assert got.goodput == pytest.approx(ettr(job, rec).ettr, abs=0.003)


def test_a_trace_csv() -> None:
    text = "seconds,kind\n10, node_loss\n# a comment\n\n5,worker_crash\n7\n"
    assert parse_trace(text) == [Failure(5.0, WORKER_CRASH), Failure(7.0, NODE_LOSS),
                                 Failure(10.0, NODE_LOSS)]  # fmt: skip
    with pytest.raises(ValueError, match="line 2"):
        parse_trace("at\n-3,node_loss\n")
    with pytest.raises(ValueError, match="line 1"):
        parse_trace("5,meteor\n")


def test_bad_job_figures_are_refused() -> None:
    with pytest.raises(ValueError, match="storage_share"):
        Job(gpus=8, step_s=1.0, storage_share=2.0)
    with pytest.raises(ValueError, match="step time"):
        Job(gpus=8, step_s=0.0)


# --- validation: a made-up two-node run, a node loss at 100 s and a worker crash at 130 s -----
def rows(first: int, last: int, world: int, t0: float) -> list:
    return [(s, r, world, t0 + 0.1 * (s - first)) for s in range(first, last + 1)
            for r in range(world)]  # fmt: skip


AUDIT = (rows(1, 880, 2, 12.0) + rows(881, 973, 1, 100.7) + rows(974, 1150, 2, 110.2)
         + rows(1151, 1500, 2, 130.9))  # fmt: skip
LAUNCH = 0.0


def event(name: str, t: float, **fields) -> dict:
    stamp = datetime.fromtimestamp(t, UTC).isoformat()
    return {"event": name, "timestamp": stamp, "_t": t, **fields}


EV_A = [event("peer.lost", 100.1), event("rendezvous.completed", 100.4),
        event("group.restarting", 128.3), event("rendezvous.completed", 128.6)]  # fmt: skip
EV_B = [event("snapshot.restored", 100.52, step=880, source="memory"),
        event("snapshot.restored", 130.7, step=1150, source="memory")]  # fmt: skip
# the replacement's markers (world size 2, 109.5) belong to its join, not to the node loss's
MARKS = [("group_ready", 100.5, 1), ("restored", 100.55, 1), ("group_ready", 109.5, 2),
         ("restored", 109.6, 2), ("group_ready", 130.6, 2), ("restored", 130.7, 2)]  # fmt: skip


def test_a_node_loss_measured_phase_by_phase() -> None:
    m = measure_failure(kind=NODE_LOSS, at=100.0, launched=LAUNCH, step_s=0.1, rows=AUDIT,
                        marks=MARKS, survivor=EV_A, events=EV_A + EV_B)  # fmt: skip
    assert m is not None
    assert m.phases == pytest.approx({"detect": 0.1, "rendezvous": 0.3, "worker_start": 0.1,
                                      "restore": 0.05, "first_step": 0.05})  # fmt: skip
    assert m.join_pause_s == pytest.approx(0.2)  # 109.9 -> 110.2, less a step
    assert m.steps_lost == 0


def test_join_pause_start_and_launch() -> None:
    assert join_pause(AUDIT, 100.0, 0.1) == pytest.approx(0.2)
    assert join_pause(AUDIT, 200.0, 0.1) is None
    assert launch_time(AUDIT, 1500, 165.8) == pytest.approx(130.9 + 34.9 - 165.8)
    assert start_time(AUDIT, 0.0, 0.1) == pytest.approx(11.9)


def test_the_prediction_replays_the_runs_own_failures_with_the_median_phases() -> None:
    phases = {"detect": 0.1, "rendezvous": 0.3, "worker_start": 0.1, "restore": 0.05,
              "first_step": 0.05}  # fmt: skip
    measured = [Measured(kind=NODE_LOSS, at_s=100.0, phases=phases, join_pause_s=0.2,
                         steps_lost=0),
                Measured(kind=WORKER_CRASH, at_s=128.0, phases=phases | {"detect": 0.5},
                         join_pause_s=None, steps_lost=0)]  # fmt: skip
    got = predict(
        steps=1500,
        step_s=0.1,
        start_s=11.9,
        failures=[(NODE_LOSS, 100.0), (WORKER_CRASH, 128.0)],
        measured=measured,
    )
    # 150 s of steps, the start, 0.8 + 1.0 s down, and two interrupted steps' parts redone
    redone = got.redone_steps * 0.1
    assert got.wall_s == pytest.approx(11.9 + 150 + 0.8 + 1.0 + redone)
    assert 0 <= redone <= 0.2


def test_the_harness_end_to_end_on_a_made_up_run(tmp_path: Path, capsys) -> None:
    logs = tmp_path / "logs" / "elastic-train-session-failures-1"
    logs.mkdir(parents=True)
    (logs / "markers").write_text("".join(f"{n} {t:.3f} 0 {w}\n" for n, t, w in MARKS))
    (logs / "a.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EV_A))
    (logs / "b.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EV_B))
    wall = 165.8 - 0.2
    data = {"results": [{"steps": 1500, "step_time": 0.1, "goodput": 150 / wall, "steps_lost": 0}],
            "runs": {"elastic-train": {"failures": {
                "wall": wall, "rows": AUDIT,
                "failures": [[NODE_LOSS, 100.0], [WORKER_CRASH, 128.0]]}}}}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(data))
    trace = tmp_path / "trace.csv"
    trace.write_text("3600,node_loss\n7200,worker_crash\n")
    out = tmp_path / "out.json"
    assert (
        bench.main(
            [
                "--from-json",
                str(tmp_path / "run.json"),
                "--from-logs",
                str(tmp_path / "logs"),
                "--trace",
                str(trace),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "modelled - measured" in printed and "| 16,384 |" in printed
    assert "2 failures at 16,384 GPUs" in printed
    saved = json.loads(out.read_text())
    assert len(saved["validation"]["per_failure"]) == 2
    assert set(saved["scale"]) == {str(g) for g in bench.SCALES}
