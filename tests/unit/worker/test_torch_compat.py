"""Each torch internal a worker uses is still there (elastic_trainer.worker.torch_compat)."""

from __future__ import annotations

import pytest
import torch

from elastic_trainer.worker import torch_compat


@pytest.mark.parametrize("name", sorted(torch_compat.checks()))
def test_torch_piece_still_exists(name: str) -> None:
    assert torch_compat.checks()[name](), f"torch {torch.__version__} changed {name}"


def test_a_callback_runs_once_the_backward_pass_has_ended() -> None:
    order: list[str] = []

    def queue(_: torch.Tensor) -> None:
        if torch_compat.queue_backward_callback(lambda: order.append("callback")):
            order.append("queued")

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(queue)
    x.register_hook(lambda _: order.append("last node"))
    y.sum().backward()
    assert order == ["queued", "last node", "callback"]


def test_a_callback_outside_a_backward_pass_is_refused_not_raised() -> None:
    assert torch_compat.queue_backward_callback(lambda: None) is False


def test_without_torchs_engine_nothing_is_queued(monkeypatch) -> None:
    monkeypatch.delattr(torch.autograd.Variable, "_execution_engine")
    assert torch_compat.queue_backward_callback(lambda: None) is False
    assert not torch_compat.checks()["Variable._execution_engine.queue_callback"]()
