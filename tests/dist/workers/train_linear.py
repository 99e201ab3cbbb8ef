"""A tiny fault-tolerant training script, run by the dist tests through the real launcher.

It is also the README example in executable form: a plain torchrun DDP script plus the
elastic_trainer lines marked ``# +``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import time

import psutil
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastic_trainer as et
from elastic_trainer.contract import protocol
from elastic_trainer.worker.memory.rank_slots import RankSlots
from snapshots.storage import faults

# This script's own switch for the crash tests: SIGKILL each rank halfway through its part
# of the in-memory copy of this step, in the first attempt.
KILL_MEMORY_WRITE_ENV = "TRAIN_LINEAR_KILL_MEMORY_WRITE"
# "STEP:SECONDS": each rank's in-memory copy of that step takes SECONDS longer, in the first
# attempt: a state too large to copy within the supervisor's kill grace.
SLOW_MEMORY_WRITE_ENV = "TRAIN_LINEAR_SLOW_MEMORY_WRITE"


class SlowCopyAt:
    """A fault injector that delays the first copy of ``step`` by ``seconds``."""

    def __init__(self, spec: str) -> None:
        step, _, seconds = spec.partition(":")
        self.step, self.seconds, self.slowed = int(step), float(seconds), False

    def __call__(self, point: str, *, step: int | None = None, **_where: object) -> None:
        if point == "mid_memory_write" and step == self.step and not self.slowed:
            self.slowed = True
            time.sleep(self.seconds)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=61)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--max-micro-batch", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--snapshot-dir", required=True)
    parser.add_argument("--snapshot-every", type=int, default=3)
    parser.add_argument("--audit-dir", required=True)
    parser.add_argument("--out", required=True, help="final parameters (rank 0, when done)")
    parser.add_argument(
        "--stop-at-step", type=int, default=None, help="rank 0 touches the stop file"
    )
    parser.add_argument(
        "--restart-at-step",
        type=int,
        default=None,
        help="rank 0 plays its supervisor restarting the group: restart marker, then SIGTERM",
    )
    parser.add_argument(
        "--control-dir-per-rank", action="store_true", help="each rank plays a node of its own"
    )
    parser.add_argument(
        "--memory-dir-per-rank", action="store_true", help="each rank has a memory tier of its own"
    )
    parser.add_argument("--width", type=int, default=0, help="a hidden WxW layer (bigger state)")
    parser.add_argument("--dropout", type=float, default=0.0, help="on the inputs (draws RNG)")
    parser.add_argument(
        "--memory-every",
        type=int,
        default=None,
        help="periodic in-memory copies every N steps (default: the session's)",
    )
    parser.add_argument("--crash-at-step", type=int, default=None, help="first attempt only")
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--freeze-at-step", type=int, default=None, help="first attempt only")
    parser.add_argument("--freeze-rank", type=int, default=1)
    parser.add_argument(
        "--drop-memory-on-restart",
        default="",
        help="ranks (a,b) that delete their memory folder before a restart's restore",
    )
    parser.add_argument(
        "--damage-memory-on-restart",
        default="",
        help="ranks (a,b) that flip a byte of their sharded in-memory copies before a restart",
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard), not DDP")
    parser.add_argument(
        "--hsdp", action="store_true", help="with --fsdp: two replicas of the shards (HSDP)"
    )
    parser.add_argument("--rss-out", default=None, help="rank 0: RSS and tier bytes per step")
    return parser.parse_args()


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def per_rank_folder(variable: str) -> None:
    """Each rank plays a node of its own: its own sub-folder of the node's folder."""
    base = os.environ[variable]
    os.environ[variable] = os.path.join(base, f"rank{os.environ['RANK']}")
    # private, as the supervisor makes the node's folder: the memory tier refuses a folder
    # that other users may read (0755 from the umask)
    os.makedirs(os.environ[variable], mode=0o700, exist_ok=True)


def drop_memory(args: argparse.Namespace) -> None:
    """Simulates memory copies lost with their nodes: the listed ranks delete theirs before
    the restarted group restores (a barrier, so that no rank restores before)."""
    if restart_count() == 0 or not args.drop_memory_on_restart:
        return
    if os.environ["RANK"] in args.drop_memory_on_restart.split(","):
        shutil.rmtree(os.environ[protocol.ENV_MEMORY_DIR], ignore_errors=True)
    torch.distributed.barrier()


