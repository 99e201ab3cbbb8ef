"""FSDP2's waits in backward are waits, a module's own backward is compute
(worker/step_timing.py ``FSDPWait``).

One process, a gloo group of one: FSDP2 runs its hooks but has no peer to wait for, so the
waits are stood in for by sleeps placed where FSDP waits. A sleep only bounds time from below,
so every assertion is a lower bound: a sleep counted on the wrong side fails it whatever the
machine's load.
- the re-gather of parameters in FSDP's pre-backward hook (on the module's output): a tensor
  hook registered after FSDP's on the same output runs between FSDP's and the module's backward;
- the reduce-scatter in FSDP's post-backward: ``set_all_reduce_hook`` (public) runs inside it;
- the module's own backward: an autograd function that sleeps in its backward.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_trainer.worker import step_timing
from elastic_trainer.worker.step_timing import FSDPWait, StepTiming, Stopwatch
from tests.slow_modules import Block

SLEEP_S = 0.05


@pytest.fixture
def group(tmp_path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(8), Block(8), Block(8))
    mesh = init_device_mesh("cpu", (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: torch.nn.Module) -> None:
    model(torch.randn(4, 8, requires_grad=True)).square().mean().backward()


def waited_s(probe: FSDPWait) -> float:
    return sum(b - a for a, b in probe.take())


def sleep_after_fsdps_pre_backward(module: torch.nn.Module, seconds: float) -> None:
    """A forward hook registered after FSDP's: its tensor hook on the output runs right after
    FSDP's pre-backward hook, as its re-gather's wait would."""

    def on_output(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
        output.register_hook(lambda _: time.sleep(seconds))

    module.register_forward_hook(on_output)


def test_a_wait_in_fsdps_pre_backward_is_a_wait(group):
    model = sharded_model()
    probe = FSDPWait.attach(model, Stopwatch())
    assert probe is not None
    sleep_after_fsdps_pre_backward(model[1], SLEEP_S)
    step(model)
    assert waited_s(probe) >= SLEEP_S


def test_a_wait_in_fsdps_post_backward_is_a_wait(group):
    model = sharded_model()
    probe = FSDPWait.attach(model, Stopwatch())
    assert probe is not None
    model[1].set_all_reduce_hook(lambda _: time.sleep(SLEEP_S))  # inside FSDP's post-backward
    step(model)
    assert waited_s(probe) >= SLEEP_S


def test_a_modules_own_slow_backward_is_compute_not_a_wait(group):
    model = sharded_model()
    timing = StepTiming(Stopwatch())
    assert timing.watch(model)
    for block in model:
        block.backward_s = SLEEP_S  # every module, root included: nothing of it is a wait
    timing.released()
    step(model)
    assert timing.compute_us() >= 3 * SLEEP_S * 1e6


def test_spans_never_overlap_so_no_wait_counts_twice(group):
    """The root's output is its last block's too: two brackets on one node, nested."""
    model = sharded_model()
    probe = FSDPWait.attach(model, Stopwatch())
    assert probe is not None
    step(model)
    spans = probe.take()
    assert len(spans) >= 4  # 4 pre-forwards at least
    assert all(a <= b for a, b in spans)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def test_fsdps_final_callback_is_bracketed_where_torch_lets_us(group, monkeypatch):
    model = sharded_model()
    probe = FSDPWait.attach(model, Stopwatch())
    assert probe is not None
    step(model)
    with_final = len(probe.take())
    monkeypatch.setattr(step_timing, "queue_backward_callback", lambda _: False)
    step(model)
    assert len(probe.take()) == with_final - 1  # the rest still measured: fails soft


def test_forward_without_grad_brackets_only_the_all_gathers(group):
    model = sharded_model()
    probe = FSDPWait.attach(model, Stopwatch())
    assert probe is not None
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert len(probe.take()) == 4  # one pre-forward each, no backward brackets
