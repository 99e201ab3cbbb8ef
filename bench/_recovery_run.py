"""One recovery scenario under one launcher, and its phases (bench/recovery.py's engine)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "e2e" / "workers" / "proto_worker.py")
PHASES = ("detect", "rendezvous", "worker_start", "restore", "first_step")

# what each launcher says when it notices the fault, and when the new round has closed
OUR_DETECT = {"worker.failed", "peer.lost", "peer.silent", "group.restarting"}
TORCHRUN_DETECT = re.compile(r"Worker group (FAILED|UNHEALTHY)|Detected \d+ new nodes")
TORCHRUN_RDZV = re.compile(r"Rendezvous complete for workers")
GLOG = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+)")


@dataclass(frozen=True, kw_only=True)
class Result:
    total: float | None = None  # fault -> first completed step of the new group
    pause: float | None = None  # the running group's last step before -> first step after
    steps_lost: int | None = None
    phases: dict[str, float | None] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [f"{k}={v:.2f}" for k, v in self.phases.items() if v is not None]
        return f"total={self.total} pause={self.pause} lost={self.steps_lost} " + " ".join(parts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def rows(path: Path) -> list[tuple[int, int, int, float]]:
    """(step, rank, world_size, time) of the audit file."""
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            p = line.split()
            if len(p) == 4:
                out.append((int(p[0]), int(p[1]), int(p[2]), float(p[3])))
    return out


def markers(path: Path) -> list[tuple[str, float]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            p = line.split()
            if len(p) == 4:
                out.append((p[0], float(p[1])))
    return out


def our_events(path: Path) -> list[tuple[str, float]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                ev = json.loads(line)
                out.append((ev["event"], datetime.fromisoformat(ev["timestamp"]).timestamp()))
    return out


def torchrun_lines(path: Path) -> list[tuple[str, float]]:
    """torchrun's glog-style lines (I1122 19:40:00.123456 pid file:line] text), local time."""
    out = []
    year = datetime.now().year
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            m = GLOG.match(line)
            if m:
                stamp = f"{year}-{m[1]}-{m[2]} {m[3]}"
                out.append((line, datetime.fromisoformat(stamp).timestamp()))
    return out


def launcher_cmd(kind: str, port: int, node: str, tmp: Path) -> list[str]:
    job = [WORKER, "--steps", "100000", "--step-time", "0.1", "--audit", str(tmp / "audit"),
           "--markers", str(tmp / "markers")]  # fmt: skip
    if kind == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench", "--max-restarts", "3",
            *job,
        ]  # fmt: skip
    return [
        sys.executable, "-m", "elastic_trainer", "--min-nodes", "1", "--max-nodes", "2",
        "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--job-id", "bench",
        "--snapshot-dir", str(tmp / "snap"), "--snapshot-every", "5",
        "--max-restarts", "3", "--log-format", "json", "--log-file", str(tmp / f"{node}.jsonl"),
        "--node", node, *job,
    ]  # fmt: skip


def env_for(kind: str, tmp: Path, node: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LOGLEVEL="INFO")
    (tmp / "snap").mkdir(exist_ok=True)
    if kind == "torchrun":  # the worker's protocol, set by hand for torchrun
        control = tmp / f"control-{node}"
        control.mkdir(exist_ok=True)
        env.update(ELASTIC_TRAIN_CONTROL_DIR=str(control),
                   ELASTIC_TRAIN_SNAPSHOT_DIR=str(tmp / "snap"),
                   ELASTIC_TRAIN_SNAPSHOT_EVERY="5")  # fmt: skip
    return env


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).send_signal(signal.SIGKILL)


def tree(proc: subprocess.Popen) -> list[int]:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    return []


def workers_of(proc: subprocess.Popen, events: Path) -> list[int]:
    """The node's worker processes: by command line (fresh processes), else the pids of our
    newest ``workers.started`` (a worker forked from the warm pool has the pool's command line)."""
    with contextlib.suppress(psutil.Error):
        kids = psutil.Process(proc.pid).children(recursive=True)
        found = [c.pid for c in kids if any("proto_worker" in a for a in c.cmdline())]
        if found or not events.exists():
            return found
        started = [
            e for e in map(json.loads, events.read_text().splitlines())
            if e.get("event") == "workers.started"
        ]  # fmt: skip
        alive = {c.pid for c in kids}
        return [pid for pid in started[-1]["pids"] if pid in alive] if started else []
    return []


