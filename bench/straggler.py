"""Stragglers: how fast a slow node is named, how often a healthy job is, and what leaving
the slow node out gives back.

Each arm runs the same 3-node gloo job on this machine (three ``elastic-train`` agents on one
rendezvous endpoint, one worker each: tests/e2e/workers/straggler_worker.py, a DDP MLP under
``TrainingSession``) and reads the events of all three logs:

- ``healthy``: no injection; every ``straggler.detected`` is a false report.
- ``sleep``: node b's forward sleeps ``--slow-s`` more from step ``--onset`` (the worker's seam).
- ``sigstop``: node b's worker is stopped and continued on a duty cycle (``--stop-ms`` stopped,
  ``--run-ms`` running) from step ``--onset``.
- ``two-nodes``: a 2-node job (a and c): the step time once b is left out.
- ``evict``: the ``sleep`` arm with ``--evict-stragglers 1.3`` on every node: b leaves when
  named (its cool-down outlasts the run), a and c re-form and train on.

Per arm: the detection delay in steps (the reported step less the onset), false reports, and
the median step time over the steps after the onset. The recovered share is what leaving b
out would give back of what b cost: (slowed - two-nodes) / (slowed - healthy), 100 % when the
group without b steps as fast as the healthy group; the re-form's own pause is not in it
(docs/stragglers.md). The evicted share is what eviction itself gave back, its pause and the
detection delay included: the wall time from the onset to the last step, (sleep - evict) /
(sleep - healthy). ``--healthy-minutes M`` instead runs one healthy job for M minutes and
prints its false reports (docs/benchmarks.md: the 30-minute run).

    python bench/straggler.py [--repeats 3] [--steps 160] [--onset 50]
    python bench/straggler.py --healthy-minutes 30 --out /tmp/straggler-30min
    python bench/straggler.py --cost   # the watch's own work per step, by world size
    # steps of 0.3 s / world size that do not compete for cores, b 2x slower: what eviction gives
    python bench/straggler.py --repeats 1 --arms healthy,sleep,two-nodes,evict --steps 400 \
        --base-s 0.3 --width 64 --slow-s 0.1
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "e2e" / "workers" / "straggler_worker.py")
sys.path.insert(0, str(ROOT))
from tests.e2e.workers.harness import wait_for  # noqa: E402
from tests.e2e.workers.slowness import duty_cycle  # noqa: E402

RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,close_timeout=5"


# ---- the arithmetic (pure; tests/bench/test_straggler.py) --------------------------------
@dataclass(frozen=True)
class ArmResult:
    arm: str
    detected_node: str | None  # the first straggler.detected's node (None: none)
    delay_steps: int | None  # its step less the onset
    false_reports: int  # detections of another node, or of any node before the onset
    step_s: float | None  # median step time after the onset
    after_onset_s: float | None = None  # wall time from the onset's step to the last step


def step_times(trace: list[tuple[int, float]], after_step: int) -> list[float]:
    """Seconds per step from a rank's "step unix_time" trace, for steps after ``after_step``."""
    return [
        t1 - t0
        for (s0, t0), (s1, t1) in itertools.pairwise(trace)
        if s0 >= after_step and s1 == s0 + 1
    ]


def judge(
    arm: str,
    detections: Iterable[dict],
    onset: int | None,
    slow_node: str | None,
    trace: list[tuple[int, float]],
) -> ArmResult:
    """One run's figures from its ``straggler.detected`` events (all nodes) and a trace."""
    hits = sorted(detections, key=lambda e: int(e["step"]))
    true = [
        e
        for e in hits
        if slow_node is not None and e.get("node") == slow_node and int(e["step"]) >= onset
    ]
    first = true[0] if true else None
    times = step_times(trace, onset or 0)
    return ArmResult(
        arm=arm,
        detected_node=first.get("node") if first else None,
        delay_steps=int(first["step"]) - onset if first and onset is not None else None,
        false_reports=len(hits) - len(true),
        step_s=statistics.median(times) if times else None,
        after_onset_s=wall_after(trace, onset or 0),
    )


def wall_after(trace: list[tuple[int, float]], onset: int) -> float | None:
    """Seconds from the last time the trace was at ``onset`` to its last step (a step
    trained again after a restore counts once, at its newest time: the wall clock runs on)."""
    at_onset = [t for s, t in trace if s == onset]
    return trace[-1][1] - at_onset[-1] if at_onset and trace else None


def recovered_share(healthy_s: float, slowed_s: float, without_s: float) -> float | None:
    """The share of a straggler's cost that leaving it out gives back (None: it cost nothing)."""
    cost = slowed_s - healthy_s
    if cost <= 0:
        return None
    return (slowed_s - without_s) / cost


# ---- the processes -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_TRAIN_", "PET_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


