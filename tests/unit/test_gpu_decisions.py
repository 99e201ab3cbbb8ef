"""Every CUDA-specific decision of the product, checked on a CPU: which device, which backend,
which precision, which copy path, which RNG streams. The CUDA call behind each decision is
replaced by a recorder (monkeypatch), so what is checked is the choice, not the driver.

The same paths on a real GPU: ``tests/gpu`` (``bench/gpu_check.sh``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastic_trainer.jobs import fsdp, recipe
from elastic_trainer.supervisor.cli import allocation
from elastic_trainer.worker import distributed
from elastic_trainer.worker.context import WorkerContext
from elastic_trainer.worker.memory import byte_layout, shards
from snapshots.format import rng


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch sees ``n`` CUDA devices (0: none)."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return see


def worker(local_rank: int) -> WorkerContext:
    size = local_rank + 1
    return WorkerContext(
        rank=local_rank,
        local_rank=local_rank,
        world_size=size,
        local_world_size=size,
        master_addr="127.0.0.1",
        master_port=1,
    )


@pytest.mark.parametrize(
    ("n", "local_rank", "device", "backend"),
    [
        (0, 0, "cpu", "gloo"),
        (0, 3, "cpu", "gloo"),
        (1, 0, "cuda:0", "nccl"),
        (2, 1, "cuda:1", "nccl"),
        (2, 3, "cuda:1", "nccl"),  # more workers than GPUs: LOCAL_RANK modulo the count
        (8, 5, "cuda:5", "nccl"),
    ],
)
def test_a_worker_uses_cuda_local_rank_and_nccl_when_gpus_are_visible(
    gpus, n, local_rank, device, backend
) -> None:
    gpus(n)
    ctx = worker(local_rank)
    assert str(ctx.device) == device
    assert ctx.backend == backend


@pytest.mark.parametrize(("n", "set_to"), [(0, []), (2, ["cuda:1"])])
def test_init_worker_sets_the_current_cuda_device_before_the_group(
    gpus, monkeypatch, n, set_to
) -> None:
    gpus(n)
    chosen: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(str(d)))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)  # the script's own
    distributed.init_worker(worker(1), configure_logs=False)
    assert chosen == set_to


@pytest.mark.parametrize(("n", "backend", "device_id"), [(0, "gloo", None), (1, "nccl", "cuda:0")])
def test_the_group_is_bound_to_the_device_for_nccl_only(
    gpus, monkeypatch, n, backend, device_id
) -> None:
    """``device_id`` makes NCCL create its communicator eagerly, on the right GPU; gloo takes
    no device."""
    gpus(n)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_created_here", False)
    ctx = WorkerContext(rank=0, world_size=2, master_addr="127.0.0.1", master_port=1)
    distributed._init_process_group(ctx)
    (call,) = calls
    assert call["backend"] == backend
    assert (None if call["device_id"] is None else str(call["device_id"])) == device_id


@pytest.mark.parametrize(("backend", "device"), [("nccl", "cuda:3"), ("gloo", "cpu")])
def test_the_small_all_reduces_run_on_the_current_gpu_under_nccl(
    monkeypatch, backend, device
) -> None:
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert str(distributed.collective_device()) == device


@pytest.mark.parametrize(
    ("device", "amp", "dtype", "scaler_on"),
    [
        ("cuda", True, torch.float16, True),
        ("cuda", False, None, False),
        ("cpu", True, torch.bfloat16, False),
        ("cpu", False, None, False),
    ],
)
def test_amp_is_fp16_with_a_live_grad_scaler_on_cuda_only(
    monkeypatch, device, amp, dtype, scaler_on
) -> None:
    made: list[tuple[str, bool]] = []
    monkeypatch.setattr(torch.amp, "GradScaler", lambda dev, enabled: made.append((dev, enabled)))
    precision = recipe.Precision.choose(torch.device(device), amp)
    precision.scaler()
    assert precision.dtype == dtype
    assert made == [(device, scaler_on)]


@pytest.mark.parametrize(
    ("device", "amp", "param_dtype"),
    [("cuda", True, torch.bfloat16), ("cuda", False, None), ("cpu", True, None)],
)
def test_fsdp_mixed_precision_only_on_cuda_with_amp(monkeypatch, device, amp, param_dtype) -> None:
    meshes: list[str] = []
    policies: list[Any] = []
    monkeypatch.setattr(fsdp.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(fsdp, "init_device_mesh", lambda kind, shape: meshes.append(kind))
    monkeypatch.setattr(fsdp, "fully_shard", lambda m, mesh, mp_policy: policies.append(mp_policy))
    fsdp.shard(torch.nn.Linear(2, 2), torch.device(device), amp=amp)
    assert meshes == [device]  # the mesh is on the device type the model trains on
    assert policies and all(p.param_dtype == param_dtype for p in policies)
    if param_dtype is not None:
        assert all(p.reduce_dtype == torch.float32 for p in policies)


def test_only_a_contiguous_cpu_tensor_is_copied_as_flat_bytes() -> None:
    """A CUDA tensor (a ``meta`` one stands in: any device but the CPU) goes through one
    ``copy_``, which copies it device to host; bytes of it cannot be sliced on the host."""
    assert byte_layout.copied_flat(torch.zeros(4, 4))
    assert not byte_layout.copied_flat(torch.zeros(4, 4, device="meta"))
    assert not byte_layout.copied_flat(torch.zeros(4, 4).t())
    assert not byte_layout.copied_flat(torch.zeros(2, dtype=torch.complex64).conj())


def test_a_tensor_not_copied_flat_is_copied_in_one_piece(monkeypatch) -> None:
    monkeypatch.setattr(byte_layout, "CHUNK_BYTES", 64)
    flat, strided = torch.arange(64.0).reshape(8, 8), torch.arange(64.0).reshape(8, 8).t()
    slot = torch.zeros(256, dtype=torch.uint8)
    assert list(byte_layout._copy_tensor(flat, slot, 0)) == [64, 128, 192, 256]
    assert list(byte_layout._copy_tensor(strided, slot, 0)) == [256]
    assert torch.equal(slot.view(torch.float32).view(8, 8), strided)


def test_a_restored_shard_goes_to_the_device_of_the_live_tensor() -> None:
    """The in-memory copy is host bytes; a restore puts each tensor back where the training
    state lives (``meta`` stands in for ``cuda``)."""
    saved = torch.arange(4.0)
    assert shards._rebuild(saved, torch.empty(4, device="meta")).device.type == "meta"
    back = shards._rebuild(saved, None)
    assert back.device.type == "cpu" and torch.equal(back, saved)
    assert back.data_ptr() != saved.data_ptr()  # a tensor of its own


@pytest.mark.parametrize("n", [0, 2])
def test_cuda_rng_streams_are_captured_and_restored_only_with_gpus(gpus, monkeypatch, n) -> None:
    gpus(n)
    streams = [torch.tensor([1, 2], dtype=torch.uint8)] * max(n, 1)
    restored: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: streams)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = rng.capture_rng_state()
    assert ("cuda" in state) == (n > 0)
    rng.restore_rng_state({**state, "cuda": streams})
    assert restored == ([streams] if n else [])


@pytest.mark.parametrize(("n", "count"), [(0, 0), (4, 4)])
def test_the_supervisor_counts_gpus_through_torch(gpus, n, count) -> None:
    gpus(n)
    assert allocation.read_cuda_devices() == count
