"""A rendezvous store's endpoint as one value: ``HOST[:PORT]`` parsed, formatted and
resolved the same way by the supervisor, the workers' environment, ``status`` and the
standalone store.

IPv6 literals take brackets (``[::1]:29400``); a bare IPv6 literal is a host without a port.
Each malformed form is named, never silently repaired.
"""

from __future__ import annotations

import socket

from elastic_trainer.errors import ConfigError

DEFAULT_PORT = 29400  # torchrun's default c10d rendezvous port


class EndpointError(ConfigError):
    """The endpoint is wrong: it does not resolve, or what answers there is not a c10d store."""


class ResolverNotReady(Exception):
    """The name service itself did not answer (``EAI_AGAIN``): worth another try."""


def format_endpoint(host: str, port: int) -> str:
    """An ``--rdzv-endpoint`` value: IPv6 addresses need brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(text: str, *, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``HOST[:PORT]`` (``[v6]:PORT``, or a bare IPv6 literal) -> (host, port); the port
    defaults to ``DEFAULT_PORT``. ``ConfigError`` names ``flag``, the value and the fix."""
    text = text.strip()
    host, port_text, has_port = text, "", False
    if text.startswith("["):
        if "]" not in text:
            raise ConfigError(
                f"{flag}={text!r} opens '[' without ']': use [IPV6]:PORT, e.g. [::1]:29400"
            )
        host, _, tail = text[1:].partition("]")
        if tail and not tail.startswith(":"):
            raise ConfigError(f"{flag}={text!r} is invalid: use [IPV6]:PORT")
        port_text, has_port = tail[1:], bool(tail)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        has_port = True
    if not host:
        raise ConfigError(f"{flag}={text!r} has no host: use HOST[:PORT]")
    if has_port and not port_text:
        raise ConfigError(
            f"{flag}={text!r} ends in ':' without a port: use HOST:PORT, or HOST alone "
            f"for port {DEFAULT_PORT}"
        )
    if not has_port:
        return host, DEFAULT_PORT
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{flag}={text!r} has a bad port {port_text!r}: use HOST:PORT") from None
    return host, port


def split_address(text: str) -> tuple[str, int]:
    """A ``HOST:PORT`` this program formatted itself (``format_endpoint``) -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def resolve(host: str, port: int) -> None:
    """``EndpointError`` (exit 2) for a host name that cannot resolve; ``ResolverNotReady``
    when the name service itself does not answer yet."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            raise ResolverNotReady(f"cannot resolve {host!r} yet ({exc.strerror})") from exc
        raise EndpointError(
            f"--rdzv-endpoint={format_endpoint(host, port)}: the host name {host!r} does not "
            f"resolve ({exc.strerror}): fix HOST"
        ) from exc
