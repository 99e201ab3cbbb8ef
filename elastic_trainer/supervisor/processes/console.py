"""Worker output relayed with its rank: on a console each line prefixed, ``[rank0]:loss 0.31``;
in JSON mode each stderr line an ``output.stderr`` event with ``rank`` and ``local_rank``.

What torchrun does (torch/distributed/run.py, elastic/multiprocessing/api.py, tail_log.py):
by default a worker's stdout/stderr *are* the agent's, unchanged, so eight ranks interleave
with nothing to tell them apart (only a traceback after ``init_process_group`` carries
``[rankN]: ``, from torch's excepthook). ``--tee`` writes the streams to ``--log-dir`` files
and tails them to the console as ``[${role_name}${local_rank}]:line`` (or
``--log-line-prefix-template``); ``--local-ranks-filter`` keeps the other ranks off the
console. Here ``--tee``/``--redirects``/``--local-ranks-filter`` are torch's own code,
unchanged; what we add is the prefix on the streams torchrun leaves bare: in console mode
they go through a relay that writes ``[rank${rank}]:`` (global rank; the template when one
is given) before every line.

Design: a relay thread per worker stream in the supervisor, not a tail of files (no disk,
no polling delay) nor a wrapper in the worker (a killed worker would lose its last lines,
and ``--no-python`` has no wrapper). The worker writes into a pipe, or into a pseudo-terminal
when the supervisor's own stream is a terminal: then the worker still sees a TTY, so the
built-in job's progress bar (``\\r`` updates) and colours work as before. The relay prefixes
every ``\\r`` segment as well as every line, so the bar redraws in place as
``\\r[rank0]: 40%|████ ...``; the pty's width is the terminal's minus the prefix.

The relay forwards whole lines (and whole ``\\r`` segments): an unfinished one is held until
its end arrives, or for at most ``HOLD_S`` (the bar never ends its line; a prompt may not
either). An unbuffered worker (``PYTHONUNBUFFERED=1``, common in containers) writes
``print``'s text and its newline in two calls; relayed as read, another rank's line or the
supervisor's own log line landed between them, glued to the worker's text. Whole lines of up
to 4 KiB are one write each, which a pipe keeps unmixed.

JSON mode: every stderr line must be one JSON object. A worker's stderr left on the console
goes through a relay that passes its JSON lines (its own events, which carry their rank)
unchanged and makes any other line (a traceback, a library's warning) an ``output.stderr``
event with the worker's ``rank``, ``local_rank`` and ``restart_count``, as the worker's own
events have, into the supervisor's stderr pipe (``stderr_router``), which passes JSON on.
Before, those lines reached the pipe bare and the router could not tell whose they were.
Worker stdout is not JSON in either mode, and stays the supervisor's stdout in JSON mode.

Every relayed stderr also keeps its last lines (``tail.StderrTail``): a worker that dies of an
exception printed its traceback there, and the agent puts the exception's line in
``worker.failed``'s ``error_summary`` (``RelayedLogsSpecs.stderr_tail``). A rank that
``--local-ranks-filter`` keeps off the console is relayed to nowhere for that tail; with
``--redirects``/``--tee`` the tail is read back from torch's ``stderr.log``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import select
import socket
import struct
import sys
import termios
import threading
import time
from collections.abc import Mapping
from string import Template
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import LogsDest

from elastic_trainer.logging import STDERR, Terminal, render_console_line
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.processes import stderr_router
from elastic_trainer.supervisor.processes.tail import StderrTail, read_file_tail

DEFAULT_TEMPLATE = "[rank${rank}]:"
_CONSOLE = torch_compat.LOGS_DEST_CONSOLE  # "the agent's own stream, unchanged" in LogsDest
_SEGMENTS = re.compile(rb"([\r\n])")
_READ_SIZE = 65536
_LONGEST_HELD = 1 << 20  # a line longer than this is passed on in parts (a JSON event is not)
HOLD_S = 0.25  # the longest an unfinished line waits for its end before it is shown
NOWHERE = -1  # a relay's destination when only its tail is wanted


def render_prefix(
    template: str | None, *, role: str, rank: Any, local_rank: Any, hostname: str
) -> str:
    """torchrun's macros: ``${role_name}``, ``${rank}``, ``${local_rank}``, ``${hostname}``."""
    return Template(template or DEFAULT_TEMPLATE).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank, hostname=hostname
    )


