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

Phases, from the fault (the kill, or the second node's start) on the node that keeps running:
``detect`` (its launcher notices: our worker.failed / peer.lost / group.restarting events,
torchrun's "Worker group FAILED" / "Detected N new nodes" log lines), ``rendezvous`` (the
new round closes: our rendezvous.completed, torchrun's "Rendezvous complete"), ``worker
start`` (until every new worker has its process group: process start, ``import torch``,
``init_process_group``; the worker's own markers), ``restore`` (snapshot read), ``first
step``. Steps lost: the last step done before the fault minus the step the group resumed from.

    python bench/recovery.py [--repeats N] [--scenarios node_loss,worker_crash,node_join]
                             [--launchers torchrun,elastic-train] [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _recovery_run import PHASES, Result, run_scenario

SCENARIOS = ("node_loss", "worker_crash", "node_join")
LAUNCHERS = ("torchrun", "elastic-train")


def median(values: list[float | None]) -> float | None:
    ok = [v for v in values if v is not None]
    return statistics.median(ok) if ok else None


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(scenario: str, results: dict[str, list[Result]]) -> list[str]:
    cols = [*PHASES, "total", "pause", "steps_lost"]
    repeats = max(len(rs) for rs in results.values())
    lines = [f"\n{scenario} (median of {repeats}; seconds)"]
    lines.append(f"{'launcher':14s} " + " ".join(f"{c:>12s}" for c in cols) + "  × torchrun")
    base = median([r.total for r in results.get("torchrun", [])])
    for kind, rs in results.items():
        row = [median([r.phases.get(p) for r in rs]) for p in PHASES]
        row += [median([r.total for r in rs]), median([r.pause for r in rs])]
        lost = median([r.steps_lost for r in rs])
        total = row[len(PHASES)]
        ratio = "-" if total is None or not base else f"{total / base:.3f}"
        cells = " ".join(f"{fmt(v):>12s}" for v in row) + f" {fmt(lost, 0):>12s}"
        lines.append(f"{kind:14s} {cells}  {ratio}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--keep-logs", default="", help="copy each run's logs under this folder")
    parser.add_argument("--timeout", type=float, default=90.0, help="per recovery, seconds")
    args = parser.parse_args()
    chosen = [s for s in args.scenarios.split(",") if s]
    launchers = [k for k in args.launchers.split(",") if k]
    checks = (("--scenarios", chosen, SCENARIOS), ("--launchers", launchers, LAUNCHERS))
    for flag, given, known in checks:
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"{flag}: unknown {unknown}; choose from {','.join(known)}")
    began = time.monotonic()
    out: list[str] = []
    for scenario in chosen:
        results: dict[str, list[Result]] = {k: [] for k in launchers}
        for _ in range(args.repeats):
            for kind in launchers:  # interleaved, so both see the same machine load
                result = run_scenario(scenario, kind, args.timeout, keep_logs=args.keep_logs)
                results[kind].append(result)
                print(f"  {scenario} {kind}: {result}", file=sys.stderr)
        out += table(scenario, results)
    print("\n".join(out))
    print(f"\n({time.monotonic() - began:.0f} s in all; '-': not observed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
