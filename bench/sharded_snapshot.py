"""Sharded snapshots at 2 ranks, and a reshard 2 -> 3 on load: ours vs DCP, in one run.

A ~300 MB state (an MLP of 6 Linear(2048, 2048) layers, FSDP2 per layer on a CPU mesh, Adam
state after one step) on 2 processes (spawn, gloo, local disk under a temp dir). Saves:
(a) DistributedSnapshotter sharded (every rank writes its share), (b) the same snapshotter
rank-0-only (format 1; it does not gather FSDP2 state, so (b) saves the same parameters and
Adam state as a plain replicated model), (c) DCP ``save``, (d) DCP ``async_save`` on its own
gloo group (on the training group it crashes gloo). For each: wall time from the call until
the snapshot is committed/durable, and the training stall (how long the call blocks); the
slowest rank counts. Then 3 fresh processes (FSDP2 at 3) load what (a) and (c) wrote: ours
vs DCP ``load`` + ``set_state_dict``, each from a cold page cache (both snapshots' files are
dropped from it first: a restore after a lost node; ours are written past the page cache
anyway). Medians of --trials, after one warm-up save each.

    OMP_NUM_THREADS=1 python bench/sharded_snapshot.py [--trials 2] [--dir /tmp/x] [--phases]
        [--hot-load] [--buffered]

``--phases`` adds, for (a) and (b), the seconds each rank spent per phase of a save (medians
of the trials; ``bench/_save_phases.py`` says what each phase times). ``--hot-load`` loads
without dropping the snapshots from the page cache first (ours, written past it, come from
the disk anyway unless ``--buffered``); ``--buffered`` saves ours with
``storage_options={"direct_io": False}``, through the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _save_phases
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_trainer.entrypoints.worker import exit_without_finalizing
from snapshots import SnapshotStore
from snapshots.distributed import DistributedSnapshotter

WIDTH, LAYERS = 2048, 6
SAVES = ("ours sharded", "ours rank-0-only", "dcp.save", "dcp.async_save")


def make(world: int, *, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model after one Adam step (optimizer state exists), FSDP2 per layer or plain."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    if fsdp:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def state_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    tensors = list(model.parameters())
    tensors += [v for s in optimizer.state.values() for v in s.values() if v.dim()]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6  # global sizes


def every_rank(value: Any) -> list[Any]:
    """Collective: every rank's value, by rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def slowest(seconds: float) -> float:
    """Collective: the largest value over the ranks."""
    return max(every_rank(seconds))


Opts = dict[str, Any]  # the command line's options, as a dict (it crosses mp.spawn)
# A save starts at the call and returns a function that blocks until it is committed.
Save = Callable[[int], Callable[[], None]]


def ours(
    root: str, state: dict[str, Any], *, sharded: bool, buffered: bool
) -> tuple[Save, Callable[[], None]]:
    options = {"direct_io": False} if buffered else None
    store = SnapshotStore(f"{root}/ours-{sharded}", keep=2, storage_options=options)
    snap = DistributedSnapshotter(store, sharded=sharded)

    def save(step: int) -> Callable[[], None]:
        snap.save(step, state)
        return lambda: snap.wait()

    return save, snap.close


def dcp_saver(root: str, model: Any, opt: Any, group: Any = None) -> Save:
    def save(step: int) -> Callable[[], None]:
        msd, osd = get_state_dict(model, opt)
        sd, where = {"model": msd, "optim": osd}, f"{root}/dcp-{group is not None}-{step}"
        if group is None:
            dcp.save(sd, checkpoint_id=where)
            return lambda: None
        future = dcp.async_save(sd, checkpoint_id=where, process_group=group)
        return lambda: future.result()

    return save


def measure(save: Save, trials: int) -> tuple[list[float], list[float], list[Any]]:
    """Walls and stalls of the trials (slowest rank), and every rank's phases per trial."""
    walls, stalls, phases = [], [], []
    for step in range(trials + 1):  # step 0 warms up (threads, groups, staging buffers)
        dist.barrier()
        begun = time.perf_counter()
        done = save(step)
        stall = time.perf_counter() - begun
        done()
        wall, stall = slowest(time.perf_counter() - begun), slowest(stall)
        ranks = every_rank(_save_phases.take())
        if step:
            walls.append(wall)
            stalls.append(stall)
            phases.append(ranks)
    return walls, stalls, phases


def save_phase(rank: int, world: int, root: str, trials: int, opts: Opts) -> dict[str, Any]:
    model, opt = make(world, fsdp=True)
    plain, plain_opt = make(world, fsdp=False)  # (b): same tensors, replicated
    dcp_group = dist.new_group(backend="gloo")
    buffered = opts["buffered"]
    sharded, close_a = ours(
        root, {"model": model, "optimizer": opt}, sharded=True, buffered=buffered
    )
    rank0, close_b = ours(
        root, {"model": plain, "optimizer": plain_opt}, sharded=False, buffered=buffered
    )
    out: dict[str, Any] = {"mb": state_mb(model, opt)}
    runs = [sharded, rank0, dcp_saver(root, model, opt), dcp_saver(root, model, opt, dcp_group)]
    for name, save in zip(SAVES, runs, strict=True):
        out[name] = measure(save, trials)
        if name == "ours rank-0-only":
            del plain, plain_opt  # free ~600 MB before the DCP runs
    close_a()
    close_b()
    return out


