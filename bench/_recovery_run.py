"""One recovery scenario under one launcher and worker, and its phases (bench/recovery.py's
engine: processes and files here, the arithmetic in _recovery_parse.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import psutil
from _recovery_parse import (
    OUR_DETECT,
    RDZV_JOINING,
    SUPERVISOR_STEPS,
    TORCHRUN_DETECT,
    TORCHRUN_RDZV,
    WORKER_STEPS,
    Result,
    Row,
    breakdown,
    first_after,
    parse_audit,
    parse_events,
    parse_glog,
    parse_markers,
    restore_after,
    result,
)

ROOT = Path(__file__).resolve().parents[1]
WORKERS = {  # --worker: the script each launcher runs
    "plain": str(ROOT / "tests" / "e2e" / "workers" / "proto_worker.py"),
    "session": str(ROOT / "bench" / "_session_worker.py"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _text(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""


def rows(path: Path) -> list[Row]:
    """(step, rank, world_size, time) of the audit file."""
    return parse_audit(_text(path))


def launcher_cmd(kind: str, worker: str, port: int, node: str, tmp: Path) -> list[str]:
    job = [WORKERS[worker], "--steps", "100000", "--step-time", "0.1",
           "--audit", str(tmp / "audit"), "--markers", str(tmp / "markers")]  # fmt: skip
    if kind == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench", "--max-restarts", "3",
            "--log-dir", str(tmp / "torchrun-logs"),  # not a folder left in /tmp each run
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
    # as users run it: no OMP_NUM_THREADS (the launchers set what they set themselves)
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOGLEVEL="INFO")
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


def workers_of(proc: subprocess.Popen, script: str, events: Path) -> list[int]:
    """The node's worker processes: by command line (fresh processes), else the pids of our
    newest ``workers.started`` (a worker forked from the warm pool has the pool's command line)."""
    name = Path(script).name
    with contextlib.suppress(psutil.Error):
        kids = psutil.Process(proc.pid).children(recursive=True)
        found = [c.pid for c in kids if any(name in a for a in c.cmdline())]
        if found:
            return found
        started = [e for e in parse_events(_text(events)) if e["event"] == "workers.started"]
        alive = {c.pid for c in kids}
        return [pid for pid in started[-1]["pids"] if pid in alive] if started else []
    return []


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Each launcher's whole process tree SIGKILLed, the launcher reaped."""
    for proc in procs:
        kill(tree(proc))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def wait_until(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def start(kind: str, worker: str, port: int, node: str, tmp: Path) -> subprocess.Popen:
    log = open(tmp / f"{node}.out", "wb")  # noqa: SIM115  (closed with the process)
    cmd = launcher_cmd(kind, worker, port, node, tmp)
    return subprocess.Popen(cmd, env=env_for(kind, tmp, node), stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip


def phases(kind: str, tmp: Path, fault: float, ws_after: int, survivor: str = "a") -> Result:
    """The phase boundaries on ``survivor`` (the node that keeps running) after ``fault``."""
    restore, detail = None, ""
    if kind == "torchrun":
        stamps = parse_glog(_text(tmp / f"{survivor}.out"), datetime.now().year)
        detected = first_after(stamps, lambda s: bool(TORCHRUN_DETECT.search(s)), fault)
        formed = first_after(stamps, lambda s: bool(TORCHRUN_RDZV.search(s)), detected)
    else:
        events = parse_events(_text(tmp / f"{survivor}.jsonl"))
        stamps = [(e["event"], e["_t"]) for e in events]
        detected = first_after(stamps, lambda e: e in OUR_DETECT, fault)
        formed = first_after(stamps, lambda e: e == "rendezvous.completed", detected)
        # both nodes' workers log their restore (node b's too, after a worker crash)
        other = "b" if survivor == "a" else "a"
        restore = restore_after(events + parse_events(_text(tmp / f"{other}.jsonl")), fault)
        detail = supervisor_detail(tmp, fault)
    marks = parse_markers(_text(tmp / "markers"))
    audit = rows(tmp / "audit")
    out = result(
        fault=fault,
        detected=detected,
        formed=formed,
        marks=marks,
        audit=audit,
        restore=restore,
        ws_after=ws_after,
    )
    first = [("first_step", r[3]) for r in audit if r[2] == ws_after and r[3] > fault]
    steps = breakdown(marks + first[:1], WORKER_STEPS, formed)
    return dataclasses.replace(out, detail=f"{detail}\n    worker: {steps}".strip())


def supervisor_detail(tmp: Path, fault: float) -> str:
    """Each node's supervisor, fault -> its new workers started (``breakdown``)."""
    lines = []
    for node in ("a", "b"):
        events = parse_events(_text(tmp / f"{node}.jsonl"))
        if not events:
            continue
        names = [("rendezvous.joining" if RDZV_JOINING in e["event"] else e["event"], e["_t"])
                 for e in events]  # fmt: skip
        lines.append(f"{node}: " + breakdown([("fault", fault), *names], SUPERVISOR_STEPS, fault))
    return "\n    ".join(lines)


def run_scenario(
    scenario: str, kind: str, timeout: float, *, worker: str = "plain", keep_logs: str = ""
) -> Result:
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-{worker}-") as tmpdir:
        tmp = Path(tmpdir)
        port = free_port()
        procs = [start(kind, worker, port, "a", tmp)]
        try:
            if not wait_until(lambda: listening(port), 60):
                raise RuntimeError(f"{kind}: the first agent never hosted the store")
            audit = tmp / "audit"
            if scenario == "node_join":
                if not wait_until(lambda: any(r[0] >= 8 for r in rows(audit)), 180):
                    raise RuntimeError(f"{kind}: never trained alone")
                fault = time.time()
                procs.append(start(kind, worker, port, "b", tmp))
            else:
                procs.append(start(kind, worker, port, "b", tmp))

                # between two snapshots (every 5 steps): 3 steps past one, so work is lost
                def ready() -> bool:
                    return any(r[2] == 2 and r[0] >= 13 and r[0] % 5 == 3 for r in rows(audit))

                if not wait_until(ready, 180):
                    raise RuntimeError(f"{kind}: never trained at world size 2")
                if scenario == "store_host_preempted":  # node a hosts the store
                    fault = time.time()
                    procs[0].send_signal(signal.SIGTERM)
                else:
                    victims = {
                        "node_loss": lambda: tree(procs[1]),
                        "store_host_lost": lambda: tree(procs[0]),
                        "worker_crash": lambda: workers_of(
                            procs[1], WORKERS[worker], tmp / "b.jsonl"
                        ),
                    }[scenario]()
                    if not victims:
                        raise RuntimeError(f"{kind}: no worker of node b found to kill")
                    fault = time.time()
                    kill(victims)
            ws_after = 2 if scenario in ("worker_crash", "node_join") else 1
            done = lambda: any(r[2] == ws_after and r[3] > fault + 0.3 for r in rows(audit))  # noqa: E731
            if not wait_until(done, timeout):
                return Result()
            time.sleep(0.5)  # let the first step's rows and markers land
            survivor = "b" if scenario.startswith("store_host") else "a"
            return phases(kind, tmp, fault, ws_after, survivor)
        finally:
            stop_all(procs)
            if keep_logs:
                name = f"{scenario}-{kind}-{worker}-{int(time.time())}"
                shutil.copytree(tmp, Path(keep_logs) / name)
