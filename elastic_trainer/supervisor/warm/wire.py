"""The warm pool's wire format, both ends (``launcher.WarmPool`` in the supervisor,
``entrypoints/warm_pool.py`` in the pool): one JSON message per ``SOCK_SEQPACKET`` datagram,
with the worker's stdio passed as fds."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

MAX_MESSAGE = 1 << 20  # bytes: a worker's environment and argv, with room to spare


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def receive(sock: socket.socket, *, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it; (None, []) when the peer is gone: at EOF,
    or reset (it closed with a message of ours unread: a supervisor that ended while its
    pool imported, on a bad flag, would otherwise leave the pool's traceback on its stderr
    beside its one-line error)."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, max_fds)
    except ConnectionResetError:
        return None, []
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)
