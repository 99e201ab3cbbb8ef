"""The writer process: a save's files serialised in another process, off this one's GIL.

Why: serialising a save on this process's writer thread (torch's pickler walks every
tensor, the zip writer calls back into Python for every record) holds the GIL for a while on
every save; the training thread needs it between its operators, so a step that overlaps a
save spends part of it waiting (blocked, not running). The same work in another process
leaves this one's GIL to training (``bench/snapshot_stall.py``; docs/snapshots.md, "A writer
process for large local saves").

How: the staged tensors are already on shared memory (``shared_staging``). The writer
thread pickles the state *tree* with each tensor replaced by where its bytes lie (a block
and an offset, plus dtype and shape: small, no tensor data), and passes it with the open
temp file's descriptor over a socket pair. The child maps the blocks once, rebuilds each
tensor on the very same bytes, runs the same ``serialization.serialize_into`` into the
descriptor (``O_DIRECT`` for large records, hashing on the way) and answers with the size
and digest. The parent then does everything else as before: fsync, rename, manifest.
The file is byte for byte the one the thread would have written (a test checks).

When: opted in (``storage_options={"writer_process": True}``; it costs a process per worker
that imports torch, its memory and the CPU of that import at its start, which pays where saves
are frequent and the training thread is GIL-bound, as a GPU job's launching thread is), local
files only (the sink must be a file descriptor), a save from ``PROCESS_MIN_BYTES`` up, and
never while a crash test's kill point is armed (the kill must hit the training process). The
process is started at the first such save, which is still written on the thread, as is every
save until it answered that it is ready (it imports torch, once per process). One writer
process serves every store of this process.

If it is lost (killed, a broken pipe, a save cancelled at its deadline while it ran), the
file is written again from its start on the thread, ``snapshot.writer_process_lost`` says
so, and every later save of this process stays on the thread. It exits when this process
does: its socket reads end of file, and it checks its parent once a second.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from snapshots.events import emit
from snapshots.storage import faults
from snapshots.write import shared_staging

# A save smaller than this stays on the thread: its pickling is short, and a process that
# imports torch (seconds of CPU, hundreds of MB) would not pay for itself.
PROCESS_MIN_BYTES = 32 << 20
# How often a wait for the child looks at its caller's deadline and the child's liveness.
POLL_S = 0.25
HEADER = struct.Struct("!I")
# Descriptors one request may carry (the kernel's SCM_MAX_FD is 253): the file and the
# staging blocks the child has not mapped yet. A save over more new blocks stays on the thread.
MAX_FDS = 250

# The folder that holds the ``snapshots`` package: the child imports it from there.
_PACKAGES_ROOT = os.path.dirname(
    os.path.dirname(os.path.abspath(sys.modules["snapshots"].__file__ or ""))
)


class WriterProcessLost(Exception):
    """The child died or broke the protocol mid-save; the file must be written again."""


class _Encoder(pickle.Pickler):
    """Pickles a staged tree with each tensor as its place in shared memory."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.blocks: set[int] = set()
        self.nbytes = 0
        self.unshareable = False

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if obj.numel() == 0 and obj.device.type == "cpu" and obj.layout == torch.strided:
            return ("empty", str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        place = shared_staging.locate(obj)
        if place is None or obj.requires_grad:
            self.unshareable = True
            return ("none",)
        self.blocks.add(place.block)
        self.nbytes += obj.numel() * obj.element_size()
        dtype = str(obj.dtype).removeprefix("torch.")
        return ("shm", place.block, place.offset, dtype, tuple(obj.shape))


def encode(value: Any) -> tuple[bytes, set[int], int] | None:
    """(tree pickle, blocks it uses, tensor bytes), or None: some tensor is not on shared
    staging memory (then the thread writes it)."""
    buf = io.BytesIO()
    encoder = _Encoder(buf)
    encoder.dump(value)
    if encoder.unshareable:
        return None
    return buf.getvalue(), encoder.blocks, encoder.nbytes


class WriterProcess:
    """One child process and the socket to it. Requests are serialised by a lock."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # The child imports this package from where this process found it.
        root = _PACKAGES_ROOT
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "snapshots.write.writer_child", str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._ready = False
        self._mapped: set[int] = set()
        self._requests = 0
        self.lost: str | None = None
        emit("snapshot.writer_process_started", pid=self.pid)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def ready(self) -> bool:
        """Whether the child has started (non-blocking); False once it was lost."""
        with self._lock:
            return self._check_ready()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the child has started (or was lost), at most ``timeout_s``."""
        if self.ready() or self.lost is not None:
            return self.lost is None
        select.select([self._sock], [], [], timeout_s)
        return self.ready()

    def _check_ready(self) -> bool:
        if self.lost is not None:
            return False
        if not self._ready and select.select([self._sock], [], [], 0)[0]:
            try:
                message = self._read()
            except (OSError, WriterProcessLost) as exc:
                self._lose(f"did not start: {exc}")
                return False
            self._ready = message.get("ready") is True
            if not self._ready:
                self._lose(f"did not start: {message.get('error', message)}")
        return self._ready

    def write(
        self,
        request: tuple[bytes, set[int], int],
        sink: Any,
        algorithm: str,
        check_cancelled: Callable[[], None],
    ) -> tuple[int, str]:
        """Serialise the encoded tree into ``sink``'s file from its start: (size, digest).
        Raises WriterProcessLost (the file is then in an unknown state), OSError as the
        write itself failed in the child, or what ``check_cancelled`` raises (the child is
        stopped first)."""
        tree, blocks, _ = request
        with self._lock:
            if self.lost is not None:
                raise WriterProcessLost(self.lost)
            live = shared_staging.live_blocks()
            new = sorted(blocks - self._mapped)
            found = [shared_staging.descriptor(b) for b in new]
            descriptors = [d for d in found if d is not None]
            if len(descriptors) != len(new):
                raise WriterProcessLost("a staging block was freed while the save was queued")
            self._requests += 1
            header = {
                "id": self._requests,
                "algorithm": algorithm,
                "direct": bool(sink.direct),
                "map": [[b, d[1]] for b, d in zip(new, descriptors, strict=True)],
                "drop": sorted(self._mapped - live),
            }
            fds = [sink.fileno(), *(d[0] for d in descriptors)]
            try:
                self._send(header, tree, fds)
                self._mapped = (self._mapped & live) | set(new)
                answer = self._wait(check_cancelled)
            except WriterProcessLost as exc:
                self._lose(str(exc))
                raise
            except OSError as exc:  # the socket: the child is gone
                self._lose(f"{type(exc).__name__}: {exc}")
                raise WriterProcessLost(self.lost) from exc
            except BaseException:
                self._lose("stopped: the save was cancelled while it wrote")
                raise
            if answer.get("id") != self._requests:
                self._lose(f"answered request {answer.get('id')} to {self._requests}")
                raise WriterProcessLost(self.lost)
        if "error" in answer:
            if answer.get("errno") is not None:
                raise OSError(answer["errno"], answer["error"])
            with self._lock:
                self._lose(f"failed: {answer['error']}")
            raise WriterProcessLost(self.lost)
        sink.adopt(int(answer["written"]))
        return int(answer["size"]), str(answer["digest"])

    def _send(self, header: dict[str, Any], tree: bytes, fds: list[int]) -> None:
        head = json.dumps(header).encode()
        socket.send_fds(self._sock, [HEADER.pack(len(head)) + head], fds)
        self._sock.sendall(HEADER.pack(len(tree)) + tree)

    def _wait(self, check_cancelled: Callable[[], None]) -> dict[str, Any]:
        while not select.select([self._sock], [], [], POLL_S)[0]:
            check_cancelled()
            if self._proc.poll() is not None:
                raise WriterProcessLost(f"exited with code {self._proc.returncode}")
        return self._read()

    def _read(self) -> dict[str, Any]:
        (length,) = HEADER.unpack(_recv_or_lost(self._sock, HEADER.size))
        answer = json.loads(_recv_or_lost(self._sock, length))
        if not isinstance(answer, dict):
            raise WriterProcessLost(f"answered {answer!r}")
        return answer

    def _lose(self, why: str) -> None:
        """Stop the child for good; emits the event once."""
        if self.lost is not None:
            return
        self.lost = why
        with contextlib.suppress(OSError):
            self._proc.kill()
        self._proc.wait()  # it writes through our file: nothing may reach it after this
        self._sock.close()
        emit("snapshot.writer_process_lost", pid=self.pid, error=why, fallback="thread")

    def close(self) -> None:
        """Stop the child (tests; a process that exits needs nothing: the child sees EOF)."""
        with self._lock:
            if self.lost is None:
                self.lost = "closed"
                self._sock.close()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()


def recv_exactly(
    sock: socket.socket, n: int, still_wanted: Callable[[], bool] = lambda: True
) -> bytes | None:
    """``n`` bytes from ``sock``, or None at end of file. On a socket with a timeout, each
    timeout asks ``still_wanted`` whether to keep waiting (None when not)."""
    parts, got = [], 0
    while got < n:
        try:
            part = sock.recv(n - got)
        except TimeoutError:
            if not still_wanted():
                return None
            continue
        if not part:
            return None
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _recv_or_lost(sock: socket.socket, n: int) -> bytes:
    data = recv_exactly(sock, n)
    if data is None:
        raise WriterProcessLost("closed its socket")
    return data


_state_lock = threading.Lock()
_process: WriterProcess | None = None
_owner_pid = 0
_refused = False  # the process could not be started: saves stay on the thread


def current() -> WriterProcess | None:
    """This process's writer process, if one was started (not one inherited by fork)."""
    return _process if _owner_pid == os.getpid() else None


def stop() -> None:
    """Stop this process's writer process, if any; the next large save starts another."""
    global _process, _refused
    with _state_lock:
        process, _process, _refused = current(), None, False
    if process is not None:
        process.close()


def _process_for_save() -> WriterProcess | None:
    """The ready writer process; starts it (and returns None) at the first call. A process
    that could not be started (no memory, no such interpreter) is not tried again."""
    global _process, _owner_pid, _refused
    with _state_lock:
        if _owner_pid != os.getpid():  # never one inherited from a forked parent
            _process, _owner_pid, _refused = None, os.getpid(), False
        if _refused:
            return None
        if _process is None:
            if not sys.executable:
                return None
            try:
                _process = WriterProcess()
            except OSError as exc:
                _refused = True
                error = f"did not start: {type(exc).__name__}: {exc}"
                emit("snapshot.writer_process_lost", pid=None, error=error, fallback="thread")
            return None
    return _process if _process.ready() else None


def try_write(
    value: Any, sink: Any, algorithm: str, check_cancelled: Callable[[], None]
) -> tuple[int, str] | None:
    """Write ``value`` (a staged tree) into ``sink`` through the writer process: (size,
    digest); None where this save stays on the thread (see the module docstring)."""
    if not getattr(sink, "writer_process", False) or not shared_staging.available():
        return None
    if faults.injected():  # a crash test's kill point must be reached in this process
        return None
    try:
        request = encode(value)
    except Exception:  # a value the structure's pickle refuses: the thread's torch.save decides
        return None
    if request is None or request[2] < PROCESS_MIN_BYTES or len(request[1]) >= MAX_FDS:
        return None
    process = _process_for_save()
    if process is None:
        return None
    return process.write(request, sink, algorithm, check_cancelled)