class Job:
    """A job of ``nodes`` agents in ``folder``: ``NODE.jsonl`` logs, ``trace-NODE`` traces."""

    def __init__(
        self,
        folder: Path,
        nodes: tuple[str, ...],
        worker_args: list[str],
        supervisor_args: tuple[str, ...] = (),
        min_nodes: int | None = None,
    ) -> None:
        self.folder, self.nodes = folder, nodes
        port = _free_port()
        self.agents: dict[str, subprocess.Popen] = {}
        for name in nodes:
            argv = [
                sys.executable, "-m", "elastic_trainer", "--log-format", "json",
                "--log-file", str(folder / f"{name}.jsonl"), "--node", name,
                "--job-id", "bench-straggler", "--min-nodes", str(min_nodes or len(nodes)),
                "--max-nodes", str(len(nodes)), "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-conf", RDZV_CONF, *supervisor_args, WORKER, *worker_args,
                "--trace", str(folder / f"trace-{name}"),
            ]  # fmt: skip
            with open(folder / f"{name}.stderr", "wb") as err:
                self.agents[name] = subprocess.Popen(argv, env=_env(), stdout=err, stderr=err)
            if name == nodes[0]:
                wait_for(lambda: _listening(port), 60, "the store")

    def trace(self, name: str) -> list[tuple[int, float]]:
        """(step, unix time) per step of node ``name``'s worker."""
        return [(step, at) for step, at, _ in self.traced(name)]

    def traced(self, name: str) -> list[tuple[int, float, int]]:
        with contextlib.suppress(OSError):
            lines = (self.folder / f"trace-{name}").read_text().split("\n")[:-1]
            return [(int(s), float(t), int(p)) for s, t, p in (line.split() for line in lines)]
        return []

    def events(self, event: str) -> list[dict]:
        import json

        out = []
        for name in self.nodes:
            with contextlib.suppress(OSError):
                for line in (self.folder / f"{name}.jsonl").read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        record = json.loads(line)
                        if record.get("event") == event:
                            out.append(record)
        return out

    def wait(self, timeout: float, nodes: Iterable[str] | None = None) -> None:
        for name in self.nodes if nodes is None else nodes:
            self.agents[name].wait(timeout=timeout)

    def stop(self) -> None:
        for proc in self.agents.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(60)
        for proc in self.agents.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_arm(arm: str, args: argparse.Namespace, folder: Path) -> ArmResult:
    steps = ["--steps", str(args.steps), "--base-s", str(args.base_s), "--width", str(args.width)]
    seam = ["--slow-node", "b", "--slow-from", str(args.onset), "--slow-s", str(args.slow_s)]
    if arm == "sleep":
        job = Job(folder, ("a", "b", "c"), steps + seam)
    elif arm == "evict":
        # b's cool-down outlasts the run: the figure is the group without it
        evict = ("--evict-stragglers", "1.3", "--evict-cooldown", "3600", "--snapshot-dir",
                 str(folder / "snapshots"))  # fmt: skip
        job = Job(folder, ("a", "b", "c"), steps + seam, evict, min_nodes=2)
    else:
        job = Job(folder, ("a", "c") if arm == "two-nodes" else ("a", "b", "c"), steps)
    onset: int | None = args.onset
    try:
        if arm == "sigstop":
            wait_for(lambda: job.trace("b") and job.trace("b")[-1][0] >= args.onset, 300, "onset")
            completed, _, pid = job.traced("b")[-1]
            onset = completed + 1  # the step in progress when the cycle begins: the first slowed
            done = threading.Event()
            cycle = (pid, done, args.stop_ms / 1e3, args.run_ms / 1e3)
            thread = threading.Thread(target=duty_cycle, args=cycle, daemon=True)
            thread.start()
            job.wait(600)
            done.set()
            thread.join()
        elif arm == "evict":
            job.wait(600, ("a", "c"))  # b waits out its cool-down: stopped below
        else:
            job.wait(600)
    finally:
        job.stop()
    slow = "b" if arm in ("sleep", "sigstop", "evict") else None
    return judge(arm, job.events("straggler.detected"), onset, slow, job.trace(job.nodes[0]))


def healthy_for(minutes: float, folder: Path) -> None:
    job = Job(folder, ("a", "b", "c"), ["--steps", "100000000"])
    began = time.time()
    try:
        while time.time() - began < minutes * 60:
            time.sleep(10)
            if any(p.poll() is not None for p in job.agents.values()):
                break
    except KeyboardInterrupt:
        pass  # stopped early: the figures so far
    finally:
        steps = job.trace("a")[-1][0] if job.trace("a") else 0
        job.stop()
    false = job.events("straggler.detected")
    print(f"healthy run: {(time.time() - began) / 60:.1f} min, {steps} steps, "
          f"{len(false)} false reports")  # fmt: skip
    for event in false:
        print(f"  step {event['step']}: node {event['node']} x{event['slowdown']}")


