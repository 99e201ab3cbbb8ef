"""Recovery, phase by phase: elastic-train vs torchrun, side by side in one run.

Each launcher runs the same tiny gloo job (tests/e2e/workers/proto_worker.py: an all-reduce
per step, 0.1 s steps, a snapshot every 5 steps) on two "nodes" (two agents on 127.0.0.1,
one worker each). Three scenarios:

- ``node_loss``: both train at world size 2, then the whole second node (agent + worker) is
  SIGKILLed; recovered at the first completed step at world size 1.
- ``worker_crash``: the second node's worker alone is SIGKILLed (its agent survives);
  recovered at the first step of the re-formed world size 2.
- ``node_join``: one node trains alone, a second starts; recovered at the first step at world
  size 2. ``pause`` is how long the running group stopped (its last step alone to its first
  step together), the number the issue's target is about.
- ``store_host_lost``: as ``node_loss``, but the node SIGKILLed is the first one, whose agent
  hosts the rendezvous store; timed on the second. torchrun cannot recover (its c10d store
  lives in the lost agent): its row reads '-' (not observed within ``--timeout``).
- ``store_host_preempted``: the store host gets SIGTERM (a preemption notice) instead.

Two workers (``--workers``): ``plain``, the script above, and ``session``
(bench/_session_worker.py: the same job written against ``elastic_trainer.TrainingSession``,
so it gets the in-memory tier at its defaults: a copy just in time). torchrun runs the
plain one only: under torchrun a ``TrainingSession`` has no in-memory tier (the supervisor
provides its folder), so a session row for torchrun would restore from storage like the plain
script.

Phases, from the fault (the kill, or the second node's start) on the node that keeps running:
``detect`` (its launcher notices: our worker.failed / peer.lost / group.restarting events,
torchrun's "Worker group FAILED" / "Detected N new nodes" log lines), ``rendezvous`` (the
new round closes: our rendezvous.completed, torchrun's "Rendezvous complete"), ``worker
start`` (until every new worker has its process group: process start, ``import torch``,
``init_process_group``; the worker's own markers), ``restore`` (snapshot read), ``first
step``. Steps lost: the last step the old group completed minus the step the new group
resumed from (``snapshot.restored``'s step for the session worker, whose ``source`` column says
where from: ``memory`` its node's copy, ``mirror`` another node's, ``storage``).

    python bench/recovery.py [--repeats N] [--scenarios node_loss,worker_crash,node_join,...]
                             [--launchers torchrun,elastic-train] [--workers plain,session]
                             [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _recovery_parse import PHASES, Result
from _recovery_run import run_scenario

SCENARIOS = (
    "node_loss",
    "worker_crash",
    "node_join",
    "store_host_lost",
    "store_host_preempted",
)
LAUNCHERS = ("torchrun", "elastic-train")
WORKERS = ("plain", "session")
NOTES = """
Rows: launcher (worker). torchrun runs the plain worker only: a TrainingSession under torchrun
has no in-memory tier (elastic-train's supervisor provides its folder), so it would restore from
storage like the plain script. source: snapshot.restored's source on the new group's ranks
(memory: its node's copy, mirror: another node's over the group, storage: the snapshot folder);
'-' for the plain worker, which restores from its own file and logs no event."""


def median(values: list[float | None]) -> float | None:
    ok = [v for v in values if v is not None]
    return statistics.median(ok) if ok else None


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def runs(launchers: list[str], workers: list[str]) -> list[tuple[str, str]]:
    """(launcher, worker) pairs to run: torchrun only with the plain worker."""
    return [(k, w) for k in launchers for w in workers if k != "torchrun" or w == "plain"]


def label(kind: str, worker: str) -> str:
    return f"{kind} ({worker})"


def sources(results: list[Result]) -> str:
    seen = sorted({r.source for r in results if r.source is not None})
    return ",".join(seen) or "-"


def table(scenario: str, results: dict[str, list[Result]]) -> list[str]:
    cols = [*PHASES, "total", "pause", "steps_lost"]
    repeats = max(len(rs) for rs in results.values())
    lines = [f"\n{scenario} (median of {repeats}; seconds)"]
    header = " ".join(f"{c:>12s}" for c in cols)
    lines.append(f"{'launcher (worker)':26s} {header}  × torchrun  source")
    base = median([r.total for r in results.get(label("torchrun", "plain"), [])])
    for name, rs in results.items():
        row = [median([r.phases.get(p) for r in rs]) for p in PHASES]
        row += [median([r.total for r in rs]), median([r.pause for r in rs])]
        lost = median([r.steps_lost for r in rs])
        total = row[len(PHASES)]
        ratio = "-" if total is None or not base else f"{total / base:.3f}"
        cells = " ".join(f"{fmt(v):>12s}" for v in row) + f" {fmt(lost, 0):>12s}"
        lines.append(f"{name:26s} {cells}  {ratio:>9s}  {sources(rs)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument(
        "--workers", default=",".join(WORKERS), help="plain (torchrun-style), session"
    )
    parser.add_argument("--keep-logs", default="", help="copy each run's logs under this folder")
    parser.add_argument("--timeout", type=float, default=90.0, help="per recovery, seconds")
    args = parser.parse_args()
    chosen = [s for s in args.scenarios.split(",") if s]
    launchers = [k for k in args.launchers.split(",") if k]
    workers = [w for w in args.workers.split(",") if w]
    checks = (
        ("--scenarios", chosen, SCENARIOS),
        ("--launchers", launchers, LAUNCHERS),
        ("--workers", workers, WORKERS),
    )
    for flag, given, known in checks:
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"{flag}: unknown {unknown}; choose from {','.join(known)}")
    began = time.monotonic()
    out: list[str] = []
    for scenario in chosen:
        pairs = runs(launchers, workers)
        results: dict[str, list[Result]] = {label(*pair): [] for pair in pairs}
        for _ in range(args.repeats):
            for kind, worker in pairs:  # interleaved, so all see the same machine load
                result = run_scenario(
                    scenario, kind, args.timeout, worker=worker, keep_logs=args.keep_logs
                )
                results[label(kind, worker)].append(result)
                print(f"  {scenario} {label(kind, worker)}: {result}", file=sys.stderr)
        out += table(scenario, results)
    print("\n".join(out))
    print(NOTES)
    print(f"\n({time.monotonic() - began:.0f} s in all; '-': not observed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