def load_phase(rank: int, world: int, root: str, trials: int, opts: Opts) -> dict[str, Any]:
    model, opt = make(world, fsdp=True)
    snap = DistributedSnapshotter(SnapshotStore(f"{root}/ours-True", keep=None))

    def load_ours() -> None:
        snap.load(trials, into={"model": model, "optimizer": opt})

    def load_dcp() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp-False-{trials}")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    out = {}
    for name, load in (("ours", load_ours), ("dcp.load", load_dcp)):
        times = []
        for _ in range(trials):
            if rank == 0 and not opts["hot_load"]:  # a restore after a lost node: cold
                evict(f"{root}/ours-True")
                evict(f"{root}/dcp-False-{trials}")
            dist.barrier()
            begun = time.perf_counter()
            load()
            times.append(slowest(time.perf_counter() - begun))
        out[name] = times
    snap.close()
    return out


def evict(folder: str) -> None:
    """Drop a folder's files from the page cache, as after a reboot or on another node
    (POSIX_FADV_DONTNEED drops clean pages: fsynced first)."""
    for path in Path(folder).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(rank: int, world: int, root: str, trials: int, opts: Opts) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    if opts["phases"]:
        _save_phases.install()
    torch.set_num_threads(1)
    pg = f"file://{root}/pg-{world}"
    dist.init_process_group("gloo", init_method=pg, rank=rank, world_size=world)
    try:
        phase = save_phase if world == 2 else load_phase
        result = phase(rank, world, root, trials, opts)
        if rank == 0:
            Path(root, f"result-{world}.json").write_text(json.dumps(result))
    finally:
        dist.barrier()  # leave together: a peer closing its sockets first can abort gloo
        dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo threads can abort CPython's finalization (see bootstrap)


def table(saved: dict[str, Any], loaded: dict[str, Any]) -> tuple[str, dict[str, bool]]:
    wall = {n: statistics.median(saved[n][0]) for n in SAVES}
    stall = {n: statistics.median(saved[n][1]) * 1000 for n in SAVES}
    load = {n: statistics.median(v) for n, v in loaded.items()}
    lines = [
        f"state {saved['mb']:.0f} MB, 2 ranks; (b) saves the same tensors replicated "
        f"(format 1 does not gather FSDP2 state)",
        f"{'save':<20}{'wall s':>8}{'x rank-0-only':>15}{'stall ms':>10}{'x async_save':>14}",
    ]
    for n in SAVES:
        lines.append(
            f"{n:<20}{wall[n]:>8.2f}{wall[n] / wall['ours rank-0-only']:>15.2f}"
            f"{stall[n]:>10.1f}{stall[n] / stall['dcp.async_save']:>14.2f}"
        )
    lines.append(f"{'load 2 -> 3 ranks':<20}{'s':>8}{'x dcp.load':>15}")
    for n, s in load.items():
        lines.append(f"{n:<20}{s:>8.2f}{s / load['dcp.load']:>15.2f}")
    met = {
        "parallel save <= 0.6x rank-0-only": wall["ours sharded"] <= 0.6 * wall["ours rank-0-only"],
        "our stall <= dcp.async_save's": stall["ours sharded"] <= stall["dcp.async_save"],
        "reshard load <= 1.0x dcp.load": load["ours"] <= load["dcp.load"],
    }
    lines += [f"target {k}: {'met' if v else 'NOT met'}" for k, v in met.items()]
    return "\n".join(lines), met


def phase_table(saved: dict[str, Any]) -> str:
    """Seconds per phase and rank of (a) and (b): medians over the trials."""
    lines = []
    for name in SAVES[:2]:
        trials = saved[name][2]
        ranks = range(len(trials[0]))
        phases = sorted({p for trial in trials for per_rank in trial for p in per_rank})
        lines.append(f"{name + ' (s)':<26}" + "".join(f"{f'rank {r}':>9}" for r in ranks))
        for phase in phases:
            cells = [statistics.median(t[r].get(phase, 0.0) for t in trials) for r in ranks]
            lines.append(f"  {phase:<24}" + "".join(f"{c:>9.3f}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--phases", action="store_true", help="per-phase seconds of (a), (b)")
    parser.add_argument(
        "--hot-load",
        action="store_true",
        help="load without dropping the files from the page cache",
    )
    parser.add_argument(
        "--buffered", action="store_true", help="ours with storage_options={'direct_io': False}"
    )
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="sharded-snapshot-", dir=args.dir)
    try:
        for world in (2, 3):
            mp.spawn(worker, args=(world, root, args.trials, vars(args)), nprocs=world)
            print(f"done: {world} ranks", flush=True)
        saved = json.loads(Path(root, "result-2.json").read_text())
        loaded = json.loads(Path(root, "result-3.json").read_text())
        print(table(saved, loaded)[0])
        if args.phases:
            print(phase_table(saved))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
