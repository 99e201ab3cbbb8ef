"""The in-memory tier with CUDA tensors: each copy is taken device to host and comes back
bit for bit (dtype, shape and every byte), through the mapped slots and the file path."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from elastic_trainer.worker.memory import byte_layout, leaf_checksum
from elastic_trainer.worker.memory.tier import NodeCopies


def cuda_state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(step)
    big = torch.randn(1_500_000, device="cuda", generator=gen)  # above CHUNK_BYTES
    return {
        "big": big,
        "half": big[:1000].half(),
        "bf16": big[:1000].bfloat16(),
        "strided": big[:4096].view(64, 64).t(),  # not contiguous
        "ints": torch.arange(10, device="cuda") * step,
        "empty": torch.empty(0, 3, device="cuda"),
        "cpu": torch.full((7,), float(step)),  # a CPU tensor beside them
    }


def assert_same_bits(back: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert back.keys() == saved.keys()
    for key, value in saved.items():
        host = value.detach().cpu()
        assert back[key].dtype == host.dtype and back[key].shape == host.shape, key
        assert torch.equal(as_bytes(back[key]), as_bytes(host)), key


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("chunk", [byte_layout.CHUNK_BYTES, 4096])
def test_cuda_state_copied_to_the_slots_comes_back_bit_identical(
    tmp_path: Path, monkeypatch, chunk: int
) -> None:
    monkeypatch.setattr(byte_layout, "CHUNK_BYTES", chunk)
    copies = NodeCopies(str(tmp_path))
    for step in range(1, 4):
        saved = cuda_state(step)
        copies.write(step, {"step": step, "state": saved})
        torch.cuda.synchronize()
        assert_same_bits(copies.read(step)["state"], saved)


def test_cuda_state_through_the_file_path_comes_back_bit_identical(tmp_path: Path) -> None:
    saved = cuda_state(5)
    with open(tmp_path / "copy.bin", "wb") as f:
        digest = byte_layout.write({"state": saved}, f)
    data = bytearray((tmp_path / "copy.bin").read_bytes())
    byte_layout.verify(data, digest, "copy.bin")
    assert_same_bits(byte_layout.read(data)["state"], saved)


@pytest.fixture
def shm_path():
    """A folder on tmpfs, where the tier's folders are (a slot on a disk cannot be locked)."""
    folder = tempfile.mkdtemp(prefix="gpu-tier-", dir="/dev/shm")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("piece", [byte_layout.DEVICE_PIECE_BYTES, 4096])
def test_a_reserved_slot_is_page_locked_and_a_cuda_state_comes_back_bit_identical(
    shm_path: Path, monkeypatch, piece: int
) -> None:
    """The just-in-time copy's slot is registered with the driver when it is reserved, so the
    copy from the device runs at the link's speed; copied in pieces (each checksummed on
    other threads while the next crosses), the state still comes back bit for bit, and a
    slot let go of is unregistered."""
    monkeypatch.setattr(byte_layout, "DEVICE_PIECE_BYTES", piece)
    monkeypatch.setattr(leaf_checksum, "LEAF_BYTES", 3 * piece + 64)
    copies = NodeCopies(str(shm_path))
    saved = cuda_state(7)
    payload = {"step": 7, "state": saved}
    layout = byte_layout.plan(payload)
    assert layout.on_device
    copies.reserve(layout.size, pin=True)
    (mapped,) = [m for m in copies.slots.values() if m.pinned]
    assert mapped.tensor(layout.size).is_pinned()
    copies.write(7, payload)
    torch.cuda.synchronize()
    assert_same_bits(copies.read(7)["state"], saved)
    tensor = mapped.tensor(layout.size)
    copies.unmap()
    assert not mapped.pinned
    del tensor


def test_a_slot_the_driver_will_not_lock_is_copied_pageable_and_cuda_goes_on(
    tmp_path: Path,
) -> None:
    """A slot on a disk (not tmpfs): the driver refuses to lock it (seen on an H200 as
    cudaErrorInvalidValue), and that refusal, left as the thread's last CUDA error, made the
    next copy from the device fail with "invalid argument". It is cleared: the copy goes
    through pageable memory, bit for bit, and CUDA work after it runs."""
    copies = NodeCopies(str(tmp_path))
    saved = cuda_state(9)
    payload = {"step": 9, "state": saved}
    copies.reserve(byte_layout.plan(payload).size, pin=True)
    copies.write(9, payload)
    torch.cuda.synchronize()
    assert_same_bits(copies.read(9)["state"], saved)
    assert torch.randn(1000, device="cuda").sum().isfinite()