class Prefixer:
    """Pure: the prefix at the start of every line and of every ``\\r`` segment.

    Empty lines stay empty; a segment that already starts with the prefix (torch's excepthook
    writes ``[rank0]: Traceback ...``) is not prefixed twice. ``human``: a JSON event line (a
    worker that logs JSON, as under ``--log-format auto``) is shown as console mode shows the
    supervisor's own events, and one kept off the console (``worker.resources``) not at all."""

    def __init__(self, prefix: bytes, *, human: bool = False) -> None:
        self.prefix = prefix
        self.human = human
        self._at_start = True

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        dropped = False  # the segment before was an event kept off the console: so is its end
        for piece in _SEGMENTS.split(data):
            if piece in (b"\r", b"\n"):
                if not (dropped and piece == b"\n"):
                    out += piece
                self._at_start, dropped = True, False
            elif piece:
                piece = self._human(piece) if self._at_start else piece
                if piece is None:
                    dropped = True
                    continue
                if self._at_start and not piece.startswith(self.prefix):
                    out += self.prefix
                out += piece
                self._at_start = False
        return bytes(out)

    def _human(self, segment: bytes) -> bytes | None:
        if not (self.human and segment.startswith(b"{")):
            return segment
        rendered = render_console_line(segment.decode("utf-8", "replace"))
        if rendered is None:
            return segment
        return rendered.encode() if rendered else None


class JsonLines:
    """Pure: whole lines -> one JSON object per line (``stderr_router.render``) with
    ``fields``. A JSON object line passes unchanged; a line released unfinished (its end came
    late) is an event of its own."""

    def __init__(self, fields: Mapping[str, Any], muted: threading.Event | None = None) -> None:
        self._fields = dict(fields)
        self._muted = muted  # set: the lines are debug events (see RelayedLogsSpecs.mute)

    def feed(self, data: bytes) -> bytes:
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()  # the end of the last line, not an empty line after it
        fields = self._fields
        if self._muted is not None and self._muted.is_set():
            fields = {**fields, "level": "debug"}
        return b"".join(stderr_router.render(line, fields) for line in lines)


class LineGate:
    """Pure: what of the data read so far ends a line (``\\n``) or a segment (``\\r``).

    ``feed`` returns everything up to the last end and holds the rest; ``release`` hands the
    rest over (its wait is over, or the stream ended). A held rest of ``limit`` bytes or more
    is not held: a line that long is not kept whole anyway."""

    def __init__(self, limit: int = _LONGEST_HELD) -> None:
        self._held = b""
        self._limit = limit

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def feed(self, data: bytes) -> bytes:
        data = self._held + data
        end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        whole, self._held = data[:end], data[end:]
        if len(self._held) >= self._limit:
            return whole + self.release()
        return whole

    def release(self) -> bytes:
        held, self._held = self._held, b""
        return held


