"""What the sharded (FSDP2) in-memory tier costs a training job, measured side by side.

Whole jobs of two ranks (gloo, CPU; each rank its own node with its own memory folder, so
every copy is also mirrored on the other rank), each job in fresh processes, interleaved:
FSDP2 MLP + Adam for ``--steps`` steps with no in-memory copies, and with a copy every step
(``worker.memory.shards.ShardedMemoryTier``, what ``--memory-snapshot-every 1`` runs).
Reported: whole-job wall and CPU (both ranks) as ratios to the job without copies, then each
phase of a copy: the training thread's ``save`` (since the mapped path, the slot write is in
it), the slot write (``RankSlots.write``), the background send to the mirror rank (wall and
the CPU of the thread it ran on), per copy, and the copies skipped because the previous one
was still being written or sent.

    OMP_NUM_THREADS=1 python bench/memory_shards_cost.py [--steps 30] [--repeats 3] [--mb 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

MODES = {"none": "no in-memory copies", "memory": "a sharded in-memory copy every step"}
PHASES = ("capture", "write", "write_cpu", "send", "send_cpu")


def model(world: int, mb: int) -> torch.nn.Module:
    """Square layers, ~``mb`` MB of float32 weights in all, one FSDP2 unit per layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width, layers = 1024, max(1, mb * (1 << 20) // (4 * 1024 * 1024))
    net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def timed_into(times: list[float], fn: Callable[..., Any], clock: Callable[[], float]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begun = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append((clock() - begun) * 1000)

    return wrapper


def instrument(tier: Any) -> dict[str, list[float]]:
    """Wrap the tier's phases (on this instance only) to record ms per call."""
    times: dict[str, list[float]] = defaultdict(list)
    for name, owner, attr in (("write", tier.slots, "write"), ("send", tier._link, "send")):
        fn = getattr(owner, attr)
        fn = timed_into(times[f"{name}_cpu"], fn, time.thread_time)  # the writer thread's CPU
        setattr(owner, attr, timed_into(times[name], fn, time.perf_counter))
    tier.save = timed_into(times["capture"], tier.save, time.perf_counter)
    return times


def rank_job(rank: int, world: int, mode: str, steps: int, mb: int, root: str) -> dict[str, Any]:
    from elastic_trainer.worker.memory.shards import ShardedMemoryTier
    from snapshots.format.rng import RNGState

    net = model(world, mb)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    x = torch.randn(8, 1024)
    tier, times = None, {}
    if mode == "memory":
        tier = ShardedMemoryTier(os.path.join(root, f"node{rank}"), every=1)
        times = instrument(tier)
    dist.barrier()
    begun, cpu = time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tier is not None:
            state = {"model": net, "optimizer": opt, "elastic_session": {"step": step}}
            tier.save(step, state, {"rng": RNGState()})
    if tier is not None:
        tier.close()  # the last copy written and mirrored: part of the job
    dist.barrier()
    out = {"wall": time.perf_counter() - begun, "cpu": time.process_time() - cpu}
    out.update({k: statistics.median(v[1:] or v) for k, v in times.items() if v})
    out["skipped"] = tier.skipped if tier is not None else 0
    return out


def job(mode: str, args: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    """One whole job: two fresh rank processes; their results."""
    folder = tempfile.mkdtemp(prefix=f"{mode}-", dir=root)
    procs = []
    for rank in range(2):
        cmd = [sys.executable, __file__, "--rank", str(rank), "--mode", mode, "--dir", folder]
        cmd += ["--steps", str(args.steps), "--mb", str(args.mb)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"job {mode} failed:\n{err.decode()[-3000:]}")
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    shutil.rmtree(folder, ignore_errors=True)
    return results


def table(runs: dict[str, list[list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    def med(mode: str, fn: Callable[[list[dict[str, Any]]], float]) -> float:
        return statistics.median(fn(ranks) for ranks in runs[mode])

    def wall(ranks: list[dict[str, Any]]) -> float:
        return max(r["wall"] for r in ranks)

    def cpu(ranks: list[dict[str, Any]]) -> float:
        return sum(r["cpu"] for r in ranks)

    base_wall, base_cpu = med("none", wall), med("none", cpu)
    lines = [
        f"whole job: {args.steps} steps, FSDP2 MLP ~{args.mb} MB of weights + Adam, 2 ranks "
        f"(gloo, CPU; one node each), median of {args.repeats} interleaved runs",
        f"{'job':<40}{'wall s':>8}{'x none':>8}{'CPU s':>8}{'x none':>8}",
    ]
    for mode in runs:
        w, c = med(mode, wall), med(mode, cpu)
        lines.append(
            f"{MODES[mode]:<40}{w:>8.2f}{w / base_wall:>8.3f}{c:>8.2f}{c / base_cpu:>8.3f}"
        )
    step_ms = 1000 * base_wall / args.steps
    lines += [
        "",
        f"per copy (ms, median over copies, ranks and runs; a step without copies: "
        f"{step_ms:.0f} ms)",
        "  ".join(f"{p:>10}" for p in (*PHASES, "skipped")),
    ]
    per_rank = [r for ranks in runs["memory"] for r in ranks]
    cells = [statistics.median(r[p] for r in per_rank) for p in PHASES]
    skipped = statistics.median(r["skipped"] for r in per_rank)
    lines.append("  ".join(f"{v:>10.1f}" for v in (*cells, skipped)))
    lines += [
        "capture: the training thread's save(); write: the slot write (inside capture where",
        "it runs on the training thread); send: to the mirror rank (wall, and _cpu: the CPU of",
        "the thread it ran on); skipped: copies per rank skipped, the previous still in flight",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mb", type=int, default=64, help="MB of weights (Adam adds 2x)")
    parser.add_argument("--dir", default=None, help="memory folders here (default: /dev/shm)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # one rank of one job
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.rank is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo", init_method=f"file://{args.dir}/pg", rank=args.rank, world_size=2
        )
        result = rank_job(args.rank, 2, args.mode, args.steps, args.mb, args.dir)
        print(json.dumps(result), flush=True)
        from elastic_trainer.entrypoints.worker import exit_without_finalizing

        exit_without_finalizing(0)  # gloo threads can abort CPython's finalization
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="memory-shards-cost-", dir=args.dir or shm)
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in MODES}
    try:
        for rep in range(args.repeats):  # interleaved: machine noise falls on both alike
            for mode in MODES:
                runs[mode].append(job(mode, args, root))
                print(f"done: {mode} (repeat {rep + 1})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(runs, args))


if __name__ == "__main__":
    main()
