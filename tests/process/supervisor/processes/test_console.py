"""Console mode: every worker line (and every ``\\r`` segment of a progress bar) carries its
rank as torchrun's ``[rank0]:``; torch's --tee/--local-ranks-filter keep their meaning."""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import json
import os
import select
import socket
import struct
import termios
import threading
import time

import pytest
from torch.distributed.elastic.multiprocessing import Std

from elastic_trainer.supervisor.processes.console import (
    JsonLines,
    LineGate,
    Prefixer,
    Relay,
    RelayedLogsSpecs,
    render_prefix,
)
from tests.process.test_logging import screen


def _feed(prefix: bytes, *chunks: bytes) -> bytes:
    prefixer = Prefixer(prefix)
    return b"".join(prefixer.feed(c) for c in chunks)


def test_every_line_gets_the_prefix_even_split_across_reads() -> None:
    assert _feed(b"[rank1]:", b"epoch 1\nlo", b"ss 0.3\n\nend") == (
        b"[rank1]:epoch 1\n[rank1]:loss 0.3\n\n[rank1]:end"
    )


def test_carriage_return_segments_of_a_progress_bar_redraw_behind_the_prefix() -> None:
    bar = b"\r 10%|#    |\r 20%|##   |\r\n"
    assert _feed(b"[rank0]:", bar) == b"\r[rank0]: 10%|#    |\r[rank0]: 20%|##   |\r\n"


def test_torchs_excepthook_prefix_is_not_doubled() -> None:
    hook = b"[rank0]: Traceback (most recent call last):\n[rank0]:   File x\n"
    assert _feed(b"[rank0]:", hook) == hook


def test_prefix_template_has_torchruns_macros() -> None:
    fields = {"role": "trainer", "rank": 5, "local_rank": 1, "hostname": "r12"}
    assert render_prefix(None, **fields) == "[rank5]:"
    assert render_prefix("${hostname}:${rank}: ", **fields) == "r12:5: "
    assert render_prefix("[${role_name}${local_rank}]:", **fields) == "[trainer1]:"


def _envs(*ranks: int) -> dict[int, dict[str, str]]:
    return {i: {"RANK": str(r), "ROLE_NAME": "trainer", "TORCHELASTIC_RUN_ID": "t"}
            for i, r in enumerate(ranks)}  # fmt: skip


def _pipes():
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    return (out_r, err_r), {"stdout": out_w, "stderr": err_w}


def _drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""


def _read_until(fd: int, expected: bytes, timeout_s: float = 10.0) -> bytes:
    """A terminal delivers asynchronously: read until ``expected``'s length or the bound."""
    got = b""
    while len(got) < len(expected) and select.select([fd], [], [], timeout_s)[0]:
        got += os.read(fd, 65536)
    return got


def _write_all_async(fd: int, data: bytes) -> None:
    """Write and close on a thread: a pipe holds less than ``data`` until it is read."""

    def write() -> None:
        with open(fd, "wb") as stream:
            stream.write(data)

    threading.Thread(target=write, daemon=True).start()


def _read_to_end(fd: int) -> bytes:
    with open(fd, "rb") as stream:
        return stream.read()


def _write_as_worker(path: str, text: str) -> None:
    with open(path, "w") as stream:  # what torch's SubprocessHandler does with the path
        stream.write(text)


def test_streams_left_on_the_console_are_relayed_with_the_global_rank(tmp_path) -> None:
    (out_r, err_r), consoles = _pipes()
    specs = RelayedLogsSpecs(template=None, consoles=consoles, log_dir=str(tmp_path))
    dest = specs.reify(_envs(2, 3))
    _write_as_worker(dest.stdouts[0], "hello\nworld\n")
    _write_as_worker(dest.stderrs[1], "oops\n")
    specs.close()
    assert _drain(out_r) == b"[rank2]:hello\n[rank2]:world\n"
    assert _drain(err_r) == b"[rank3]:oops\n"


def test_local_ranks_filter_and_tee_stay_torchs(tmp_path) -> None:
    (out_r, _), consoles = _pipes()
    specs = RelayedLogsSpecs(
        template=None, consoles=consoles, log_dir=str(tmp_path),
        tee={1: Std.OUT}, local_ranks_filter={1, 2},
    )  # fmt: skip
    dest = specs.reify(_envs(0, 1, 2))
    assert dest.stdouts[0] == os.devnull  # filtered out: torch drops it
    assert dest.stdouts[1].endswith("stdout.log") and dest.tee_stdouts[1] == dest.stdouts[1]
    _write_as_worker(dest.stdouts[2], "kept\n")
    specs.close()
    assert _drain(out_r) == b"[rank2]:kept\n"


