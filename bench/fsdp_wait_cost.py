"""The FSDP2 wait probe's own cost per step: an FSDP2 model's step with ``FSDPWait`` attached
against the same model without it, measured in the same run.

One process, a gloo group of one (FSDP2 runs every hook, no peer to wait for): what is left
is the probe's work, its hooks and marks around each sharded module's forward, pre-backward,
post-backward and the end of backward (``elastic_trainer/worker/step_timing.py``). Rounds of
steps alternate between the two models; the table gives the median round of each.

    python bench/fsdp_wait_cost.py [--rounds 15] [--steps 20] [--shapes 8x64,32x64,...]
        [--batch 16]

``--shapes``: BLOCKSxWIDTH of the stacks to measure; ``--batch``: rows of the input (blocks
with more work of their own, closer to a real model's, dilute the probe's fixed cost).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_trainer.worker.step_timing import FSDPWait, Stopwatch


def sharded_model(blocks: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
            for _ in range(blocks)
        )
    )
    mesh = init_device_mesh("cpu", (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step_ms(model: torch.nn.Module, data: torch.Tensor, steps: int) -> float:
    began = time.perf_counter()
    for _ in range(steps):
        model(data).square().mean().backward()
        model.zero_grad()
    return (time.perf_counter() - began) / steps * 1e3


def measure(
    blocks: int, width: int, rounds: int, steps: int, batch: int = 16
) -> tuple[float, float]:
    plain, probed = sharded_model(blocks, width), sharded_model(blocks, width)
    probe = FSDPWait.attach(probed, Stopwatch())
    assert probe is not None
    data = torch.randn(batch, width)
    times: dict[str, list[float]] = {"plain": [], "probed": []}
    for round_ in range(rounds + 1):
        for name, model in (("plain", plain), ("probed", probed)):
            figure = step_ms(model, data, steps)
            probe.take()
            if round_:  # the first round warms up
                times[name].append(figure)
    return statistics.median(times["plain"]), statistics.median(times["probed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shapes", default="8x64,32x64,8x256,32x256", help="BLOCKSxWIDTH,...")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
        if any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"--shapes {args.shapes!r}: use BLOCKSxWIDTH pairs, e.g. 8x64,32x256")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(str(Path(folder) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            print(f"{'modules':>8} {'width':>6} {'plain ms':>9} {'probed ms':>10} "
                  f"{'ratio':>6} {'us/module':>10}")  # fmt: skip
            for blocks, width in shapes:
                plain, probed = measure(blocks, width, args.rounds, args.steps, args.batch)
                per_module = (probed - plain) * 1e3 / (blocks + 1)
                print(
                    f"{blocks + 1:>8} {width:>6} {plain:>9.2f} {probed:>10.2f} "
                    f"{probed / plain:>6.3f} {per_module:>10.1f}"
                )
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
