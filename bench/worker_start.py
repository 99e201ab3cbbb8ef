"""Worker start: a fresh ``python -u -m bootstrap`` vs a fork from the warm pool, side by side.

Two workloads, each started both ways in alternation (``--trials`` each):
- ``tiny``: a script whose first line is ``import torch``, then prints the time; measured from
  the start request to that line (what a restart waits for before the script does anything).
- ``builtin``: the built-in job (``-m elastic_trainer.jobs.default --help``): every import of
  the job and its argument parsing, measured from the start request to its exit.

- ``launch``: end to end through the CLI, the built-in job on one node: from the command to
  its ``workers.started`` event (the supervisor's imports, the job's preflight -- forked from
  the pool where there is one -- and the workers' start), ``--warm-workers`` against
  ``--no-warm-workers``.
- ``restart``: end to end through the CLI, the e2e tests' proto job (2 workers, gloo) with one
  worker SIGKILLed at step 7, ``--warm-workers`` against ``--no-warm-workers``: the
  ``recovery.completed`` downtime (from the failure to the first step after the restart).

The pool is started once per workload with the modules the supervisor would preload
(``modules_to_preload``); its own start-up is not counted (it overlaps the first
rendezvous). Prints medians and the warm/fresh ratio.

    python bench/worker_start.py [--trials N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime

from elastic_trainer.supervisor.processes import procs
from elastic_trainer.supervisor.processes.workerenv import BOOTSTRAP_MODULE
from elastic_trainer.supervisor.warm.decisions import modules_to_preload
from elastic_trainer.supervisor.warm.launcher import WarmPool
from elastic_trainer.supervisor.warm.process import WarmProcess

TINY = "import torch\nimport sys, time\nprint(time.time(), flush=True)\n"


def _first_line_at(start: float, read_fd: int) -> float:
    with os.fdopen(read_fd) as f:
        line = f.readline()
    return float(line.split()[0]) - start


def _timed(start: float, read_fd: int, wait: Callable[[], object], *, until_exit: bool) -> float:
    """Seconds from ``start`` to the worker's first line (or to its exit)."""
    if until_exit:
        os.close(read_fd)
        wait()
        return time.time() - start
    took = _first_line_at(start, read_fd)
    wait()
    return took


def fresh(argv: list[str], *, until_exit: bool) -> float:
    r, w = os.pipe()
    began = time.time()
    cmd = [sys.executable, "-u", "-m", BOOTSTRAP_MODULE, *argv]
    proc = subprocess.Popen(cmd, stdout=w, stderr=subprocess.DEVNULL)
    os.close(w)
    return _timed(began, r, proc.wait, until_exit=until_exit)


def warm(pool: WarmPool, argv: list[str], *, until_exit: bool) -> float:
    r, w = os.pipe()
    null = os.open(os.devnull, os.O_WRONLY)
    began = time.time()
    pid = pool.spawn(argv, dict(os.environ), [0, w, null])
    os.close(w)
    os.close(null)
    return _timed(began, r, WarmProcess(pid).wait, until_exit=until_exit)


def measure(name: str, argv: list[str], *, until_exit: bool, trials: int) -> None:
    pool = WarmPool.start(modules_to_preload(argv))
    if not pool.wait_ready(300):
        raise SystemExit(f"the warm pool did not start: {pool.failure}")
    fresh_s, warm_s = [], []
    try:
        for _ in range(trials):
            fresh_s.append(fresh(argv, until_exit=until_exit))
            warm_s.append(warm(pool, argv, until_exit=until_exit))
    finally:
        pool.close()
    f, w = statistics.median(fresh_s), statistics.median(warm_s)
    print(f"| {name} | {f:.3f} | {w:.3f} | {w / f:.3f} |", flush=True)


PROTO = os.path.join(os.path.dirname(__file__), "..", "tests", "e2e", "workers", "proto_worker.py")


def restart_downtime(warm_flag: str) -> float:
    """One kill-once run of the proto job; its recovery.completed downtime_s."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "events.jsonl")
        cmd = [sys.executable, "-m", "elastic_trainer", "--standalone", "--nproc-per-node", "2"]
        cmd += [warm_flag, "--log-file", log, "--snapshot-dir", os.path.join(tmp, "snap")]
        cmd += ["--snapshot-every", "5", os.path.abspath(PROTO), "--steps", "20", "--die-at"]
        cmd += ["7", "--die-rank", "1", "--marker", os.path.join(tmp, "died")]
        # cwd: not the checkout, whose folders would shadow an installed package
        subprocess.run(
            cmd, cwd=tmp, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        with open(log) as f:
            events = [json.loads(line) for line in f]
    (recovery,) = [e for e in events if e["event"] == "recovery.completed"]
    return float(recovery["downtime_s"])


def launch_to_workers(warm_flag: str) -> float:
    """Seconds from the built-in job's command to its workers.started event."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "events.jsonl")
        cmd = [sys.executable, "-m", "elastic_trainer", "--min-nodes", "1", "--max-nodes", "1"]
        cmd += [warm_flag, "--log-file", log, "--snapshot-dir", os.path.join(tmp, "snap"), "--"]
        cmd += ["--max-steps", "1", "--train-samples", "256", "--val-samples", "64"]
        began = time.time()
        subprocess.run(
            cmd, cwd=tmp, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        with open(log) as f:
            events = [json.loads(line) for line in f]
    (started,) = [e for e in events if e["event"] == "workers.started"]
    at = datetime.fromisoformat(started["timestamp"].replace("Z", "+00:00")).timestamp()
    return at - began


def measure_cli(name: str, seconds: Callable[[str], float], trials: int) -> None:
    """``seconds(flag)`` with ``--no-warm-workers`` and ``--warm-workers``, alternating."""
    fresh_s, warm_s = [], []
    for _ in range(trials):
        fresh_s.append(seconds("--no-warm-workers"))
        warm_s.append(seconds("--warm-workers"))
    f, w = statistics.median(fresh_s), statistics.median(warm_s)
    print(f"| {name} | {f:.3f} | {w:.3f} | {w / f:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    trials = parser.parse_args().trials
    if not procs.become_subreaper():
        raise SystemExit("needs Linux (a child subreaper): the warm pool's workers are ours")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "tiny.py")
        with open(script, "w") as f:
            f.write(TINY)
        print("| workload | fresh s (median) | warm s (median) | warm / fresh |")
        print("|---|---|---|---|")
        measure("tiny torch script, to its first line", [script], until_exit=False, trials=trials)
        builtin = ["-m", "elastic_trainer.jobs.default", "--help"]
        measure("built-in job, imports + --help", builtin, until_exit=True, trials=trials)
    measure_cli("built-in job, launch to workers started", launch_to_workers, trials)
    measure_cli("worker SIGKILLed, restart downtime", restart_downtime, trials)


if __name__ == "__main__":
    main()