def test_a_terminal_console_gives_the_worker_a_terminal_of_its_width(tmp_path) -> None:
    term_master, term = os.openpty()
    attrs = termios.tcgetattr(term)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(term, termios.TCSANOW, attrs)
    fcntl.ioctl(term, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    specs = RelayedLogsSpecs(
        template=None, consoles={"stdout": term, "stderr": term}, log_dir=str(tmp_path)
    )
    dest = specs.reify(_envs(0))
    with open(dest.stderrs[0], "w") as stream:
        assert stream.isatty()  # the built-in job shows its progress bar
        size = fcntl.ioctl(stream.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        assert struct.unpack("HHHH", size)[1] == 100 - len("[rank0]:")
        stream.write("\r 10%|#\r 20%|##\n")
    specs.close()
    expected = b"\r[rank0]: 10%|#\r[rank0]: 20%|##\n"
    assert _read_until(term_master, expected) == expected


@pytest.mark.timeout(30)
def test_close_does_not_wait_for_a_stream_nobody_opened(tmp_path) -> None:
    _, consoles = _pipes()
    specs = RelayedLogsSpecs(template=None, consoles=consoles, log_dir=str(tmp_path))
    specs.reify(_envs(0))
    specs.close(timeout_s=10)  # torch never opened it (a failed start): no hang


def test_line_gate_holds_an_unfinished_line_until_its_end() -> None:
    gate = LineGate(limit=16)
    assert gate.feed(b"hello err 0") == b"" and gate.holding
    assert gate.feed(b"\nnext") == b"hello err 0\n"
    assert gate.feed(b"\r 40%|##") == b"next\r"  # a redraw ends the segment before it
    assert gate.release() == b" 40%|##" and not gate.holding
    assert gate.feed(b"x" * 20) == b"x" * 20  # too long to hold: passed on


def _messages(console: socket.socket) -> list[bytes]:
    got = []
    while select.select([console], [], [], 10.0)[0] and (message := console.recv(65536)):
        got.append(message)
    return got


def _unread(relay: Relay) -> int:
    """Bytes written to the relay's stream that it has not read yet."""
    size = fcntl.ioctl(relay._read, termios.FIONREAD, b"\0" * 4)
    return struct.unpack("i", size)[0]


@pytest.mark.timeout(30)
def test_an_unbuffered_print_reaches_the_console_as_one_write() -> None:
    """Regression: ``print`` in an unbuffered worker writes its text and its newline in two
    calls; relayed as read, the supervisor's own log line landed between them (CI failure of
    test_console_mode_prefixes_every_worker_line_with_its_rank). Each datagram read back is
    one write of the relay's."""
    console, relayed = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    relay = Relay(relayed.fileno(), Prefixer(b"[rank0]:"), hold_s=60.0)
    worker = os.open(relay.path, os.O_WRONLY)
    os.write(worker, b"hello err 0")
    while _unread(relay):  # the relay has read the text alone before the newline is written
        select.select([], [], [], 0.001)
    os.write(worker, b"\n")
    os.write(worker, b"tail without an end")
    os.close(worker)
    relay.close(time.monotonic() + 10)
    relayed.shutdown(socket.SHUT_WR)
    assert _messages(console) == [b"[rank0]:hello err 0\n", b"[rank0]:tail without an end"]


@pytest.mark.timeout(30)
def test_an_unfinished_line_is_shown_once_its_wait_is_over() -> None:
    console, relayed = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    relay = Relay(relayed.fileno(), Prefixer(b"[rank0]:"), hold_s=0.01)
    worker = os.open(relay.path, os.O_WRONLY)
    os.write(worker, b"\r 40%|####")  # a progress bar never ends its line
    assert select.select([console], [], [], 10.0)[0]
    assert console.recv(65536) + console.recv(65536) == b"\r[rank0]: 40%|####"
    os.close(worker)
    relay.close(time.monotonic() + 10)


def test_json_lines_keep_json_and_make_any_other_line_an_event_with_the_rank() -> None:
    fields = {"job_id": "j", "rank": 3, "local_rank": 1}
    out = JsonLines(fields).feed(b'{"event": "train.progress", "rank": 3}\nTraceback (most\n\n')
    first, second, third = (json.loads(line) for line in out.splitlines())
    assert first == {"event": "train.progress", "rank": 3}
    assert second["event"] == "output.stderr" and second["text"] == "Traceback (most"
    assert (second["rank"], second["local_rank"], second["job_id"]) == (3, 1, "j")
    assert third["text"] == ""  # an empty line is a line


def test_in_json_mode_worker_stderr_carries_its_rank_and_stdout_stays_the_console(
    tmp_path,
) -> None:
    (out_r, err_r), consoles = _pipes()
    specs = RelayedLogsSpecs(
        template=None, consoles=consoles, log_dir=str(tmp_path), json_fields={"node": "n1"}
    )
    envs = _envs(4, 5)
    envs[1]["TORCHELASTIC_RESTART_COUNT"] = "2"
    dest = specs.reify(envs)
    assert dest.stdouts[0] == dest.stdouts[1] == ""  # torch's "the agent's own stream"
    _write_as_worker(dest.stderrs[1], 'oops\n{"event": "snapshot.saved"}\n')
    specs.close()
    oops, saved = (json.loads(line) for line in _drain(err_r).splitlines())
    assert oops["event"] == "output.stderr" and oops["text"] == "oops"
    assert (oops["node"], oops["rank"], oops["local_rank"], oops["restart_count"]) == (
        "n1",
        5,
        1,
        2,
    )
    assert saved == {"event": "snapshot.saved"}
    assert _drain(out_r) == b""


@pytest.mark.timeout(30)
def test_a_long_json_line_read_in_parts_stays_one_event() -> None:
    console, relayed = os.pipe()
    relay = Relay(relayed, JsonLines({"rank": 0}), hold_s=60.0)
    worker = os.open(relay.path, os.O_WRONLY)
    event = json.dumps({"event": "train.progress", "note": "x" * 200_000}).encode() + b"\n"
    shown = cf.ThreadPoolExecutor(1).submit(_read_to_end, console)
    _write_all_async(worker, event)  # more than one read of the relay's (64 KiB)
    relay.close(time.monotonic() + 10)
    os.close(relayed)
    assert shown.result(timeout=10) == event  # not parts of it as output.stderr text


def test_a_workers_json_events_show_as_console_lines_and_resources_not_at_all() -> None:
    """Regression: under ``--log-format auto`` a worker's events showed as raw JSON next to
    the supervisor's formatted lines, and ``worker.resources`` every 30 s."""
    evaluated = {"event": "train.evaluated", "epoch": 2, "val_accuracy": 0.87, "val_loss": 0.41,
                 "level": "info", "timestamp": "2026-11-24T21:00:13Z"}  # fmt: skip
    resources = {"event": "worker.resources", "rank": 0, "rss_bytes": 1}
    lines = [json.dumps(evaluated), json.dumps(resources), "Traceback (most recent call last):"]
    out = Prefixer(b"[rank0]:", human=True).feed(("\n".join(lines) + "\n").encode())
    shown = screen(out.decode())
    assert shown[0].startswith("[rank0]:2026-11-24T21:00:13Z [info")
    assert shown[0].endswith("epoch 2: val_accuracy 87.0 %, val_loss 0.41")
    assert shown[1:] == ["[rank0]:Traceback (most recent call last):", ""]


def test_a_line_relayed_to_a_terminal_goes_above_another_ranks_unfinished_bar() -> None:
    master, terminal = os.openpty()
    attrs = termios.tcgetattr(terminal)
    attrs[1] &= ~termios.OPOST  # the bytes as written, no \n -> \r\n
    termios.tcsetattr(terminal, termios.TCSANOW, attrs)
    bar = b"\r 50%|#####     | 6/12 [00:00<?, ?step/s]"
    try:
        for prefix, data in ((b"[rank0]:", bar), (b"[rank1]:", b"hello\n")):
            relay = Relay(terminal, Prefixer(prefix))
            with open(relay.path, "wb") as stream:
                stream.write(data)
            relay.close(time.monotonic() + 10)
        shown = screen(_terminal_bytes(master, b"hello", bar.count(b"|"), time.monotonic() + 10))
    finally:
        os.close(master)
        os.close(terminal)
    assert shown == ["[rank1]:hello", "[rank0]:" + bar.decode().lstrip("\r")]


def _terminal_bytes(fd: int, text: bytes, bars: int, deadline: float) -> str:
    """What the terminal got, read until ``text`` and the redrawn bar (its ``|`` count
    twice over) are in, or the deadline: one read may return before the last write."""
    import select

    got = b""
    while time.monotonic() < deadline and not (text in got and got.count(b"|") >= 2 * bars):
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            got += os.read(fd, 65536)
    return got.decode()


def test_after_a_peer_said_goodbye_its_consequences_stay_off_the_console(tmp_path) -> None:
    """A preempted peer's leaving kills our plain workers in gloo: their traceback is kept for
    the error line (the tail) but not shown, and the next attempt is heard again."""
    (_, err_r), consoles = _pipes()
    specs = RelayedLogsSpecs(template=None, consoles=consoles, log_dir=str(tmp_path))
    dest = specs.reify(_envs(0))
    _write_as_worker(dest.stderrs[0], "before\n")
    specs.stderr_tail(0)  # read and relayed
    specs.mute()
    _write_as_worker(dest.stderrs[0], "Traceback\nRuntimeError: Connection reset by peer\n")
    assert specs.stderr_tail(0)[-1] == "RuntimeError: Connection reset by peer"
    again = specs.reify(_envs(0))
    _write_as_worker(again.stderrs[0], "next attempt\n")
    specs.close()
    assert _drain(err_r) == b"[rank0]:before\n[rank0]:next attempt\n"


def test_muted_json_lines_are_debug_events() -> None:
    muted = threading.Event()
    lines = JsonLines({"rank": 0}, muted)
    assert json.loads(lines.feed(b"loud\n"))["level"] == "warning"
    muted.set()
    assert json.loads(lines.feed(b"Connection reset by peer\n"))["level"] == "debug"
