"""Page-locking a slot for the GPU (``worker.memory.pinning``, ``slots.MappedFile``'s
``pin``), with the CUDA runtime replaced: when it is asked, once per mapping, undone before
the mapping goes, and never where CUDA is not already in use."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from elastic_trainer.worker.memory import byte_layout, pinning, slots
from elastic_trainer.worker.memory.rank_slots import RankSlots


class FakeRuntime:
    def __init__(self, code: int = 0) -> None:
        self.code, self.calls = code, []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self) -> int:
        self.calls.append(("clear",))
        return 0


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(pinning, "cuda_in_use", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(pinning, "_refused", set())
    monkeypatch.setattr(pinning, "runtime_library", lambda: fake)
    return fake


def test_no_cuda_in_use_no_registration_and_cuda_is_never_started(monkeypatch):
    def refuse() -> None:
        raise AssertionError("the CUDA runtime was asked for")

    monkeypatch.setattr(torch.cuda, "cudart", refuse)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not pinning.register(torch.zeros(4096, dtype=torch.uint8))


def test_a_slot_asked_to_be_pinned_is_registered_once_and_unregistered_before_unmap(
    tmp_path, runtime
):
    mapped = slots.MappedFile(str(tmp_path / "slot-a"))
    first = mapped.tensor(100_000, pin=True)
    assert mapped.pinned
    assert runtime.calls == [("register", first.data_ptr(), first.numel(), 0)]
    assert mapped.tensor(100_000, pin=True) is first  # the same mapping: not again
    assert len(runtime.calls) == 1
    mapped.close()
    assert runtime.calls[-1] == ("unregister", first.data_ptr()) and not mapped.pinned
    second = mapped.tensor(100_000, pin=True)  # mapped afresh: registered afresh
    assert runtime.calls[-1] == ("register", second.data_ptr(), second.numel(), 0)
    mapped.close()


def test_an_unpinned_slot_is_never_registered(tmp_path, runtime):
    mapped = slots.MappedFile(str(tmp_path / "slot-a"))
    mapped.tensor(100_000)
    mapped.close()
    assert runtime.calls == [] and not mapped.pinned


def test_a_refused_registration_leaves_the_slot_pageable_said_once(tmp_path, runtime):
    runtime.code = 2  # cudaErrorMemoryAllocation
    mapped = slots.MappedFile(str(tmp_path / "slot-a"))
    with capture_logs() as logs:
        tensor = mapped.tensor(100_000, pin=True)
        assert not mapped.pinned and tensor.numel() >= 100_000
        mapped.tensor(100_000, pin=True)  # not tried again for this mapping
        other = slots.MappedFile(str(tmp_path / "slot-b"))
        other.tensor(100_000, pin=True)  # tried, refused with the same code: not said again
    # each refusal's error is cleared at once: torch's next launch check would raise it
    assert [c[0] for c in runtime.calls] == ["register", "clear", "register", "clear"]
    said = [(e["event"], e["bytes"]) for e in logs]
    assert said == [("snapshot.memory_unpinned", tensor.numel())]
    assert "cudaHostRegister returned 2" in logs[0]["error"]
    mapped.close()
    other.close()
    assert [c[0] for c in runtime.calls] == ["register", "clear"] * 2  # nothing to undo


def test_without_a_runtime_library_to_clear_a_refusal_nothing_is_registered(
    tmp_path, runtime, monkeypatch
):
    monkeypatch.setattr(pinning, "runtime_library", lambda: None)
    mapped = slots.MappedFile(str(tmp_path / "slot-a"))
    mapped.tensor(100_000, pin=True)
    assert runtime.calls == [] and not mapped.pinned
    mapped.close()


def test_the_runtime_library_is_found_among_the_loaded_ones_or_none():
    found = pinning.runtime_library()
    with open("/proc/self/maps") as maps:
        loaded = "libcudart.so" in maps.read()
    assert (found is not None) == loaded


def test_the_slots_of_a_state_on_the_gpu_are_pinned_and_others_not(tmp_path, runtime, monkeypatch):
    """Which copies ask for it: a whole copy (``NodeCopies.write``) and a rank's shard copy
    (``RankSlots.write``) of tensors on the device; not of tensors on the CPU."""
    payload = {"step": 1, "w": torch.ones(1000)}
    slots.NodeCopies(str(tmp_path / "cpu")).write(1, payload)
    RankSlots(str(tmp_path / "cpu-shards")).write(1, 1, payload)
    assert runtime.calls == []
    monkeypatch.setattr(byte_layout.Layout, "on_device", property(lambda _self: True))
    slots.NodeCopies(str(tmp_path / "gpu")).write(1, payload)
    RankSlots(str(tmp_path / "gpu-shards")).write(1, 1, payload)
    assert [c[0] for c in runtime.calls] == ["register", "register"]