def wait_until(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def start(kind: str, port: int, node: str, tmp: Path) -> subprocess.Popen:
    log = open(tmp / f"{node}.out", "wb")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(launcher_cmd(kind, port, node, tmp), env=env_for(kind, tmp, node),
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def first_after(stamps: list[tuple[str, float]], match: Callable[[str], bool], t: float | None):
    if t is None:
        return None
    return min((ts for name, ts in stamps if ts >= t and match(name)), default=None)


def phases(kind: str, tmp: Path, fault: float, ws_after: int) -> Result:
    """The phase boundaries on node 'a' (the one that keeps running) after ``fault``."""
    if kind == "torchrun":
        stamps = torchrun_lines(tmp / "a.out")
        detected = first_after(stamps, lambda s: bool(TORCHRUN_DETECT.search(s)), fault)
        formed = first_after(stamps, lambda s: bool(TORCHRUN_RDZV.search(s)), detected)
    else:
        stamps = our_events(tmp / "a.jsonl")
        detected = first_after(stamps, lambda e: e in OUR_DETECT, fault)
        formed = first_after(stamps, lambda e: e == "rendezvous.completed", detected)
    marks = markers(tmp / "markers")
    ready = _last_of_first(marks, "group_ready", formed)
    restored = _last_of_first(marks, "restored", ready)
    audit = rows(tmp / "audit")
    after = [r for r in audit if r[2] == ws_after and restored is not None and r[3] > restored]
    if not after:
        return Result()
    first = min(after, key=lambda r: r[3])
    before = [r for r in audit if r[3] < restored]  # the old group (it may train on a while)
    last_before = max((r[0] for r in before), default=0)
    last_t = max((r[3] for r in before), default=None)
    bounds = [fault, detected, formed, ready, restored, first[3]]
    spans = {
        name: (b - a if a is not None and b is not None else None)
        for name, a, b in zip(PHASES, bounds[:-1], bounds[1:], strict=True)
    }
    return Result(
        total=round(first[3] - fault, 3),
        pause=None if last_t is None else round(first[3] - last_t, 3),
        steps_lost=max(0, last_before - (first[0] - 1)),
        phases=spans,
    )


def _last_of_first(marks: list[tuple[str, float]], name: str, after: float | None):
    """The latest rank's first ``name`` marker after ``after`` (the group waits for all)."""
    if after is None:
        return None
    hits = [t for n, t in marks if n == name and t >= after]
    if not hits:
        return None
    first = min(hits)
    return max(t for t in hits if t - first < 30)  # one per rank of this start


def run_scenario(scenario: str, kind: str, timeout: float, *, keep_logs: str = "") -> Result:
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-") as tmpdir:
        tmp = Path(tmpdir)
        port = free_port()
        procs = [start(kind, port, "a", tmp)]
        try:
            if not wait_until(lambda: listening(port), 60):
                raise RuntimeError(f"{kind}: the first agent never hosted the store")
            audit = tmp / "audit"
            if scenario == "node_join":
                if not wait_until(lambda: any(r[0] >= 8 for r in rows(audit)), 180):
                    raise RuntimeError(f"{kind}: never trained alone")
                fault = time.time()
                procs.append(start(kind, port, "b", tmp))
            else:
                procs.append(start(kind, port, "b", tmp))

                # between two snapshots (every 5 steps): 3 steps past one, so work is lost
                def ready() -> bool:
                    return any(r[2] == 2 and r[0] >= 13 and r[0] % 5 == 3 for r in rows(audit))

                if not wait_until(ready, 180):
                    raise RuntimeError(f"{kind}: never trained at world size 2")
                victims = (
                    tree(procs[1])
                    if scenario == "node_loss"
                    else workers_of(procs[1], tmp / "b.jsonl")
                )
                if not victims:
                    raise RuntimeError(f"{kind}: no worker of node b found to kill")
                fault = time.time()
                kill(victims)
            ws_after = 1 if scenario == "node_loss" else 2
            done = lambda: any(r[2] == ws_after and r[3] > fault + 0.3 for r in rows(audit))  # noqa: E731
            if not wait_until(done, timeout):
                return Result()
            time.sleep(0.5)  # let the first step's rows and markers land
            return phases(kind, tmp, fault, ws_after)
        finally:
            for proc in procs:
                kill(tree(proc))
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            if keep_logs:
                shutil.copytree(tmp, Path(keep_logs) / f"{scenario}-{kind}-{int(time.time())}")