def damage_memory(args: argparse.Namespace) -> None:
    """The listed ranks flip one byte in the middle of each of their sharded copies
    before the restarted group restores (a barrier, so that no rank restores before)."""
    if restart_count() == 0 or not args.damage_memory_on_restart:
        return
    if os.environ["RANK"] in args.damage_memory_on_restart.split(","):
        folder = os.path.join(
            os.environ[protocol.ENV_MEMORY_DIR], "shards", f"rank-{int(os.environ['RANK']):05d}"
        )
        for copy in RankSlots(folder).copies():  # a slot is rounded up: the copy's middle
            with open(os.path.join(folder, copy.slot), "r+b") as f:
                f.seek(copy.nbytes // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
    torch.distributed.barrier()


def wrap(module: nn.Module, fsdp: bool, hsdp: bool = False) -> nn.Module:
    """DDP, or FSDP2 with the root as the one unit (its parameters become DTensors); HSDP:
    a (replicate, shard) mesh of two replicas."""
    if not fsdp:
        return DDP(module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = torch.distributed.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    return fully_shard(module, mesh=mesh)


def final_weights(model: nn.Module, fsdp: bool) -> dict[str, torch.Tensor]:
    """Collective under FSDP2: the full (gathered) weights."""
    if not fsdp:
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def build_model(width: int, dropout: float) -> nn.Module:
    if dropout:  # each step draws from the global RNG: a resume must restore it exactly
        return nn.Sequential(nn.Dropout(dropout), build_model(width, 0.0))
    if not width:
        return nn.Linear(4, 1)
    return nn.Sequential(nn.Linear(4, width), nn.Linear(width, width), nn.Linear(width, 1))


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
        samples, 1, generator=generator
    )
    return TensorDataset(x, y)


def main() -> None:
    args = parse()
    if args.control_dir_per_rank:
        per_rank_folder(protocol.ENV_CONTROL_DIR)
    if args.memory_dir_per_rank:
        per_rank_folder(protocol.ENV_MEMORY_DIR)
    kill_at = os.environ.get(KILL_MEMORY_WRITE_ENV)
    if kill_at and restart_count() == 0:  # the injected crash of the copy's write happens once
        faults.inject(faults.KillAt("mid_memory_write", step=int(kill_at)))
    slow_at = os.environ.get(SLOW_MEMORY_WRITE_ENV)
    if slow_at and restart_count() == 0:
        faults.inject(SlowCopyAt(slow_at))
    ctx = et.init_worker()  # + (replaces dist.init_process_group)
    drop_memory(args)
    damage_memory(args)
    torch.manual_seed(0)
    model = wrap(build_model(args.width, args.dropout), args.fsdp, args.hsdp)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = dataset(args.samples)
    sampler = et.ElasticSampler(  # + (was DistributedSampler)
        data, seed=3, global_batch_size=args.global_batch, max_micro_batch_size=args.max_micro_batch
    )
    # its own generator: a DataLoader iterator otherwise draws a seed from the global RNG when
    # it starts, so a resume mid-epoch (a new iterator there) would shift the dropout masks
    loader = DataLoader(
        data, batch_size=sampler.micro_batch_size, sampler=sampler, generator=torch.Generator()
    )
    rss = RssProbe(args.rss_out, model) if args.rss_out and ctx.rank == 0 else None
    session = et.TrainingSession(  # +
        {"model": model, "optimizer": optimizer},
        sampler,
        snapshot_dir=args.snapshot_dir,
        snapshot_every=args.snapshot_every,
        audit_dir=args.audit_dir,
        max_steps=args.max_steps,
        memory_snapshot_every=args.memory_every,
    )
    for _epoch in session.epochs(args.epochs):  # + (was range(epochs) + set_epoch)
        for x, y in loader:
            with session.accumulate(model):  # +
                loss = nn.functional.mse_loss(model(x), y)
                session.scale_loss(loss, len(x)).backward()  # + (was loss.backward())
            if session.step_ready:  # +
                optimizer.step()
                optimizer.zero_grad()
                session.step_done()  # +
                _maybe_request_stop(args, ctx, session.step)
                _maybe_crash(args, ctx, session.step)
                if rss is not None:
                    rss.sample()
                if session.should_stop:  # +
                    break
    if session.stop_reason is None:
        weights = final_weights(model, args.fsdp)
        if ctx.rank == 0:
            torch.save(weights, args.out)
    if rss is not None:
        rss.write()
    session.finish()  # + (final snapshot; exits with the supervisor's code after a stop)


def _maybe_request_stop(args: argparse.Namespace, ctx: et.WorkerContext, step: int) -> None:
    # Simulates the supervisor's preemption signal: rank 0 creates the node's stop file.
    if args.stop_at_step == step and ctx.rank == 0 and ctx.stop_file:
        open(ctx.stop_file, "w").close()
    # ... or its restart of the group (agent._mark_restarting, then SIGTERM): once only
    once = f"{args.out}.restarted"  # (a membership restart keeps restart_count)
    restart_file = ctx.restart_file if args.restart_at_step == step and ctx.rank == 0 else None
    if restart_file and not os.path.exists(once):
        open(once, "w").close()
        open(restart_file, "w").close()
        os.kill(os.getpid(), signal.SIGTERM)


def _maybe_crash(args: argparse.Namespace, ctx: et.WorkerContext, step: int) -> None:
    if args.crash_at_step == step and ctx.rank == args.crash_rank and restart_count() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.freeze_at_step == step and ctx.rank == args.freeze_rank and restart_count() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # silent: its peers block in the next collective


def folder_bytes(folder: str) -> int:
    """Bytes of every file under ``folder`` (the node's copies, and each rank's own)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # a marker being replaced
                total += os.path.getsize(os.path.join(root, name))
    return total


class RssProbe:
    """Rank 0's resident memory and its memory tier's bytes on tmpfs, after every step."""

    def __init__(self, path: str, model: nn.Module) -> None:
        self.path, self.rss, self.tier, self.times = path, [], [], []
        self.state_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
        self.process = psutil.Process()

    def sample(self) -> None:
        self.rss.append(self.process.memory_info().rss)
        self.times.append(time.perf_counter())
        folder = os.environ.get(protocol.ENV_MEMORY_DIR)
        if folder and os.path.isdir(folder):
            self.tier.append(folder_bytes(folder))

    def write(self) -> None:
        with open(self.path, "w") as f:
            figures = {"rss": self.rss, "tier": self.tier, "times": self.times}
            json.dump({**figures, "state_bytes": self.state_bytes}, f)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
