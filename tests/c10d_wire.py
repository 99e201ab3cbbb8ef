"""A c10d store client in the standard library alone, as another local user could write one:
the attacker's side of the store tests (run with a system Python that user may execute, which
cannot import torch). The wire format is torch's ``TCPStore`` (``tests/test_c10d_wire.py``
checks it against a real store): a query byte, then strings as a u64 length and the bytes.
TCPStore's Python API puts a ``/`` before every key; this client takes keys as stored."""

from __future__ import annotations

import socket
import struct

VALIDATE, SET, COMPARE_SET, GET = 0, 1, 2, 3
MAGIC = 0x3C85F7CE


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class Client:
    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.sendall(struct.pack("<BI", VALIDATE, MAGIC))

    def set(self, key: str, value: bytes) -> None:
        """``key`` as the Python API names it (the ``/`` is added here)."""
        self.sock.sendall(bytes([SET]) + _field(("/" + key).encode()) + _field(value))

    def get(self, key: str) -> bytes:
        self.sock.sendall(bytes([GET]) + _field(("/" + key).encode()))
        (size,) = struct.unpack("<Q", self._read(8))
        return self._read(size)

    def _read(self, size: int) -> bytes:
        out = b""
        while len(out) < size:
            chunk = self.sock.recv(size - len(out))
            if not chunk:
                raise EOFError("the store closed the connection")
            out += chunk
        return out


def source() -> str:
    """This module's code, to run as another user (``python -I -c``)."""
    with open(__file__) as f:
        return f.read()