class Relay:
    """One worker stream -> one console stream (fd 1 or 2), whole lines, each transformed
    (prefixed, or made JSON), on its own thread.

    ``path`` is what torch opens as the worker's stream. The relay holds a writer end itself
    until ``close``, so the stream does not end before torch has opened it; after ``close``
    it ends once the worker (and torch's handle) are gone too."""

    def __init__(
        self,
        dest_fd: int,
        transform: Prefixer | JsonLines,
        *,
        hold_s: float = HOLD_S,
        tail: StderrTail | None = None,
        muted: threading.Event | None = None,
    ) -> None:
        """``transform``: what becomes of the lines on their way (a prefix, or JSON);
        ``tail``: keeps the last lines as the worker wrote them (``lines``); ``muted``: while
        set, console lines go to the tail only."""
        self._dest = dest_fd
        self._muted = muted
        self._transform = transform
        self._terminal = _terminal(dest_fd) if isinstance(transform, Prefixer) else None
        self._unfinished = ""  # this stream's line on the terminal not ended yet (its bar)
        self._gate = LineGate()
        self._hold_s = hold_s
        self._tail = tail
        # held while a read is turned into output, so ``lines`` can tell all is handled
        self._handled = threading.Condition()
        self._ended = False
        if isinstance(transform, Prefixer) and _use_pty(dest_fd):
            self._read, self._keep = os.openpty()
            _fit_terminal(self._keep, dest_fd, len(transform.prefix))
            self.path = os.ttyname(self._keep)
        else:
            self._read, self._keep = os.pipe()
            self.path = f"/dev/fd/{self._keep}"  # torch opens it by path, in this process
        self._thread = threading.Thread(target=self._pump, name="console-relay", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            ready = _readable(self._read, self._hold_s if self._gate.holding else None)
            with self._handled:
                if not ready:
                    self._forward(self._gate.release())  # its end is late: show it as it is
                    continue
                data = self._read_some()
                if data:
                    self._forward(self._gate.feed(data))
                self._handled.notify_all()
            if not data:
                break
        with self._handled:
            self._forward(self._gate.release())  # a last line without its end
            self._ended = True
            os.close(self._read)
            self._handled.notify_all()

    def _read_some(self) -> bytes:
        try:
            return os.read(self._read, _READ_SIZE)
        except OSError as exc:  # a pty reads EIO once no writer is left: its end
            if exc.errno != errno.EIO:
                raise
            return b""

    def lines(self, timeout_s: float = 1.0) -> list[str]:
        """The tail's lines, once what was written to the stream so far is read (a worker
        that just died: its last lines are in the pipe), or ``timeout_s`` is over."""
        if self._tail is None:
            return []
        deadline = time.monotonic() + timeout_s
        if not self._handled.acquire(timeout=timeout_s):
            return []  # the relay is stuck writing to a console that does not drain
        try:
            self._handled.wait_for(
                lambda: self._ended or _unread(self._read) == 0,
                max(0.0, deadline - time.monotonic()),
            )
            return self._tail.lines()
        finally:
            self._handled.release()

    def _forward(self, raw: bytes) -> None:
        if self._tail is not None:
            self._tail.feed(raw)
        muted = self._muted is not None and self._muted.is_set()
        if muted and isinstance(self._transform, Prefixer):
            return  # a console line: kept in the tail (and the worker's log), not shown
        data = self._transform.feed(raw)
        if self._dest < 0 or not data:
            return  # the console is gone: keep draining, so the worker never blocks on it
        try:
            self._write(data)
        except OSError:
            self._dest = -1

    def _write(self, data: bytes) -> None:
        terminal = self._terminal
        if terminal is None:
            with _lock(self._dest):
                _write_all(self._dest, data)
            return
        # The terminal is shared with other ranks' relays and the supervisor's own log lines:
        # another's unfinished line (rank 0's bar) is erased before this one's whole lines
        # and drawn again after them, so no line lands on the end of a bar.
        text = data.decode("utf-8", "replace")
        tail = text.rpartition("\n")[2] if "\n" in text else self._unfinished + text
        with terminal.line_above(lambda s: _write_all(self._dest, s.encode()), writer=self):
            _write_all(self._dest, data)
            self._unfinished = tail
            if tail:
                terminal.owner, terminal.unfinished = self, _visible(tail)
            elif terminal.owner is self:
                terminal.owner, terminal.unfinished = None, ""

    def close(self, deadline: float) -> None:
        """Stop holding the stream open; wait (up to ``deadline``) for what is left."""
        if self._keep >= 0:
            os.close(self._keep)
            self._keep = -1
        self._thread.join(max(0.0, deadline - time.monotonic()))


_LOCKS = {fd: threading.Lock() for fd in (1, 2)}  # one writer at a time per console stream
_TERMINALS: dict[int, Terminal] = {}


def _lock(fd: int) -> contextlib.AbstractContextManager[Any]:
    return _LOCKS.get(fd) or contextlib.nullcontext()


def _terminal(fd: int) -> Terminal | None:
    """The terminal behind ``fd`` as shared with this process's log lines (stderr's, and
    stdout's when it is the same terminal), or ``None``: a pipe or file gets bytes as
    written, no erasing."""
    if fd < 0 or not os.isatty(fd):
        return None
    if fd == 2 or _same_terminal(fd, 2):
        return STDERR
    return _TERMINALS.setdefault(fd, Terminal())


def _same_terminal(fd: int, other: int) -> bool:
    try:
        return os.isatty(other) and os.fstat(fd).st_rdev == os.fstat(other).st_rdev
    except OSError:
        return False


def _visible(tail: str) -> str:
    """What a terminal shows of an unfinished line: its last ``\\r`` segment with text."""
    segments = [seg for seg in tail.split("\r") if seg]
    return "\r" + segments[-1] if segments else ""


def _readable(fd: int, timeout_s: float | None) -> bool:
    """Data (or the stream's end) is there; poll, as an fd number may be past select's 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else timeout_s * 1000))


def _unread(fd: int) -> int:
    """Bytes in a pipe or pty not read yet."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4), sys.byteorder)


def _use_pty(dest_fd: int) -> bool:
    # A session leader without a controlling terminal would acquire the pty as one when
    # torch opens it (no O_NOCTTY there), and a hangup with it: such a process gets a pipe.
    return os.isatty(dest_fd) and (os.getsid(0) != os.getpid() or _has_controlling_terminal())


def _has_controlling_terminal() -> bool:
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY))
    except OSError:
        return False
    return True


