"""structlog set-up: one JSON object per line for machines, colours for a TTY.

torch's own stdlib logging goes through the same pipeline, so an ops team parses one
format. Every line carries ``timestamp`` (ISO-8601 UTC), ``level``, ``event`` and the
static fields bound here (``job_id``, ``node``, ``pid``; workers add ``rank``...). ``event``
is always a catalogued name (``events.CATALOGUE``): a foreign stdlib record (torch's, a
library's, a script's ``logging.info``) is ``log.record`` with its text in ``message`` and
its ``logger`` and ``level``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, Literal

import structlog

from elastic_trainer.contract.events import FOREIGN_RECORD
from elastic_trainer.contract.protocol import ENV_NODE

LogFormat = Literal["json", "console", "auto"]

# Samples for dashboards (every 30 s per rank), not lines a person reads: they stay in the
# JSON log file and JSON mode, off the console.
CONSOLE_HIDDEN = frozenset({"worker.resources"})
CLEAR_LINE = "\r\x1b[K"  # to the line's start, then erase it: where a progress bar was

# user:password@ in a URL, and query parameters that carry secrets (presigned URLs, SAS).
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s:]+(:[^/@\s]*)?@")
_SECRET_QUERY = re.compile(
    r"(?i)(?P<key>[?&](?:[a-z0-9_.-]*(?:secret|token|signature|password|key|credential|sig)"
    r"[a-z0-9_.-]*))=[^&\s]*"
)


def redact(text: str) -> str:
    """Remove credentials from any URL inside ``text``."""
    text = _URL_USERINFO.sub(r"\g<scheme>***@", text)
    return _SECRET_QUERY.sub(r"\g<key>=***", text)


def _redact_processor(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Any:
    for key, value in event_dict.items():
        if isinstance(value, str) and ("://" in value or "=" in value):
            event_dict[key] = redact(value)
    return event_dict


def static_fields() -> dict[str, Any]:
    """The fields every event of this process carries (for lines logged outside structlog)."""
    return dict(_STATIC_FIELDS)


def resolve_format(fmt: LogFormat, stream: Any = None) -> Literal["json", "console"]:
    """``auto`` is console on a TTY, JSON otherwise (stderr by default)."""
    return _resolve_format(fmt, sys.stderr if stream is None else stream)


def _resolve_format(fmt: LogFormat, stream: Any) -> Literal["json", "console"]:
    if fmt != "auto":
        return fmt
    return "console" if hasattr(stream, "isatty") and stream.isatty() else "json"


# Storage clients log routine steps at INFO ("Found credentials in environment variables."):
# not events ops should page through. Their warnings and errors still come through.
_CHATTY_LIBRARIES = ("botocore", "aiobotocore", "boto3", "s3fs", "gcsfs", "fsspec", "urllib3")
_OURS = ("elastic_trainer", "snapshots")  # stdlib loggers whose event is already a name

# Fields every event of this process carries (job_id, node, pid; workers add rank...). Kept
# process-wide rather than in contextvars: a context is per thread, and events logged from
# background threads (the snapshot writer) must carry them too.
_STATIC_FIELDS: dict[str, Any] = {}


def _add_static_fields(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Any:
    for key, value in _STATIC_FIELDS.items():
        event_dict.setdefault(key, value)
    return event_dict


def _shared_processors() -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        _add_static_fields,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _redact_processor,
        structlog.processors.format_exc_info,
    ]


def configure_logging(
    *,
    fmt: LogFormat = "auto",
    log_file: str | None = None,
    static_fields: Mapping[str, Any] | None = None,
    level: int = logging.INFO,
    group_access: bool = False,
) -> None:
    """Configure structlog and the stdlib root logger for this process. Idempotent.
    ``group_access``: a ``log_file`` this call creates is 0640, not 0600 (``open_log_file``)."""
    stream = sys.stderr
    console = _resolve_format(fmt, stream) == "console"
    shared = _shared_processors()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_elastic_train", False):
            root.removeHandler(handler)
    renderer: Any = _console_renderer() if console else structlog.processors.JSONRenderer()
    handlers: list[logging.Handler] = [
        _make_handler(TerminalHandler(stream, console=console), shared, renderer)
    ]
    if log_file:
        file_handler = _LogFileHandler(log_file, group_access=group_access)
        handlers.append(_make_handler(file_handler, shared, structlog.processors.JSONRenderer()))
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    for name in _CHATTY_LIBRARIES:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:  # a level someone chose is theirs
            logger.setLevel(logging.WARNING)
    route_torch_logs()
    _STATIC_FIELDS.clear()
    bind_static_fields(static_fields or {})


# The event log holds the run's events (job id, hosts, paths, errors): its user's alone, or
# readable by the group with --snapshot-group-access, as the run folder it usually sits in.
# (snapshots.storage.modes says the same for snapshots; not imported here: this module loads
# before anything heavy.)
def _log_modes(group_access: bool) -> tuple[int, int]:
    """(folder mode, file mode) of what ``open_log_file`` creates."""
    return (0o750, 0o640) if group_access else (0o700, 0o600)


def open_log_file(path: str, *, group_access: bool = False) -> int:
    """A descriptor appending to ``path``. When absent, the file and its missing folders are
    created of exactly ``_log_modes`` (the umask narrows and widens nothing, and is left as
    it is: it is the training script's too); an existing file or folder keeps its mode."""
    folder_mode, file_mode = _log_modes(group_access)
    _make_folders(os.path.dirname(os.path.abspath(path)), folder_mode)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, file_mode)
    except FileExistsError:
        return os.open(path, flags)
    _chmod(fd, file_mode)
    return fd


