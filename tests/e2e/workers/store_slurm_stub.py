"""A stand-in for ``elastic-train`` inside the Slurm test: checks the sbatch script's wiring.

``store ...`` runs the real ``elastic-train store``. Anything else acts as a supervisor
whose "training" is a step counter: it resumes from ``SNAPSHOT_DIR/state.json``, records
each attempt (restart count, resumed step, whether the rendezvous store answered) in
``SNAPSHOT_DIR/attempts.jsonl``, and on SIGUSR1/SIGTERM writes that final state and exits
143 like the real supervisor. It exits 0 once ``DONE_FILE`` (its one argument) exists.
No torch import: a Slurm job on a 2-core machine should start in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

STEP_S = 0.05  # paces the counter; not a synchronisation


def store_reachable(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


def append(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def supervise(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--rdzv-endpoint", "--snapshot-dir", "--job-id", "--min-nodes", "--max-nodes"):
        parser.add_argument(flag)
    ns, rest = parser.parse_known_args(argv)
    done_file = rest[-1]
    os.makedirs(ns.snapshot_dir, exist_ok=True)
    state_path = os.path.join(ns.snapshot_dir, "state.json")
    attempts = os.path.join(ns.snapshot_dir, "attempts.jsonl")
    step = 0
    if os.path.exists(state_path):
        with open(state_path, encoding="utf-8") as f:
            step = json.load(f)["step"]
    append(attempts, {
        "event": "start", "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        "resumed_from": step, "job_id": ns.job_id, "store": store_reachable(ns.rdzv_endpoint),
        "min_nodes": ns.min_nodes, "max_nodes": ns.max_nodes,
    })  # fmt: skip
    stopping: list[str] = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stopping.append(signal.Signals(s).name))
    while not stopping and not os.path.exists(done_file):
        step += 1
        append(attempts, {"event": "step", "step": step})
        time.sleep(STEP_S)
    with open(state_path, "w", encoding="utf-8") as f:  # the "final snapshot"
        json.dump({"step": step}, f)
    append(attempts, {"event": "final", "step": step, "signal": stopping[0] if stopping else None})
    return 143 if stopping else 0


def main() -> int:
    if sys.argv[1:2] == ["store"]:
        from elastic_trainer.tools.store_server import main as store_main

        return store_main(sys.argv[2:])
    return supervise(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