def _fit_terminal(pty_fd: int, terminal_fd: int, prefix_len: int) -> None:
    """No ``\\n`` -> ``\\r\\n`` rewriting, and the terminal's size less the prefix."""
    attrs = termios.tcgetattr(pty_fd)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(pty_fd, termios.TCSANOW, attrs)
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(terminal_fd, termios.TIOCGWINSZ, b"\0" * 8)
        rows, cols, xpix, ypix = struct.unpack("HHHH", size)
        if cols > prefix_len:  # a terminal of unknown size (0) stays so: tqdm then guesses
            size = struct.pack("HHHH", rows, cols - prefix_len, xpix, ypix)
        fcntl.ioctl(pty_fd, termios.TIOCSWINSZ, size)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            time.sleep(0.01)  # a non-blocking terminal that is full: let it drain


class RelayedLogsSpecs(DefaultLogsSpecs):
    """torch's ``DefaultLogsSpecs`` (files, ``--tee``, ``--local-ranks-filter`` unchanged),
    with every stream it would leave on the console sent through a ``Relay``: prefixed, or
    (``json_fields`` given: JSON mode) stderr as JSON events with those fields and the rank."""

    def __init__(
        self,
        *,
        template: str | None,
        consoles: Mapping[str, int] | None = None,
        json_fields: Mapping[str, Any] | None = None,
        **torch_options: Any,
    ) -> None:
        super().__init__(**torch_options)
        self._template = template
        self._json_fields = None if json_fields is None else dict(json_fields)
        self._consoles = dict(consoles or {"stdout": 1, "stderr": 2})
        self._relays: list[Relay] = []
        self._stderr_tails: dict[int, Relay | str] = {}  # a relay, or torch's stderr.log
        self._hostname = socket.gethostname()
        # set while this attempt's workers end because a peer left on purpose (``mute``)
        self._muted = threading.Event()

    def mute(self) -> None:
        """A peer said it is leaving (preempted): what our workers write to stderr from now
        on (gloo's "Connection reset by peer" and its traceback) is its leaving, not a
        failure, and stays off the console: kept in the tail (``stderr_tail``), in JSON mode
        as debug events. The next attempt's workers are heard again."""
        self._muted.set()

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self.close(timeout_s=0)  # a new attempt: the previous workers are gone (no waiting:
        # their relays drain on their own; a restart must not wait on a straggler)
        self._muted = threading.Event()  # the old relays keep the old one: still muted
        dest = super().reify(envs)
        self._stderr_tails.clear()
        for local_rank, env in envs.items():
            if self._json_fields is None and dest.stdouts.get(local_rank) == _CONSOLE:
                dest.stdouts[local_rank] = self._relay(
                    self._consoles["stdout"], local_rank, env, human=False
                ).path
            self._reify_stderr(dest, local_rank, env)
        return dest

    def _reify_stderr(self, dest: LogsDest, local_rank: int, env: Mapping[str, str]) -> None:
        path = dest.stderrs.get(local_rank)
        if path == _CONSOLE or (path == os.devnull and self._filtered_out(local_rank)):
            fd = self._consoles["stderr"] if path == _CONSOLE else NOWHERE
            relay = self._relay(fd, local_rank, env, tail=StderrTail(), muted=self._muted)
            self._stderr_tails[local_rank] = relay
            dest.stderrs[local_rank] = relay.path
        elif path and path != os.devnull:
            self._stderr_tails[local_rank] = path

    def _filtered_out(self, local_rank: int) -> bool:
        ranks = self._local_ranks_filter
        return bool(ranks) and local_rank not in ranks

    def _relay(
        self,
        fd: int,
        local_rank: int,
        env: Mapping[str, str],
        tail: StderrTail | None = None,
        human: bool = True,
        muted: threading.Event | None = None,
    ) -> Relay:
        """``human``: JSON events on the stream are shown as console lines (stderr, where a
        worker logs; stdout is the script's own); ``muted``: see ``mute`` (stderr only)."""
        transform = self._transform(local_rank, env, human, muted)
        relay = Relay(fd, transform, tail=tail, muted=muted)
        self._relays.append(relay)
        return relay

    def stderr_tail(self, local_rank: int, timeout_s: float = 1.0) -> list[str]:
        """The last lines the worker at ``local_rank`` of the current attempt wrote to its
        stderr (empty if they went nowhere we can read)."""
        source = self._stderr_tails.get(local_rank)
        if isinstance(source, Relay):
            return source.lines(timeout_s)
        return read_file_tail(source) if source is not None else []

    def _transform(
        self,
        local_rank: int,
        env: Mapping[str, str],
        human: bool = True,
        muted: threading.Event | None = None,
    ) -> Prefixer | JsonLines:
        rank = env.get("RANK", local_rank)
        if self._json_fields is not None:
            restarts = env.get("TORCHELASTIC_RESTART_COUNT")
            return JsonLines({
                **self._json_fields,
                "rank": int(rank),
                "local_rank": local_rank,
                "restart_count": int(restarts) if restarts is not None else None,
            }, muted)  # fmt: skip
        prefix = render_prefix(
            self._template,
            role=env.get("ROLE_NAME", ""),
            rank=rank,
            local_rank=local_rank,
            hostname=self._hostname,
        )
        return Prefixer(prefix.encode(), human=human)

    def close(self, timeout_s: float = 2.0) -> None:
        """Relay what the workers wrote last; a stream still held open after ``timeout_s``
        (an orphaned grandchild) is left to its daemon thread."""
        deadline = time.monotonic() + timeout_s
        for relay in self._relays:
            relay.close(deadline)
        self._relays.clear()
