"""The writer process's own loop (``python -m snapshots.write.writer_child FD PARENT_PID``).

It maps the parent's staging blocks, rebuilds each request's state tree on them, runs
``serialization.serialize_into`` into the file descriptor it was given, and answers with
(size, digest, bytes written) or the error. See ``_writer_process`` for the protocol's why.
The request comes from the parent that started it, over a socket pair no one else holds;
unpickling it executes nothing from a snapshot. It exits at end of file on the socket, or
once its parent is gone.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import socket
import sys
from typing import Any

import torch

from snapshots import proc_title
from snapshots.format import serialization
from snapshots.storage.local import Sink
from snapshots.write.writer_process import HEADER, MAX_FDS, recv_exactly

# How often a wait for the next request checks that the parent is still there.
POLL_S = 1.0


class _Decoder(pickle.Unpickler):
    def __init__(self, data: bytes, blocks: dict[int, mmap.mmap]) -> None:
        super().__init__(io.BytesIO(data))
        self._blocks = blocks

    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind = pid[0]
        if kind == "empty":
            _, dtype, shape = pid
            return torch.empty(shape, dtype=getattr(torch, dtype))
        if kind != "shm":
            raise pickle.UnpicklingError(f"unknown tensor reference {kind!r}")
        _, block, offset, dtype, shape = pid
        numel = 1
        for n in shape:
            numel *= n
        flat = torch.frombuffer(self._blocks[block], dtype=getattr(torch, dtype), count=numel,
                                offset=offset)  # fmt: skip
        return flat.view(shape)


def _request(sock: socket.socket, parent: int) -> tuple[dict[str, Any], bytes, list[int]] | None:
    def alive() -> bool:  # the parent is still there: keep waiting
        return os.getppid() == parent

    while True:
        try:
            head, fds, _, _ = socket.recv_fds(sock, HEADER.size, MAX_FDS)
            break
        except TimeoutError:
            if not alive():
                return None
    if not head:
        return None
    rest = recv_exactly(sock, HEADER.size - len(head), alive) if len(head) < HEADER.size else b""
    if rest is None:
        return None
    (length,) = HEADER.unpack(head + rest)
    body = recv_exactly(sock, length, alive)
    size = recv_exactly(sock, HEADER.size, alive)
    if body is None or size is None:
        return None
    tree = recv_exactly(sock, HEADER.unpack(size)[0], alive)
    if tree is None:
        return None
    return json.loads(body), tree, list(fds)


def _answer(sock: socket.socket, answer: dict[str, Any]) -> None:
    body = json.dumps(answer).encode()
    sock.sendall(HEADER.pack(len(body)) + body)


def serve(sock: socket.socket, parent: int) -> None:
    blocks: dict[int, mmap.mmap] = {}
    while (request := _request(sock, parent)) is not None:
        header, tree, fds = request
        target, *block_fds = fds
        try:
            for (block, size), fd in zip(header["map"], block_fds, strict=True):
                blocks[block] = mmap.mmap(fd, size, mmap.MAP_SHARED)
            for block in header["drop"]:
                blocks.pop(block, None)
            answer = _write(header, tree, target, blocks)
        finally:
            for fd in fds:
                os.close(fd)
        _answer(sock, answer)


def _write(
    header: dict[str, Any], tree: bytes, target: int, blocks: dict[int, mmap.mmap]
) -> dict[str, Any]:
    try:
        value = _Decoder(tree, blocks).load()
        sink = Sink(target, None, direct=header["direct"])
        size, digest = serialization.serialize_into(value, sink, header["algorithm"])
        sink.flush()
        return {"id": header["id"], "size": size, "digest": digest, "written": sink.written}
    except OSError as exc:
        return {"id": header["id"], "error": str(exc), "errno": exc.errno}
    except Exception as exc:  # answered, not raised: the parent writes the file itself
        return {"id": header["id"], "error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str]) -> int:
    fd, parent = int(argv[1]), int(argv[2])
    proc_title.set_title(proc_title.writer(os.environ, parent))
    torch.set_num_threads(1)
    sock = socket.socket(fileno=fd)
    sock.settimeout(POLL_S)
    if os.getppid() != parent:
        return 0  # it died while this process imported torch
    try:
        _answer(sock, {"ready": True, "pid": os.getpid()})
        serve(sock, parent)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
