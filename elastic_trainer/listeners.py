"""Listening sockets bound to the job's own address: the rendezvous store (supervisor's
``endpoint``) and the workers' process-group store (``worker/group_store``) bind alike, so
that a loopback job stays loopback and a node's store listens on the address its peers use.
Standard library only: every process may import it.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket


def listen(host: str, port: int, *, reuse: bool = True) -> socket.socket:
    """A socket bound to exactly ``host``'s address (OSError when it cannot be had), not yet
    listening: until a store serves on it, a connection is refused, which a client takes
    for a store not up yet and retries, not for a port that is not a store."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # a restarted agent takes its port back while old connections sit in TIME_WAIT;
        # on Linux two live listeners still cannot share the port. Two sockets bound and
        # not yet listening can, so a claim (``endpoint.claim_port``) goes without it.
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return sock


def own_name_on_loopback(host: str) -> bool:
    """A host name, other than localhost, that this machine resolves to loopback: Debian's
    /etc/hosts maps the machine's own name to 127.0.1.1, while the other nodes reach it by
    that name at its real address."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host.split("%", 1)[0])
        return False  # an address, not a name
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        resolved = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return False
    return ipaddress.ip_address(plain_address(resolved)).is_loopback


def bound_listener(host: str, port: int, *, reuse: bool = True) -> socket.socket:
    """``host``'s own address, so that loopback stays loopback. Every interface only where
    that address cannot be the one the other nodes use: an address that is not on this
    machine (a Service or NAT address that forwards here, with ``is_host=true``) or this
    machine's name resolved to loopback here."""
    if own_name_on_loopback(host):
        return listen("", port, reuse=reuse)
    try:
        return listen(host, port, reuse=reuse)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
    return listen("", port, reuse=reuse)


def plain_address(ip: str) -> str:
    """``::ffff:127.0.0.1`` -> ``127.0.0.1``: how an IPv4 peer of an IPv6 socket shows."""
    with contextlib.suppress(ValueError):
        mapped = ipaddress.ip_address(ip.split("%", 1)[0])
        if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped:
            return str(mapped.ipv4_mapped)
    return ip
