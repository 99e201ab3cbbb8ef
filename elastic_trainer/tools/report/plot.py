"""One PNG of a run: loss and accuracy over time above, world size below, incidents on both.

matplotlib is an optional dependency (``pip install 'elastic-train[report]'``) and always
runs with the Agg backend: no display needed on a cluster's login node.
"""

from __future__ import annotations

import math
from typing import Any

from elastic_trainer.errors import ConfigError
from elastic_trainer.tools.report.summary import Event, incident_node, named, node_of

# event name -> (label, colour, line style): the markers drawn across both panels
MARKERS: dict[str, tuple[str, str, str]] = {
    "worker.failed": ("failure", "tab:red", "-"),
    "group.restarting": ("restart", "tab:orange", "--"),
    "preemption.received": ("preemption", "tab:purple", "-."),
    "snapshot.saved": ("snapshot", "tab:green", ":"),
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError(
            "the report needs matplotlib: pip install 'elastic-train[report]'"
        ) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def world_size_steps(events: list[Event]) -> tuple[list[float], list[int]]:
    """Times and world sizes for a step line, held until the last event."""
    node = incident_node(events)
    times, sizes = [], []
    for event in named(events, "rendezvous.completed", "membership.changed"):
        if node is not None and node_of(event) != node:
            continue
        size = event.get("world_size", event.get("new_world_size"))
        if isinstance(size, int):
            times.append(float(event["t"]))
            sizes.append(size)
    if times:
        times.append(float(events[-1]["t"]))
        sizes.append(sizes[-1])
    return times, sizes


def _series(events: list[Event], name: str, key: str) -> tuple[list[float], list[float]]:
    """Points of one metric; a NaN gap where a restart rolled the steps back, so the line
    does not bridge the downtime (the redone steps are drawn again, as they happened)."""
    times: list[float] = []
    values: list[float] = []
    previous: Event | None = None
    for event in named(events, name):
        if event.get(key) is None:
            continue
        if previous is not None and _new_attempt(previous, event):
            times.append(math.nan)
            values.append(math.nan)
        times.append(float(event["t"]))
        values.append(float(event[key]))
        previous = event
    return times, values


def _new_attempt(before: Event, after: Event) -> bool:
    if before.get("restart_count") != after.get("restart_count"):
        return True
    return int(after.get("step") or 0) < int(before.get("step") or 0)


def _draw_training(ax: Any, events: list[Event]) -> None:
    train = _series(events, "train.progress", "loss")
    val = _series(events, "train.evaluated", "val_loss")
    ax.plot(*train, color="tab:blue", label="train loss")
    ax.plot(*val, "o-", color="tab:cyan", label="val loss")
    losses = [v for v in train[1] + val[1] if not math.isnan(v)]
    if losses and min(losses) > 0:
        # one early spike (a warm-up blow-up) would flatten everything else on a linear axis
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    acc_ax = ax.twinx()
    times, acc = _series(events, "train.evaluated", "val_accuracy")
    acc_ax.plot(times, [100 * a for a in acc], "s-", color="tab:olive", label="val accuracy")
    acc_ax.set_ylabel("accuracy (%)")
    acc_ax.set_ylim(0, 100)
    handles = ax.get_legend_handles_labels()
    acc_handles = acc_ax.get_legend_handles_labels()
    ax.legend(
        handles[0] + acc_handles[0],
        handles[1] + acc_handles[1],
        loc="upper right",
        fontsize="small",
    )


def _draw_markers(axes: list[Any], events: list[Event]) -> None:
    for name, (label, colour, style) in MARKERS.items():
        times = [float(e["t"]) for e in named(events, name)]
        for i, t in enumerate(times):
            for ax in axes:
                ax.axvline(
                    t,
                    color=colour,
                    linestyle=style,
                    linewidth=1.0,
                    alpha=0.7,
                    label=label if i == 0 and ax is axes[-1] else None,
                )


def draw_report(events: list[Event], output: str, *, title: str) -> None:
    """Write the run's PNG to ``output``."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(11, 6.5), gridspec_kw={"height_ratios": [3, 1]}
    )
    _draw_training(top, events)
    times, sizes = world_size_steps(events)
    bottom.step(times, sizes, where="post", color="black", label="world size")
    bottom.set_ylabel("world size")
    bottom.set_ylim(0, max(sizes, default=1) + 1)
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.set_xlabel("seconds since the run started")
    _draw_markers([top, bottom], events)
    bottom.legend(loc="upper left", fontsize="small", ncol=5)
    top.set_title(title)
    fig.tight_layout()
    try:
        fig.savefig(output, dpi=110)
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {output!r} ({exc.strerror})") from exc
    finally:
        plt.close(fig)
