"""The control plane at N nodes on one machine: formation, re-forms, store traffic, idle cost,
and the growth law of each.

Every node is a real agent process running the real supervisor (``elastic_trainer.cli.main``:
rendezvous rounds on the signed state backend, presence connections, heartbeats, expiry, store
failover, the hand-over to workers), forked from this process after one ``import torch``
(bench/_scale_fork.py: the forked agents share torch's import-time memory, so hundreds fit),
all against one real store over real loopback sockets; each runs one worker that does not
import torch (bench/_scale_worker.py). What each phase measures: bench/_scale_run.py. The data
plane (gloo process groups) is measured apart: bench/scale.py --data-plane.

    python bench/scale.py [--nodes 8,16,32,64,128,256] [--idle 10] [--timeout 180]
                          [--keep-logs DIR] [--data-plane N]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _scale_calc import table
from _scale_run import run_job

FDS_PER_NODE = 8  # an agent's fds on the store host's side and its own, with slack


def nodes_list(text: str) -> list[int]:
    try:
        ns = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ns = []
    if not ns or any(n < 2 for n in ns):
        raise SystemExit(f"--nodes {text!r}: give node counts of 2 or more, e.g. 8,16,32")
    return ns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="8,16,32,64", type=nodes_list)
    p.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    p.add_argument("--timeout", type=float, default=180.0, help="per phase, seconds")
    p.add_argument("--keep-logs", default="")
    p.add_argument("--data-plane", type=int, default=0, help="gloo ranks (0: skip)")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the children inherit it
    records = []
    for n in args.nodes:
        load = os.getloadavg()[0]
        started = time.monotonic()
        try:
            record = run_job(n, idle_s=args.idle, timeout=args.timeout, keep_logs=args.keep_logs)
        except (RuntimeError, OSError, MemoryError) as exc:
            print(f"N={n}: stopped: {exc}", flush=True)
            break
        record["load"] = load
        records.append(record)
        print(f"N={n}: done in {time.monotonic() - started:.0f} s (load {load:.1f})", flush=True)
        print(record, flush=True)
    if records:
        print()
        print(table(records))
        loads = ", ".join(f"N={r['n']}: {r['load']:.1f}" for r in records)
        print(f"\n1-min load average at each job's start: {loads} (2 cores)")
    if args.data_plane:
        from _scale_data import data_plane

        print()
        print(data_plane(args.data_plane))
    return 0


if __name__ == "__main__":
    sys.exit(main())