def _make_folders(folder: str, mode: int) -> None:
    if os.path.isdir(folder):
        return
    _make_folders(os.path.dirname(folder), mode)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, mode)
        _chmod(folder, mode)


def _chmod(target: int | str, mode: int) -> None:
    """chmod (a descriptor or a path) where the file system has modes; where it has none
    (vfat, some FUSE or SMB mounts), the mode given at creation less the umask stands."""
    try:
        os.chmod(target, mode)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL):
            raise


class _LogFileHandler(logging.FileHandler):
    """A FileHandler whose file, when it creates it, is made by ``open_log_file``."""

    def __init__(self, path: str, *, group_access: bool) -> None:
        self._group_access = group_access  # read by _open, which __init__ calls
        super().__init__(path, mode="a", encoding="utf-8")

    def _open(self) -> Any:  # FileHandler's one hook for opening its stream
        fd = open_log_file(self.baseFilename, group_access=self._group_access)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


def route_torch_logs() -> None:
    """Send torch's stdlib log records through our pipeline.

    ``import torch`` detaches its registered loggers ("torch", "torch.distributed", ...):
    ``propagate = False`` plus a plain-text stderr handler of its own. Without this, a worker's
    torch warnings would bypass the JSON lines ops teams parse. Levels are kept (torch's
    default WARNING stays). A no-op until torch is imported.
    """
    if "torch" not in sys.modules:
        return
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not (name == "torch" or name.startswith("torch.")):
            continue
        if isinstance(logger, logging.Logger) and not logger.propagate:
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.propagate = True


def _make_handler(handler: logging.Handler, shared: list[Any], renderer: Any) -> logging.Handler:
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, _name_foreign_record],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                _drop_logger_name,
                renderer,
            ],
        )
    )
    handler._elastic_train = True  # type: ignore[attr-defined]
    return handler


