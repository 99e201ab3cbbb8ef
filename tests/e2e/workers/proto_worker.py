"""A tiny worker that follows elastic_trainer.contract.protocol directly (no TrainingSession).

Each step all-reduces a counter over gloo, appends ``step rank world_size`` to an audit file,
rewrites progress-<local_rank>.json, snapshots (rank 0, JSON + atomic rename) every
``ELASTIC_TRAIN_SNAPSHOT_EVERY`` steps, and checks the stop file (agreed by all-reduce).

Fault injection (arguments): --steps N, --step-time S, --die-at STEP (SIGKILL itself once,
on global rank --die-rank, remembered through --marker), --exit-code C with --fail-always,
--spawn-child FILE (leave a detached grandchild behind, to test process hygiene; FILE gets
"pid restart_count" per grandchild).
"""

from __future__ import annotations

import time

STARTED_AT = time.time()  # before ``import torch``: bench/recovery.py times the worker start

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

EXIT_PEER_PREEMPTED = 75


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--die-rank", type=int, default=0)
    p.add_argument("--marker", default="")
    p.add_argument("--fail-always", action="store_true")
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--audit", default="")
    p.add_argument("--markers", default="", help="append 'name time rank world' lines here")
    p.add_argument(
        "--spawn-child", default="", help="start a detached grandchild, log its pid here"
    )
    return p.parse_args()


def atomic_write(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def mark(path: str, name: str, at: float, rank: int, world: int) -> None:
    if path:
        with open(path, "a") as f:
            f.write(f"{name} {at:.3f} {rank} {world}\n")


def restore(snap_dir: str) -> int:
    try:
        with open(os.path.join(snap_dir, "snap.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return 0


def main() -> int:
    args = parse()
    if args.spawn_child:
        # a grandchild in its own session: killing the worker's process group misses it
        import subprocess

        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
        with open(args.spawn_child, "a") as f:
            f.write(f"{child.pid} {attempt}\n")  # one line per grandchild: pid, attempt
    if args.fail_always:
        print("failing on purpose", file=sys.stderr)
        return args.exit_code
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    timeout = float(os.environ.get("ELASTIC_TRAIN_COLLECTIVE_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    world = dist.get_world_size()
    control = os.environ["ELASTIC_TRAIN_CONTROL_DIR"]
    snap_dir = os.environ.get("ELASTIC_TRAIN_SNAPSHOT_DIR") or ""
    every = int(os.environ.get("ELASTIC_TRAIN_SNAPSHOT_EVERY", "5"))
    mark(args.markers, "began", STARTED_AT, rank, world)
    mark(args.markers, "group_ready", time.time(), rank, world)
    start = restore(snap_dir) if snap_dir else 0
    mark(args.markers, "restored", time.time(), rank, world)
    step = start
    while step < args.steps:
        if step == args.die_at and rank == args.die_rank and not os.path.exists(args.marker):
            open(args.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        total = torch.ones(1)
        dist.all_reduce(total)
        time.sleep(args.step_time)
        step += 1
        if args.audit:
            with open(args.audit, "a") as f:
                f.write(f"{step} {rank} {world} {time.time():.3f}\n")
        if snap_dir and rank == 0 and step % every == 0:
            atomic_write(os.path.join(snap_dir, "snap.json"), {"step": step})
        atomic_write(
            os.path.join(control, f"progress-{local_rank}.json"),
            {"step": step, "epoch": 0, "restored_step": start, "time": time.time()},
        )
        own_stop = os.path.exists(os.path.join(control, "stop"))
        flag = torch.tensor([1.0 if own_stop else 0.0])
        dist.all_reduce(flag)
        if flag.item() > 0:
            if snap_dir and rank == 0:
                atomic_write(os.path.join(snap_dir, "snap.json"), {"step": step})
            dist.barrier()
            dist.destroy_process_group()
            return 0 if own_stop else EXIT_PEER_PREEMPTED
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
