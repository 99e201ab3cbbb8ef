"""Whether this node hosts the store (``run.hosts_store``): a loopback endpoint is answered
without importing torch, and the answer is torch's own."""

from __future__ import annotations

import pytest

from elastic_trainer.supervisor import run, torch_compat
from elastic_trainer.supervisor.cli import args


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.0.53", "::1", "[::1]"])
def test_a_loopback_endpoint_is_hosted_here_as_torch_decides(host: str) -> None:
    assert run.is_loopback(host)
    assert torch_compat.matches_machine_hostname(host.strip("[]"))


@pytest.mark.parametrize("host", ["node-7.example.invalid", "localhost.localdomain", "0.0.0.0", ""])
def test_other_endpoints_are_left_to_torch(host: str) -> None:
    assert not run.is_loopback(host)


def test_an_explicit_is_host_wins_over_a_loopback_endpoint() -> None:
    cfg = args.parse(["--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-conf", "is_host=false", "x.py"])
    assert run.is_loopback(cfg.rdzv_host) and run.hosts_store(cfg) is False
