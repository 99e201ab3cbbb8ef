import re

import pytest

from elastic_trainer.contract import endpoint
from elastic_trainer.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[::1]:29500", ("::1", 29500)),
        ("::1", ("::1", endpoint.DEFAULT_PORT)),
        ("[::1]", ("::1", endpoint.DEFAULT_PORT)),
        ("node-a", ("node-a", endpoint.DEFAULT_PORT)),
        (" node-a:1234 ", ("node-a", 1234)),
    ],
)
def test_parse(text, expected) -> None:
    assert endpoint.parse_endpoint(text) == expected


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("127.0.0.1:", "ends in ':' without a port"),
        ("[::1:29400", "opens '[' without ']'"),
        ("[::1]29400", "use [IPV6]:PORT"),
        (":29400", "has no host"),
        ("host:http", "has a bad port 'http'"),
    ],
)
def test_a_malformed_endpoint_is_named_with_its_flag(text, words) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)) as caught:
        endpoint.parse_endpoint(text, flag="--rdzv-endpoint")
    assert str(caught.value).startswith(f"--rdzv-endpoint={text.strip()!r}")


@pytest.mark.parametrize(("host", "text"), [("127.0.0.1", "127.0.0.1:80"), ("::1", "[::1]:80")])
def test_formatted_addresses_round_trip(host, text) -> None:
    assert endpoint.format_endpoint(host, 80) == text
    assert endpoint.split_address(text) == (host, 80)
    assert endpoint.parse_endpoint(text) == (host, 80)


def test_a_name_that_cannot_resolve_is_bad_input() -> None:
    with pytest.raises(endpoint.EndpointError, match="does not resolve"):
        endpoint.resolve("no-such-host.invalid", 29400)
