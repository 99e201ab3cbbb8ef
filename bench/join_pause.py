"""A node joins a running job: how long the running group pauses, on its own step clock.

A job of bench/_session_worker.py (a gloo all-reduce per 0.1 s step, ``TrainingSession`` at its
defaults) trains on ``--running`` nodes (2 by default: launchers on 127.0.0.1, one worker each,
``--max-nodes`` one more); one more node starts; the run ends once the job has trained a while
at the larger world size. From the workers' audit rows (each step's first completion): the
longest gap between two consecutive steps within 10 steps of the first step at the new size,
the median step at the old one, and **pause** = gap - step. Beside it what the running
nodes' supervisors reported (``group.handed_over``: ``stop_s``, and ``pause_s`` where the
version has it), and where the gap went: from the old group's last step to the supervisor's
hand-over event and to the new workers' ``restored`` marker (their ``TrainingSession`` built:
restore included), then the first step. Medians over ``--repeats`` runs, each a fresh job.

    python bench/join_pause.py [--repeats 5] [--running 2] [--keep-logs DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _join_pause_calc import join_pause
from _recovery_parse import parse_audit, parse_events, parse_markers
from _recovery_run import ROOT, WORKERS, free_port, listening, stop_all, wait_until

STEP_TIME_S = 0.1
JOIN_AFTER_STEP = 30  # the third node starts once the two have done this many steps
STEPS_AFTER = 20  # steps at world size 3 before the run ends
TIMEOUT_S = 240.0


def cmd(port: int, node: str, tmp: Path, max_nodes: int) -> list[str]:
    return [sys.executable, "-m", "elastic_trainer", "--min-nodes", "1",
            "--max-nodes", str(max_nodes),
            "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--job-id", "join", "--snapshot-dir", str(tmp / "snap"), "--log-format", "json",
            "--log-file", str(tmp / f"{node}.jsonl"), "--node", node, WORKERS["session"],
            "--steps", "100000", "--step-time", str(STEP_TIME_S), "--audit", str(tmp / "audit"),
            "--markers", str(tmp / "markers")]  # fmt: skip


def start(port: int, node: str, tmp: Path, max_nodes: int) -> subprocess.Popen:
    (tmp / "snap").mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOGLEVEL="INFO")  # as users run: no OMP tuning
    env.pop("OMP_NUM_THREADS", None)
    log = open(tmp / f"{node}.out", "wb")  # noqa: SIM115  (closed with the process)
    argv = cmd(port, node, tmp, max_nodes)
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _text(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""


def node_names(running: int) -> list[str]:
    """The running nodes' names, then the joining node's."""
    return [f"n{i}" for i in range(running + 1)]


def one_run(keep_logs: str, running: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-join-") as tmpdir:
        tmp = Path(tmpdir)
        audit = tmp / "audit"
        port = free_port()
        *first, joiner = node_names(running)
        procs = [start(port, first[0], tmp, running + 1)]
        try:
            if not wait_until(lambda: listening(port), 60):
                raise RuntimeError("the first node never hosted the store")
            procs += [start(port, node, tmp, running + 1) for node in first[1:]]
            rows = lambda: parse_audit(_text(audit))  # noqa: E731
            if not wait_until(lambda: any(r[2] == running and r[0] >= JOIN_AFTER_STEP
                                          for r in rows()), TIMEOUT_S):  # fmt: skip
                raise RuntimeError(f"never trained at world size {running}")
            joined = time.time()
            procs.append(start(port, joiner, tmp, running + 1))

            def grown() -> bool:
                after = [r[0] for r in rows() if r[2] == running + 1]
                return bool(after) and max(after) - min(after) >= STEPS_AFTER

            if not wait_until(grown, TIMEOUT_S):
                raise RuntimeError(f"never trained at world size {running + 1}")
            return measure(tmp, joined, first)
        finally:
            stop_all(procs)
            if keep_logs:
                shutil.copytree(tmp, Path(keep_logs) / f"join-{int(time.time())}")


def measure(tmp: Path, joined: float, running_nodes: list[str]) -> dict:
    n = len(running_nodes)
    p = join_pause(parse_audit(_text(tmp / "audit")), n, n + 1)
    if p is None:
        raise RuntimeError("no join in the audit rows")
    events = [e for node in running_nodes for e in parse_events(_text(tmp / f"{node}.jsonl"))]
    handed = [e for e in events if e["event"] == "group.handed_over" and e["_t"] > joined]
    restored = [t for n, t in parse_markers(_text(tmp / "markers"))
                if n == "restored" and t > p.last_old_t]  # fmt: skip
    first = min(handed, key=lambda e: e["_t"]) if handed else {}
    return {
        "gap_s": p.gap_s, "step_s": p.step_s, "pause_s": p.pause_s,
        "stop_s": max((e["stop_s"] for e in handed), default=None),
        "reported_pause_s": max((e.get("pause_s") or -1 for e in handed), default=-1),
        "to_handed_over_s": first["_t"] - p.last_old_t if first else None,
        "to_restored_s": max(restored) - p.last_old_t if restored else None,
        "first_step_s": p.first_new_t - max(restored) if restored else None,
    }  # fmt: skip


COLS = ("gap_s", "step_s", "pause_s", "stop_s", "reported_pause_s", "to_handed_over_s",
        "to_restored_s", "first_step_s")  # fmt: skip


def table(runs: list[dict]) -> str:
    def med(key: str) -> str:
        vals = [r[key] for r in runs if r.get(key) is not None and r[key] >= 0]
        return f"{statistics.median(vals):.3f}" if vals else "-"

    lines = ["| run | " + " | ".join(COLS) + " |", "|---|" + "---:|" * len(COLS)]
    for i, r in enumerate(runs, 1):
        cells = ["-" if r.get(c) is None or r[c] < 0 else f"{r[c]:.3f}" for c in COLS]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines.append("| **median** | " + " | ".join(f"**{med(c)}**" for c in COLS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--running", type=int, default=2, help="nodes training before the join")
    ap.add_argument("--keep-logs", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.running < 1:
        ap.error("--running must be >= 1")
    runs = []
    for i in range(args.repeats):
        try:
            runs.append(one_run(args.keep_logs, args.running))
        except RuntimeError as exc:
            print(f"  run {i + 1}: {exc}", file=sys.stderr)
            continue
        print(f"  run {i + 1}: " + " ".join(f"{k}={v}" for k, v in runs[-1].items()),
              file=sys.stderr)  # fmt: skip
    print(
        f"\nJoin pause: {args.running} -> {args.running + 1} nodes, {STEP_TIME_S} s steps; "
        "seconds; the group's own step "
        "clock (audit rows); reported: group.handed_over on the running nodes\n"
    )
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
