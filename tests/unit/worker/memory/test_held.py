"""What the host moves on at a step, frozen at the optimizer's pre-hook for a GPU's
just-in-time copy (``worker.memory.held``); everything else is read when the copy is made."""

from __future__ import annotations

from collections import namedtuple

import torch
from torch import nn

from elastic_trainer.worker.memory.held import Scalar, frozen, held_state, thawed


class Counted:
    """A Stateful that counts its reads."""

    def __init__(self) -> None:
        self.reads = 0

    def state_dict(self) -> dict:
        self.reads += 1
        return {"reads": self.reads}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_the_optimizer_and_the_scheduler_are_frozen_as_the_step_begins():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    scheduler.step()
    held = held_state({"optimizer": optimizer, "scheduler": scheduler})
    optimizer.step()  # the host moves on
    scheduler.step()
    held = thawed(held)
    assert {s["step"].item() for s in held["optimizer"]["state"].values()} == {1.0}
    assert held["optimizer"]["param_groups"][0]["lr"] == 0.05
    assert held["scheduler"]["last_epoch"] == 1
    restored = torch.optim.Adam(nn.Linear(2, 1).parameters(), lr=0.1)
    restored.load_state_dict(held["optimizer"])  # the shape a state dict has
    assert restored.state_dict()["param_groups"][0]["lr"] == 0.05


def test_other_statefuls_are_not_read_and_plain_values_are_copied():
    module, other = nn.Linear(2, 1), Counted()
    plain = {"cursor": [1, 2], "pair": (torch.zeros(1),)}
    held = held_state({"model": module, "other": other, "sampler": plain})
    assert held["model"] is module and held["other"] is other and other.reads == 0
    plain["cursor"].append(3)
    plain["pair"][0].add_(1)
    assert held["sampler"] == {"cursor": [1, 2], "pair": (torch.zeros(1),)}


def test_device_tensors_are_referenced_never_copied():
    """A copy of a device tensor would be queued on the device behind the step it must
    not wait for; the device has not changed it yet when the copy reads it."""
    on_device = torch.empty(4, device="meta")
    on_host = torch.zeros(2)
    Pair = namedtuple("Pair", "device host")
    out = frozen({"t": [on_device, Pair(on_device, on_host)]})
    assert out["t"][0] is on_device and out["t"][1].device is on_device
    assert isinstance(out["t"][1], Pair) and out["t"][1].host is not on_host


def test_a_0d_cpu_tensor_is_held_as_a_number_and_thawed_exactly():
    values = [
        torch.tensor(3.0),
        torch.tensor(0.1, dtype=torch.bfloat16),
        torch.tensor(2**40, dtype=torch.int64),
        torch.tensor(True),
    ]
    held = frozen({"values": values, "vector": torch.arange(3.0)})
    assert all(isinstance(v, Scalar) for v in held["values"])
    for value in values:
        value.fill_(0)  # the host moves on
    back = thawed(held)
    expected = [
        torch.tensor(3.0),
        torch.tensor(0.1, dtype=torch.bfloat16),
        torch.tensor(2**40, dtype=torch.int64),
        torch.tensor(True),
    ]
    for got, want in zip(back["values"], expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(back["vector"], torch.arange(3.0))


class StatefulDict(dict):
    """A Stateful that is also a dict: its state is what state_dict says, not its items."""

    def state_dict(self) -> dict:
        return {"kind": "state"}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_stateful_left_live_is_not_taken_apart_when_thawed():
    stateful = StatefulDict(items="not the state")
    back = thawed(held_state({"odd": stateful}))
    assert back["odd"] is stateful
