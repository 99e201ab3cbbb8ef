"""Each private torch piece we rely on is still there with the shape we use (torch_compat)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from elastic_trainer import torch_compat


@pytest.mark.parametrize("name", sorted(torch_compat.checks()))
def test_private_piece_still_exists(name: str) -> None:
    assert torch_compat.checks()[name](), f"torch {torch.__version__} changed {name}"


def test_installed_torch_is_in_the_tested_range() -> None:
    """pyproject declares the range we test; a torch outside it must not pass silently."""
    low, high = torch_compat.TESTED_TORCH
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert tuple(map(int, low.split("."))) <= version <= tuple(map(int, high.split(".")))


def test_pyproject_pins_the_tested_range() -> None:
    import re
    from pathlib import Path

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    (torch_req,) = re.findall(r'"(torch>[^"]*)"', pyproject)  # tomllib needs Python 3.11
    low, high = torch_compat.TESTED_TORCH
    major, minor = map(int, high.split("."))
    assert torch_req.replace(" ", "") == f"torch>={low},<{major}.{minor + 1}"


def test_the_compat_functions_work_on_a_real_handler() -> None:
    """Not only names: drive each accessor against a real handler on an in-memory store."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    store = HashStore()
    handler = DynamicRendezvousHandler.from_backend(
        "job",
        store,
        C10dRendezvousBackend(store, "job"),
        1,
        1,
        timeout=RendezvousTimeout(close=timedelta(seconds=3)),
        keep_alive_interval=2,  # seconds (a float works too)
        keep_alive_max_attempt=4,
    )
    torch_compat.set_last_call_timeout(handler, timedelta(seconds=7))
    assert handler._settings.timeout.last_call == timedelta(seconds=7)
    assert torch_compat.keep_alive(handler) == (2.0, 4)
    assert torch_compat.close_timeout_s(handler) == 3.0
    state = torch_compat.rendezvous_state(handler, sync=True)
    assert state.round == 0 and not state.participants
    assert torch_compat.this_node(handler) is not None
    assert torch_compat.matches_machine_hostname("127.0.0.1")
