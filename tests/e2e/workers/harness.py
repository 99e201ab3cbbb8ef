"""Test harness for supervisor e2e tests: start agents, read their events, kill trees."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
PROTO = str(HERE / "proto_worker.py")
PLAIN_DDP = str(HERE / "plain_ddp.py")
EXIT_RACE = str(HERE / "sup_exit_race.py")
ORPHAN = str(HERE / "orphan_worker.py")
REQUIRED = ("timestamp", "level", "event", "job_id", "node", "pid")
# Short timeouts keep the e2e set fast; the patient first round still covers agents that
# start a second or two apart on this loaded machine.
FAST_RDZV = (
    "join_timeout=90,first_last_call_timeout=5,last_call_timeout=2,"
    "keep_alive_interval=1,keep_alive_max_attempt=3,close_timeout=5"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    log_file: Path
    stderr_file: Path
    tree: list[psutil.Process] = field(default_factory=list)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        try:
            lines = self.log_file.read_text().splitlines()
        except OSError:
            return []
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if name is None or event.get("event") == name:
                    out.append(event)
        return out

    def wait_event(self, name: str, timeout: float, where: Callable[[dict], bool] = lambda e: True):
        return wait_for(
            lambda: next((e for e in self.events(name) if where(e)), None),
            timeout,
            f"{self.name}: {name}",
        )

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def remember_tree(self) -> None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            self.tree = [root, *root.children(recursive=True)]

    def signal_tree(self, sig: signal.Signals) -> None:
        """Every process of the node at once (SIGSTOP: a node that goes silent, no reset)."""
        self.remember_tree()
        for proc in self.tree:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)

    def kill_tree(self) -> None:
        """A whole node vanishing: the agent and every worker, at once."""
        self.remember_tree()
        for proc in self.tree:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def start_agent(
    tmp: Path,
    name: str,
    argv: list[str],
    env: dict[str, str],
    *,
    port: int,
    job_id: str = "e2e",
    rdzv_conf: str = FAST_RDZV,
    new_session: bool = False,
    endpoint: bool = True,
) -> Agent:
    """``endpoint=False``: no --rdzv-endpoint (the command line brings its own, e.g. torchrun's
    --master-addr/--master-port); ``port`` is then unused."""
    rdzv = ["--rdzv-endpoint", f"127.0.0.1:{port}"] if endpoint else []
    return spawn_agent(tmp, name, [*rdzv, "--rdzv-conf", rdzv_conf, *argv], env,
                       job_id=job_id, new_session=new_session)  # fmt: skip


def spawn_agent(
    tmp: Path,
    name: str,
    argv: list[str],
    env: dict[str, str],
    *,
    job_id: str = "e2e",
    new_session: bool = False,
    wrap: list[str] | None = None,
) -> Agent:
    """An agent with JSON events in ``tmp/NAME.jsonl``; ``argv`` is everything after the
    logging flags. ``wrap`` prefixes the command (``ip netns exec NS``: exec, same pid)."""
    log_file = tmp / f"{name}.jsonl"
    stderr_file = tmp / f"{name}.stderr"
    cmd = [
        *(wrap or []),
        sys.executable,
        "-m",
        "elastic_trainer",
        "--log-format",
        "json",
        "--log-file",
        str(log_file),
        "--node",
        name,
        "--job-id",
        job_id,
        *argv,
    ]
    with open(stderr_file, "wb") as err:
        proc = subprocess.Popen(
            cmd, env=env, stdout=err, stderr=subprocess.STDOUT, start_new_session=new_session
        )
    return Agent(name=name, proc=proc, log_file=log_file, stderr_file=stderr_file)


def descendants_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def cleanup(agents: list[Agent]) -> None:
    """Teardown: kill every tree we started, whatever state the test left it in."""
    for agent in agents:
        agent.remember_tree()
        for proc in agent.tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(Exception):
            agent.proc.wait(timeout=10)


def kill_once_argv(tmp: Path, *options: str) -> list[str]:
    """Two proto workers, 20 steps, a snapshot every 5, rank 1 SIGKILLed once at step 7;
    the audit in ``tmp/audit``. ``options`` go before the script."""
    return [
        "--nproc-per-node",
        "2",
        *options,
        "--snapshot-dir",
        str(tmp / "snap"),
        "--snapshot-every",
        "5",
        PROTO,
        "--steps",
        "20",
        "--die-at",
        "7",
        "--die-rank",
        "1",
        "--marker",
        str(tmp / "died"),
        "--audit",
        str(tmp / "audit"),
    ]


def read_audit(path: Path) -> list[tuple[int, int, int]]:
    """(step, rank, world_size) rows written by proto_worker (a 4th column is the time)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3:
            rows.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return rows


def start_store(port: int, env: dict[str, str]) -> subprocess.Popen:
    """A standalone c10d TCPStore host (what `elastic-train store` runs), for is_host=false."""
    code = (
        "import time, torch.distributed as d;"
        f"s=d.TCPStore('127.0.0.1', {port}, is_master=True, multi_tenant=True,"
        " wait_for_workers=False);"
        "time.sleep(3600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    wait_for(lambda: listening(port), 30, "the store to listen")
    return proc


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def env_with(base: dict[str, str], **extra: str) -> dict[str, str]:
    env = dict(base)
    env.update(extra)
    root = str(HERE.parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def processes_with_env(name: str, value: str) -> list[psutil.Process]:
    """Live (not zombie) processes whose environment has ``name=value``: a test's own tree,
    found even after it was re-parented, and including what it spawned at the last moment."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def sigcaught(pid: int, sig: int) -> bool:
    """Has process ``pid`` installed a handler for ``sig``? (SigCgt in /proc/PID/status)"""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (sig - 1)))


@contextlib.contextmanager
def not_a_store(kind: str):
    """A loopback port held by something that is not a c10d store: ``"http"`` (an HTTP
    server) or ``"silent"`` (accepts connections, never says a word). Yields (port, the
    connections accepted so far)."""
    import http.server
    import threading

    accepted: list[socket.socket] = []
    if kind == "http":
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), http.server.BaseHTTPRequestHandler
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield server.server_address[1], accepted
        finally:
            server.shutdown()
            server.server_close()
        return
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


def audit_records(audit: Path) -> list:
    """The sample audit log's records (none before the first step)."""
    from elastic_trainer.worker.audit import read_audit_log

    return read_audit_log(str(audit)) if audit.exists() else []


def steps_at(audit: Path, world_size: int) -> set[int]:
    """The steps some rank completed at ``world_size``."""
    return {r.step for r in audit_records(audit) if r.world_size == world_size}


def wait_new(agent: Agent, name: str, since: int, timeout: float, where=lambda e: True) -> dict:
    """The first ``name`` event after the first ``since`` ones that matches ``where``: events
    of an earlier round (a first round formed at a smaller size) must not satisfy a later
    wait."""
    return wait_for(
        lambda: next((e for e in agent.events(name)[since:] if where(e)), None),
        timeout,
        f"{agent.name}: a new {name}",
    )
