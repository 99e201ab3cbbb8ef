"""The store server's pure parts and its binding rules, in-process (no torch import)."""

from __future__ import annotations

import signal
import socket

import pytest

from elastic_trainer.errors import ConfigError
from elastic_trainer.tools.store_server import (
    DEFAULT_HOST,
    Stopper,
    StoreConfig,
    bind_listener,
    config_from_args,
    decide,
    format_endpoint,
    parse_args,
    write_ready_file,
)


def test_defaults_bind_loopback_never_all_interfaces() -> None:
    config = config_from_args(parse_args([]))
    assert config.host == DEFAULT_HOST == "127.0.0.1"
    assert config.port == 29400


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"port": -1}, "--port"), ({"port": 65536}, "--port"), ({"backlog": 0}, "--backlog")],
)
def test_bad_values_name_the_flag(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        StoreConfig(**kwargs)


def test_positional_construction_is_refused() -> None:
    with pytest.raises(TypeError):
        StoreConfig("127.0.0.1", 1234)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("host", "port", "endpoint"),
    [("127.0.0.1", 29400, "127.0.0.1:29400"), ("::1", 5, "[::1]:5"), ("node-1", 7, "node-1:7")],
)
def test_endpoint_format_matches_rdzv_endpoint(host: str, port: int, endpoint: str) -> None:
    assert format_endpoint(host, port) == endpoint


def test_listener_is_bound_to_exactly_the_given_address() -> None:
    listener = bind_listener(StoreConfig(host="127.0.0.1", port=0))
    try:
        assert listener.getsockname()[0] == "127.0.0.1"
    finally:
        listener.close()


def test_port_in_use_is_a_config_error_naming_the_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port {port} is already in use.*--port"):
            bind_listener(StoreConfig(host="127.0.0.1", port=port))


def test_address_of_another_machine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not an address of this machine"):
        bind_listener(StoreConfig(host="192.0.2.1", port=0))  # TEST-NET-1, never local


def test_unresolvable_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"--host 'no-such-host\.invalid'"):
        bind_listener(StoreConfig(host="no-such-host.invalid", port=0))


def test_ready_file_holds_one_complete_endpoint(tmp_path) -> None:
    path = tmp_path / "ready"
    write_ready_file(str(path), "10.0.0.5", 29400)
    assert path.read_text() == "10.0.0.5:29400\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ready"]  # no temp file left behind


@pytest.mark.parametrize(
    ("signum", "linger_s", "lingering", "action"),
    [
        (signal.SIGTERM, 0.0, False, "stop"),  # default: SIGTERM stops at once
        (signal.SIGTERM, 30.0, False, "linger"),
        (signal.SIGTERM, 30.0, True, "stop"),  # a second SIGTERM does not wait again
        (signal.SIGINT, 30.0, False, "stop"),  # SIGINT never lingers
    ],
)
def test_decide(signum: int, linger_s: float, lingering: bool, action: str) -> None:
    assert decide(signum, linger_s, lingering) == action


def test_stopper_without_linger_returns_on_the_first_sigterm() -> None:
    stop = Stopper(0.0)
    stop.handler(signal.SIGTERM)
    stop.wait()  # returns at once; a hang here is caught by pytest-timeout
    assert stop.signals == ["SIGTERM"]


def test_negative_linger_is_refused() -> None:
    with pytest.raises(ConfigError, match="--linger"):
        StoreConfig(linger_s=-1)