def _name_foreign_record(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Any:
    # A foreign record's text ("failed (exitcode: 1) local_rank: 0 ...") is no event name:
    # dashboards switch on ``event``, so it gets one name and its text moves to ``message``.
    if not _is_ours(event_dict.get("logger")):
        event_dict["message"] = event_dict.get("event")
        event_dict["event"] = FOREIGN_RECORD
    return event_dict


def _is_ours(logger: Any) -> bool:
    name = str(logger or "")
    return any(name == ours or name.startswith(f"{ours}.") for ours in _OURS)


def _drop_logger_name(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Any:
    # Keep the stdlib logger's name only for foreign (torch) records, where it says who spoke.
    if _is_ours(event_dict.get("logger")):
        event_dict.pop("logger", None)
    return event_dict


def bind_static_fields(fields: Mapping[str, Any]) -> None:
    """Bind fields every later event of this process carries, from any thread (job_id, node,
    pid, rank...)."""
    defaults = {
        "node": os.environ.get(ENV_NODE) or socket.gethostname(),
        "pid": os.getpid(),
    }
    _STATIC_FIELDS.update({**defaults, **_STATIC_FIELDS, **fields})


class Terminal:
    """A terminal's unfinished line: a progress bar (``\\r`` redraws, never a newline) shown
    there by a relayed worker (``unfinished``) or by this process's own tqdm bar (``hide``).

    A whole line written to the terminal goes above it, as ``tqdm.write`` does: the
    unfinished line is erased, the line written, the unfinished line drawn again. Without
    this the line landed on the end of the bar (``...?step/s]2026-11-24T21:00:13 ...``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # one writer at a time, relays and log handlers alike
        self.unfinished = ""  # what the line shows now, drawn by ``owner``
        self.owner: object = None
        self.hide: Callable[[], contextlib.AbstractContextManager[Any]] | None = None

    @contextlib.contextmanager
    def line_above(self, write: Callable[[str], None], *, writer: object = None) -> Iterator[None]:
        """Around writing whole lines: erase the unfinished line first, draw it after.
        ``writer``: whose lines these are (an unfinished line of its own is its business)."""
        with self.lock, self.hide() if self.hide else contextlib.nullcontext():
            covered = self.unfinished if self.owner is not writer else ""
            if covered:
                write(CLEAR_LINE)
            yield
            if covered and self.owner is not writer:  # unless the writer's own line replaced it
                write(covered)


STDERR = Terminal()  # this process's stderr: its log handler and the relays writing there


class TerminalHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The stderr handler: on a terminal each event a line of its own, above a progress bar
    (JSON lines too: a worker logging JSON has its lines relayed, and rendered, by the
    supervisor). ``console``: the events in ``CONSOLE_HIDDEN`` are left to the log file."""

    def __init__(self, stream: Any, *, console: bool, terminal: Terminal = STDERR) -> None:
        super().__init__(stream)
        self.terminal = terminal
        if console:
            self.addFilter(_off_console)

    def emit(self, record: logging.LogRecord) -> None:
        if not _is_terminal(self.stream):
            super().emit(record)
            return
        with self.terminal.line_above(self._write):
            super().emit(record)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _off_console(record: logging.LogRecord) -> bool:
    msg = record.msg
    return not (isinstance(msg, dict) and msg.get("event") in CONSOLE_HIDDEN)


def _epoch_line(event_dict: MutableMapping[str, Any]) -> str:
    parts = [f"val_accuracy {100 * float(event_dict['val_accuracy']):.1f} %"]
    if event_dict.get("val_loss") is not None:
        parts.append(f"val_loss {float(event_dict['val_loss']):.4g}")
    return f"epoch {event_dict.get('epoch')}: " + ", ".join(parts)


# Events whose console line is a sentence; their fields stay in the JSON log.
_SENTENCES: dict[str, Callable[[MutableMapping[str, Any]], str]] = {
    "train.evaluated": _epoch_line,
}


def _console_sentence(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Any:
    sentence = _SENTENCES.get(str(event_dict.get("event")))
    if sentence is None:
        return event_dict
    try:
        text = sentence(event_dict)
    except (KeyError, TypeError, ValueError):  # fields missing: show the event as it is
        return event_dict
    kept = ("timestamp", "level")
    return {"event": text, **{k: event_dict[k] for k in kept if k in event_dict}}


def _console_renderer() -> Callable[[Any, str, MutableMapping[str, Any]], str]:
    renderer = structlog.dev.ConsoleRenderer(colors=True)

    def render(logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
        return str(renderer(logger, name, _console_sentence(logger, name, event_dict)))

    return render


_RENDER_CONSOLE = _console_renderer()


def render_console_line(line: str) -> str | None:
    """A JSON event line (a worker logging JSON) as console mode shows it, without its
    newline; ``""`` for an event kept off the console; ``None`` for any other line."""
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    if event["event"] in CONSOLE_HIDDEN:
        return ""
    return _RENDER_CONSOLE(None, str(event.get("level", "info")), event)
