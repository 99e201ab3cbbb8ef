"""Snapshot stall: how long does a save block training? Side by side, in one run.

ResNet-18 (10 classes) + SGD-momentum state (~90 MB) on local disk, CPU, single process:
torch.save, DCP save, DCP async_save (on its own gloo group), and this package's
SnapshotStore (blocking, asynchronous copy, and the opt-in overlapped capture). For each:
median stall per save (ms), stall as a fraction of a training step, time until the snapshot
is persisted and the resulting MB/s, and the median time of the training step that runs
while the save persists in the background (a writer thread competes with it for the cores).

Then whole jobs, each in a fresh process, interleaved: the same ResNet-18 loop for
``--steps`` steps with no snapshots, with a snapshot every ``--every`` steps through
SessionSnapshots (TrainingSession's own path: DistributedSnapshotter, overlapped capture,
background writer), with torch.save every ``--every`` steps, and with a snapshot every step
to a SnapshotStore on /dev/shm (node-local memory, through the same asynchronous path): wall
and process CPU as ratios to the job without snapshots.

    python bench/snapshot_stall.py [--saves 5] [--dir /tmp/x]
    python bench/snapshot_stall.py --jobs-only [--steps 60] [--repeats 3]
        [--kinds session,torch,memory]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchvision
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastic_trainer.supervisor.processes.workerenv import tune_malloc
from snapshots import SnapshotStore
from snapshots.format.rng import RNGState


@dataclass
class Trainer:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor

    def step(self) -> float:
        begun = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()
        return (time.perf_counter() - begun) * 1000


@dataclass
class Result:
    name: str
    stalls: list[float] = field(default_factory=list)
    persists: list[float] = field(default_factory=list)
    next_steps: list[float] = field(default_factory=list)


def make_trainer(batch: int, device: str = "cpu", image: int = 32) -> Trainer:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, image, image, device=device)
    trainer = Trainer(model, opt, x, torch.randint(0, 10, (batch,), device=device))
    for _ in range(3):  # momentum buffers exist, allocator warm
        trainer.step()
    return trainer


def state_bytes(t: Trainer) -> int:
    tensors = list(t.model.state_dict().values())
    tensors += [v for s in t.opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(v.numel() * v.element_size() for v in tensors)


# A save function returns (stall_ms, wait_until_persisted) where the second blocks until the
# snapshot is durable and returns the ms from the call until then.
SaveFn = Callable[[int], tuple[float, Callable[[], float]]]


def run(name: str, t: Trainer, save: SaveFn, saves: int, steps_between: int) -> Result:
    result = Result(name)
    for i in range(saves + 1):  # the first save warms up (allocations, imports, threads)
        stall, wait_persisted = save(i)
        next_step = t.step()  # overlaps the background persist, if any
        if isinstance(stall, _StallWithHook):
            stall = stall.total()
        for _ in range(steps_between - 1):
            t.step()
        persisted = wait_persisted()
        if i:
            result.stalls.append(stall)
            result.persists.append(persisted)
            result.next_steps.append(next_step)
    return result


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    begun = time.perf_counter()
    out = fn()
    return (time.perf_counter() - begun) * 1000, out


def torch_save(t: Trainer, root: str) -> SaveFn:
    def save(i: int) -> tuple[float, Callable[[], float]]:
        state = {"model": t.model.state_dict(), "optimizer": t.opt.state_dict()}
        ms, _ = timed(lambda: torch.save(state, os.path.join(root, f"torch-{i % 2}.pt")))
        return ms, lambda: ms

    return save


def dcp_save(t: Trainer, root: str) -> SaveFn:
    def save(i: int) -> tuple[float, Callable[[], float]]:
        def go() -> None:
            model_sd, optim_sd = get_state_dict(t.model, t.opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dcp-{i}")

        ms, _ = timed(go)
        return ms, lambda: ms

    return save


def dcp_async_save(t: Trainer, root: str, group: Any) -> SaveFn:
    def save(i: int) -> tuple[float, Callable[[], float]]:
        begun = time.perf_counter()

        def go() -> Any:
            model_sd, optim_sd = get_state_dict(t.model, t.opt)
            return dcp.async_save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=f"{root}/dcpa-{i}",
                process_group=group,
            )

        ms, future = timed(go)

        def wait() -> float:
            future.result()
            return (time.perf_counter() - begun) * 1000

        return ms, wait

    return save


def store_save(t: Trainer, store: SnapshotStore, mode: str) -> SaveFn:
    state = {"model": t.model, "optimizer": t.opt}

    def save(i: int) -> tuple[float, Callable[[], float]]:
        begun = time.perf_counter()
        store.last_hook_wait_ms = 0.0
        overlap = t.opt if mode == "overlapped" else None
        ms, handle = timed(
            lambda: store.save(i, state, blocking=(mode == "blocking"), overlap_with=overlap)
        )

        def wait() -> float:
            handle.result()
            return (time.perf_counter() - begun) * 1000

        # overlapped: training also waits in optimizer.step() until the copy is done;
        # that wait is part of the stall. It is known once the next step ran.
        return _StallWithHook(ms, store), wait

    return save  # type: ignore[return-value]


class _StallWithHook(float):
    """A stall figure that adds the optimizer-hook wait, read after the next step ran."""

    def __new__(cls, ms: float, store: SnapshotStore) -> _StallWithHook:
        obj = super().__new__(cls, ms)
        obj.store = store  # type: ignore[attr-defined]
        return obj

    def total(self) -> float:
        return float(self) + self.store.last_hook_wait_ms  # type: ignore[attr-defined]


def table(results: list[Result], step_ms: float, nbytes: int) -> str:
    base = statistics.median(results[0].stalls)
    lines = [
        f"state {nbytes / 1e6:.1f} MB, training step median {step_ms:.1f} ms "
        f"(stall vs torch.save in the same run; lower is better)",
        f"{'method':<34}{'stall ms':>9}{'x torch.save':>13}{'of a step':>10}"
        f"{'persist ms':>11}{'MB/s':>8}{'next step ms':>13}",
    ]
    for r in results:
        stall = statistics.median(r.stalls)
        persist = statistics.median(r.persists)
        lines.append(
            f"{r.name:<34}{stall:>9.1f}{stall / base:>13.3f}{stall / step_ms:>10.3f}"
            f"{persist:>11.1f}{nbytes / 1e6 / (persist / 1000):>8.0f}"
            f"{statistics.median(r.next_steps):>13.1f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- whole-job wall ratios
# Each job runs in a fresh process (as a real one does: a long-lived benchmark process carries
# allocator state from one job into the next, which moves a job's time by several percent).
JOBS = {
    "none": "no snapshots (fault tolerance off)",
    "defaults": "TrainingSession at its defaults",
    "session": "snapshots every {every} steps (SessionSnapshots)",
    "torch": "torch.save every {every} steps (reference)",
    "shm": "every step, SnapshotStore on /dev/shm",
    "memory": "every step, the in-memory tier (`--memory-snapshot-every 1`)",
}


def job(mode: str, steps: int, every: int, batch: int, root: str) -> dict[str, float]:
    """One training job, start to finish (its last snapshot durable); its figures."""
    from elastic_trainer.worker.snapshotting import SessionSnapshots

    t = make_trainer(batch)
    state = {"model": t.model, "optimizer": t.opt}
    if mode == "defaults":
        return session_job(t, steps, root)
    in_shm = mode in ("shm", "memory")
    folder = tempfile.mkdtemp(prefix="snapshot-stall-", dir="/dev/shm" if in_shm else root)
    snaps = SessionSnapshots(folder, keep=2) if mode in ("shm", "session") else None
    tier = memory_tier(folder) if mode == "memory" else None
    every = 1 if in_shm else every
    faults = minor_faults()
    cpu, train_cpu, begun = time.process_time(), time.thread_time(), time.perf_counter()
    for step in range(1, steps + 1):
        t.step()
        if step % every:
            continue
        if snaps is not None:
            snaps.save(step, state, epoch=0, blocking=False)
        elif tier is not None:
            tier.save(step, state, {"rng": RNGState()})
        elif mode == "torch":
            sd = {"model": t.model.state_dict(), "optimizer": t.opt.state_dict()}
            torch.save(sd, f"{folder}/torch-{step % 2}.pt")
    loop, train_cpu = time.perf_counter() - begun, time.thread_time() - train_cpu
    faults = minor_faults() - faults
    if snaps is not None:
        snaps.close()  # the last snapshot is durable before the job ends
    if tier is not None:
        tier.flush()
    wall = time.perf_counter() - begun
    shutil.rmtree(folder, ignore_errors=True)
    cpu = time.process_time() - cpu
    return {
        "wall": wall, "loop": loop, "tail": wall - loop, "cpu": cpu, "train_cpu": train_cpu,
        "train_faults": faults,
    }  # fmt: skip


def session_job(t: Trainer, steps: int, root: str) -> dict[str, float]:
    """The loop through ``TrainingSession`` with nothing set but where it may write, as a
    worker of `elastic-train` runs it: storage snapshots at their default interval, the
    in-memory tier at its default (a copy only when the group ends), the progress file."""
    from elastic_trainer.worker.context import WorkerContext, WorkerSettings
    from elastic_trainer.worker.session import TrainingSession

    folder = tempfile.mkdtemp(prefix="snapshot-stall-", dir=root)
    memory = tempfile.mkdtemp(prefix="snapshot-stall-", dir="/dev/shm")
    os.makedirs(os.path.join(folder, "control"))
    settings = WorkerSettings(control_dir=os.path.join(folder, "control"), memory_dir=memory)
    session = TrainingSession(  # its start (the process group) is not a step's cost
        {"model": t.model, "optimizer": t.opt},
        context=WorkerContext(settings=settings),
        snapshot_dir=os.path.join(folder, "snapshots"),
        configure_logs=False,
    )
    faults = minor_faults()
    cpu, train_cpu, begun = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(steps):
        t.step()
        session.step_done()
    loop, train_cpu = time.perf_counter() - begun, time.thread_time() - train_cpu
    faults = minor_faults() - faults
    session.close(ended=True)  # no final snapshot: the other jobs take none either
    wall = time.perf_counter() - begun
    for path in (folder, memory):
        shutil.rmtree(path, ignore_errors=True)
    cpu = time.process_time() - cpu
    return {
        "wall": wall, "loop": loop, "tail": wall - loop, "cpu": cpu, "train_cpu": train_cpu,
        "train_faults": faults,
    }  # fmt: skip


def memory_tier(folder: str) -> Any:
    """The session's in-memory tier; it needs a process group (here one gloo rank)."""
    from elastic_trainer.worker.memory.tier import MemoryTier

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(folder, "pg-store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return MemoryTier(os.path.join(folder, "tier"), every=1)


def minor_faults() -> int:
    """The calling thread's minor page faults so far (0 where /proc has no per-thread stat):
    a training step that faults fresh pages runs measurably slower, snapshots or not."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return 0


def whole_jobs(args: argparse.Namespace, root: str) -> str:
    modes = list(JOBS) if args.shm else [m for m in JOBS if m not in ("shm", "memory")]
    if args.kinds:
        modes = ["none", *(m for m in args.kinds.split(",") if m != "none")]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    env = dict(os.environ)
    tune_malloc(env)  # every job runs as elastic-train runs its workers
    for rep in range(args.repeats):  # interleaved: machine noise falls on every mode alike
        for mode in modes:
            cmd = [sys.executable, __file__, "--job", mode, "--steps", str(args.steps)]
            cmd += ["--every", str(args.every), "--batch", str(args.batch), "--dir", root]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(f"job {mode} failed:\n{done.stderr[-3000:]}")
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"done: job {mode} (repeat {rep + 1})", flush=True)
    return wall_table(runs, args)


def wall_table(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    base = {key: med("none", key) for key in ("wall", "loop", "cpu", "train_cpu")}
    lines = [
        f"whole job: {args.steps} steps of ResNet-18, batch {args.batch}, 1 process, "
        f"median of {args.repeats} interleaved runs (each in a fresh process, with the "
        "GLIBC_TUNABLES elastic-train gives its workers)",
        f"{'job':<46}{'wall s':>8}{'x none':>8}{'90% interval':>14}{'loop':>7}{'tail s':>8}"
        f"{'CPU':>7}{'train':>7}{'faults':>8}",
    ]
    for mode in runs:
        ratio = {key: med(mode, key) / base[key] for key in base}
        low, high = ratio_interval(runs[mode], runs["none"])
        lines.append(
            f"{JOBS[mode].format(every=args.every):<46}{med(mode, 'wall'):>8.2f}"
            f"{ratio['wall']:>8.3f}{f'{low:.3f}-{high:.3f}':>14}{ratio['loop']:>7.3f}"
            f"{med(mode, 'tail'):>8.2f}{ratio['cpu']:>7.3f}{ratio['train_cpu']:>7.3f}"
            f"{med(mode, 'train_faults'):>8.0f}"
        )
    lines += [
        "x none: wall ratio of the medians, with a 90% bootstrap interval; loop: until the",
        "last step ends (x none); tail: then waiting for the last snapshot to be durable;",
        "CPU: the process's CPU time, train: the training thread's (x none); faults: the",
        "training thread's minor page faults. On a shared 2-core VM one job's wall varies by",
        "~10% from run to run (the host, not the job): a 2% difference needs tens of repeats.",
    ]
    return "\n".join(lines)


def ratio_interval(
    runs: list[dict[str, float]], base: list[dict[str, float]], key: str = "wall"
) -> tuple[float, float]:
    """A 90% bootstrap interval of median(runs) / median(base): how far noise alone moves it."""
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices([r[key] for r in runs], k=len(runs)))
        / statistics.median(rng.choices([b[key] for b in base], k=len(base)))
        for _ in range(2000)
    )
    return ratios[len(ratios) // 20], ratios[-len(ratios) // 20 - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps-between", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=60, help="steps of one whole job")
    parser.add_argument("--every", type=int, default=10, help="a snapshot every N steps")
    parser.add_argument("--repeats", type=int, default=3, help="whole jobs per kind")
    parser.add_argument("--no-shm", dest="shm", action="store_false", help="skip /dev/shm")
    parser.add_argument(
        "--kinds", help=f"whole-job kinds, comma-separated (of {', '.join(JOBS)}; none always)"
    )
    parser.add_argument("--jobs-only", action="store_true", help="only the whole-job table")
    parser.add_argument("--job", choices=list(JOBS), help=argparse.SUPPRESS)  # one job, JSON
    args = parser.parse_args()
    if args.job:
        print(json.dumps(job(args.job, args.steps, args.every, args.batch, args.dir)))
        return
    root = tempfile.mkdtemp(prefix="snapshot-stall-", dir=args.dir)
    if args.jobs_only:
        print(whole_jobs(args, root))
        return
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    dcp_group = dist.new_group(backend="gloo")  # async_save on the training group crashes gloo
    t = make_trainer(args.batch)
    step_ms = statistics.median(t.step() for _ in range(5))
    nbytes = state_bytes(t)
    store = SnapshotStore(f"{root}/store", keep=2)
    runs: list[tuple[str, SaveFn]] = [
        ("torch.save", torch_save(t, root)),
        ("dcp.save", dcp_save(t, root)),
        ("dcp.async_save (thread)", dcp_async_save(t, root, dcp_group)),
        ("SnapshotStore blocking", store_save(t, store, "blocking")),
        ("SnapshotStore async (copy)", store_save(t, store, "async")),
        ("SnapshotStore async overlapped", store_save(t, store, "overlapped")),
    ]
    results = []
    for offset, (name, fn) in enumerate(runs):
        # Distinct steps per run: a committed step is never overwritten.
        shifted = (lambda f, o: lambda i: f(1000 * o + i))(fn, offset)
        res = run(name, t, shifted, args.saves, args.steps_between)
        results.append(res)
        print(f"done: {name}", flush=True)
    store.close()
    print(table(results, step_ms, nbytes))
    dist.destroy_process_group()
    print(whole_jobs(args, root))


if __name__ == "__main__":
    main()
