"""Goodput under failures: the share of wall time that went into steps that count.

goodput = (steps that count × failure-free step time) / wall time, for one job of a fixed number
of steps (about ``--duration`` seconds of steps, failure-free) under a fixed failure schedule: every
``--failure-every`` seconds from the launch, alternately a node loss (the second node's whole
process tree SIGKILLed, then started again once the job trains without it, so the job regrows)
and a worker crash (the second node's worker alone SIGKILLed). A failure due while the job is
still recovering waits until it trains at world size 2 again.

The job is bench/recovery.py's: a tiny gloo job (an all-reduce per 0.1 s step) on two "nodes"
(two launchers on 127.0.0.1, one worker each). Arms (``--arms``), one after the other, each
run failure-free first (its step time and wall time) then with failures:

- ``torchrun``: the plain script (tests/e2e/workers/proto_worker.py), saving its own snapshot
  every ``--save-every`` steps, as torchrun users do;
- ``elastic-train``: at its defaults, the ``TrainingSession`` script (bench/_session_worker.py);
- ``elastic-train-mem1``: the same with ``--memory-snapshot-every 1`` (a copy every step).

Both launchers get ``--max-restarts 1000`` (more failures than the schedule injects); nothing
else is tuned, and thread-tuning variables such as ``OMP_NUM_THREADS`` are dropped from the
environment the jobs get. A job whose launchers all exit before its last step is launched
again from its snapshots, as a user's retry would be (``relaunches``); a node whose launcher
exits alone is started again, as a scheduler would replace the node. Wall time: the
first launcher's start to the last step's completion. Steps lost: at each restart, the last
step the old worker group completed minus the step the new group resumed from (the audit
rows, split into groups by the workers' ``restored`` markers); time lost per failure:
(wall - failure-free wall) / failures.

    python bench/goodput.py [--duration 300] [--failure-every 60] [--save-every 50]
                            [--arms torchrun,elastic-train,elastic-train-mem1] [--json PATH]
                            [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _goodput_calc import ArmResult, Run, steps_for, summarize, table
from _goodput_run import NoRecovery, arms, run_job

STEP_TIME_S = 0.1  # the workers' sleep per step (bench/recovery.py's job)
NOTES = """
goodput: steps × failure-free step time / wall (failure-free: the same arm without failures, in
this invocation). restarts: worker-group restarts (a node loss restarts twice: without the node,
then with its replacement). relaunches: the job died and was launched again. steps lost /
failure: steps redone, summed over restarts, per failure. time lost / failure: (wall -
failure-free wall) / failures."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--duration",
        type=float,
        default=300.0,
        help="seconds of steps in the failure-free run (sets the step count)",
    )
    p.add_argument("--failure-every", type=float, default=60.0, help="seconds between failures")
    p.add_argument(
        "--save-every",
        type=int,
        default=50,
        help="steps between the torchrun script's own snapshots",
    )
    p.add_argument("--arms", default=",".join(arms(50)))
    p.add_argument("--json", default="", help="write the raw numbers here")
    p.add_argument("--keep-logs", default="", help="copy each run's logs under this folder")
    args = p.parse_args(argv)  # fmt: skip
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := sorted(set(args.arms) - set(arms(50))):
        p.error(f"--arms: unknown {unknown}; choose from {','.join(arms(50))}")
    if args.duration <= 0 or args.failure_every <= 0 or args.save_every < 1:
        p.error("--duration and --failure-every must be > 0 seconds, --save-every >= 1 step")
    return args


def run_arm(key: str, args: argparse.Namespace, steps: int) -> tuple[ArmResult, dict]:
    arm = arms(args.save_every)[key]
    runs: dict[str, Run] = {}
    for label, every in (("failure_free", None), ("failures", args.failure_every)):
        run = run_job(arm, steps=steps, step_time=STEP_TIME_S, save_every=args.save_every,
                      failure_every=every, keep_logs=args.keep_logs)  # fmt: skip
        runs[label] = run
        print(f"  {arm.name} {label}: wall {run.wall:.1f} s, {len(run.failures)} failures",
              file=sys.stderr)  # fmt: skip
    result = summarize(arm.name, runs["failure_free"], runs["failures"])
    raw = {label: {"wall": r.wall, "failures": r.failures, "restored": r.restored,
                   "rows": r.rows} for label, r in runs.items()}  # fmt: skip
    return result, raw


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    steps = steps_for(args.duration, STEP_TIME_S)
    began = time.monotonic()
    results, raw, unrecovered = [], {}, []
    for key in args.arms:
        try:
            result, raw[key] = run_arm(key, args, steps)
        except NoRecovery as exc:
            unrecovered.append((arms(args.save_every)[key].name, str(exc)))
            print(f"  {key}: did not recover ({exc})", file=sys.stderr)
            continue
        results.append(result)
    print(
        f"\nGoodput: {steps} steps of {STEP_TIME_S} s, a failure every {args.failure_every:g} s "
        f"(node loss and worker crash alternating), torchrun saving every {args.save_every}"
    )
    print()
    print(table(results, unrecovered))
    print(NOTES)
    print(f"\n({time.monotonic() - began:.0f} s in all)")
    if args.json:
        out = {"settings": {"steps": steps, "step_time": STEP_TIME_S,
                            "duration": args.duration, "failure_every": args.failure_every,
                            "save_every": args.save_every},
               "results": [r.to_json() for r in results], "runs": raw}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
