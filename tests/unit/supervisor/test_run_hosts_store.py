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


def _an_interface_address() -> str | None:
    import socket

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def test_an_endpoint_on_one_of_this_machines_interfaces_is_hosted_here(monkeypatch) -> None:
    """Regression: on a machine whose hostname resolves to 127.0.1.1 (Debian, Ubuntu), torch's
    answer for the machine's own IP is "elsewhere", and the first node of a two-machine job
    waited for a store nobody hosted."""
    own = _an_interface_address()
    if own is None:
        pytest.skip("no non-loopback IPv4 interface here")
    monkeypatch.setattr(torch_compat, "matches_machine_hostname", lambda host: False)
    cfg = args.parse(["--rdzv-endpoint", f"{own}:29500", "x.py"], env={})
    assert run.hosts_store(cfg) is True
    elsewhere = args.parse(["--rdzv-endpoint", "0.0.0.1:29500", "x.py"], env={})  # only a bind
    assert run.hosts_store(elsewhere) is False
