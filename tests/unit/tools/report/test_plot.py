"""The report's drawing helpers: series break at restarts, world size held to the end."""

from __future__ import annotations

import math

from elastic_trainer.tools.report.plot import _series, world_size_steps


def progress(t: float, step: int, restart_count: int = 0) -> dict:
    return {
        "event": "train.progress",
        "t": t,
        "step": step,
        "loss": 1.0 / step,
        "restart_count": restart_count,
    }


def test_a_restart_breaks_the_line_instead_of_bridging_the_downtime() -> None:
    events = [progress(1, 1), progress(2, 2), progress(9, 2, restart_count=1), progress(10, 3, 1)]
    times, values = _series(events, "train.progress", "loss")
    assert times[:2] == [1.0, 2.0] and math.isnan(times[2]) and times[3:] == [9.0, 10.0]
    assert len(values) == len(times) and math.isnan(values[2])


def test_steps_going_backwards_also_break_the_line() -> None:
    times, _ = _series([progress(1, 5), progress(2, 3)], "train.progress", "loss")
    assert math.isnan(times[1]) and len(times) == 3


def test_world_size_line_is_held_until_the_last_event() -> None:
    events = [
        {"event": "rendezvous.completed", "t": 1.0, "world_size": 2},
        {"event": "membership.changed", "t": 5.0, "new_world_size": 1},
        {"event": "job.finished", "t": 9.0},
    ]
    assert world_size_steps(events) == ([1.0, 5.0, 9.0], [2, 1, 1])


def test_loss_axis_is_logarithmic_only_when_every_loss_is_positive() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from elastic_trainer.tools.report.plot import _draw_training

    def run(val_loss: float) -> str:
        events = [
            {"event": "train.progress", "t": 1.0, "step": 1, "loss": 2.0},
            {
                "event": "train.evaluated",
                "t": 2.0,
                "step": 2,
                "val_loss": val_loss,
                "val_accuracy": 0.1,
            },
        ]
        fig, ax = plt.subplots()
        _draw_training(ax, events)
        scale = ax.get_yscale()
        plt.close(fig)
        return scale

    assert run(345.0) == "log"  # a warm-up spike must not flatten the training curve
    assert run(0.0) == "linear"  # log of zero is undefined: keep the plain axis