def verdict_cost_us(world: int, steps: int = 300) -> float:
    """µs per step of the pure verdict (``worker.stragglers.observe``) at ``world`` ranks,
    on noisy made-up compute times (what every rank runs after every step)."""
    import random

    from elastic_trainer.worker.stragglers import StragglerPolicy, Watch, observe

    rng, policy, watch = random.Random(0), StragglerPolicy(), Watch()
    vectors = [[0.1 * (1 + rng.random() * 0.2) for _ in range(world)] for _ in range(steps)]
    began = time.perf_counter()
    for step, compute in enumerate(vectors, start=1):
        watch, _ = observe(watch, step, compute, policy)
    return (time.perf_counter() - began) / steps * 1e6


def timing_cost_us(steps: int = 20000) -> float:
    """µs per step of this rank's own measuring on the host (a mark, a read)."""
    from elastic_trainer.worker.step_timing import StepTiming, Stopwatch

    timing = StepTiming(Stopwatch(None))
    began = time.perf_counter()
    for _ in range(steps):
        timing.compute_us()
        timing.released()
    return (time.perf_counter() - began) / steps * 1e6


def cost_table(step_ms: float) -> str:
    head = f"share of a {step_ms:g} ms step"
    lines = [f"{'ranks':>6} {'verdict (us)':>13} {'timing (us)':>12} {head:>24}"]
    timing = timing_cost_us()
    for world in (2, 8, 64, 256, 1024, 16384):
        verdict = verdict_cost_us(world, steps=300 if world <= 256 else 40)
        share = (verdict + timing) / (step_ms * 1e3)
        lines.append(f"{world:>6} {verdict:>13.1f} {timing:>12.2f} {100 * share:>23.2f}%")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--onset", type=int, default=50)
    parser.add_argument("--slow-s", type=float, default=0.08)
    parser.add_argument(
        "--base-s", type=float, default=0.0, help="a step sleeps this / world size on every rank"
    )
    parser.add_argument("--width", type=int, default=640, help="the worker's matrix side")
    parser.add_argument("--stop-ms", type=float, default=50)
    parser.add_argument("--run-ms", type=float, default=25)
    parser.add_argument("--arms", default="healthy,sleep,sigstop,two-nodes,evict")
    parser.add_argument("--healthy-minutes", type=float)
    parser.add_argument("--cost", action="store_true", help="the watch's own work per step")
    parser.add_argument("--step-ms", type=float, default=100.0, help="--cost: the step to compare")
    parser.add_argument("--out", help="keep the runs' logs here (default: a temporary folder)")
    args = parser.parse_args()
    if args.cost:
        print(cost_table(args.step_ms))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-straggler-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.healthy_minutes:
        healthy_for(args.healthy_minutes, out)
        return
    results: dict[str, list[ArmResult]] = {}
    for repeat in range(args.repeats):
        for arm in args.arms.split(","):
            folder = out / f"{arm}-{repeat}"
            folder.mkdir()
            results.setdefault(arm, []).append(run_arm(arm, args, folder))
    print(table(results))


def table(results: dict[str, list[ArmResult]]) -> str:
    """The figures of each arm (medians over repeats) and the recovered share."""
    lines = [f"{'arm':10} {'named':>9} {'delay (steps)':>15} {'false':>6} {'step (ms)':>10}"]
    medians: dict[str, float] = {}
    for arm, runs in results.items():
        delays = [r.delay_steps for r in runs if r.delay_steps is not None]
        named = sum(1 for r in runs if r.detected_node is not None)
        times = [r.step_s for r in runs if r.step_s is not None]
        if times:
            medians[arm] = statistics.median(times)
        delay = f"{min(delays)}..{max(delays)}" if delays else "-"
        step = f"{medians[arm] * 1e3:.1f}" if arm in medians else "-"
        false = sum(r.false_reports for r in runs)
        lines.append(f"{arm:10} {named:>5}/{len(runs):<3} {delay:>15} {false:>6} {step:>10}")
    for slowed in ("sleep", "sigstop"):
        if {"healthy", slowed, "two-nodes"} <= medians.keys():
            share = recovered_share(medians["healthy"], medians[slowed], medians["two-nodes"])
            text = "n/a" if share is None else f"{100 * share:.0f} %"
            lines.append(f"recovered by leaving b out ({slowed}): {text}")
    walls = {
        arm: statistics.median(w)
        for arm, runs in results.items()
        if (w := [r.after_onset_s for r in runs if r.after_onset_s is not None])
    }
    if {"healthy", "sleep", "evict"} <= walls.keys():
        share = recovered_share(walls["healthy"], walls["sleep"], walls["evict"])
        text = "n/a" if share is None else f"{100 * share:.0f} %"
        lines.append(
            f"onset to last step: healthy {walls['healthy']:.1f} s, sleep {walls['sleep']:.1f} s,"
            f" evict {walls['evict']:.1f} s; recovered by --evict-stragglers: {text}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
