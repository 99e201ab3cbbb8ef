"""The in-memory tier with CUDA tensors: each copy is taken device to host and comes back
bit for bit (dtype, shape and every byte), through the mapped slots and the file path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_trainer.worker.memory import byte_layout
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
