"""One job run of bench/goodput.py: two nodes, a fixed number of steps, failures on a schedule
(processes and files here, the arithmetic in _goodput_calc.py; the process helpers are
bench/recovery.py's)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from _goodput_calc import Row, Run, due_at, failure_kind, plain_env
from _recovery_parse import parse_audit, parse_markers
from _recovery_run import ROOT, WORKERS, free_port, kill, listening, tree, workers_of

POLL_S = 0.2  # the runner shares the CPU with the job it measures: poll gently
RECOVER_TIMEOUT_S = 180.0  # a recovery slower than this is a failed run, not a slow one
MAX_RELAUNCHES = 5


@dataclass(frozen=True, kw_only=True)
class Arm:
    name: str
    launcher: str  # torchrun or elastic-train
    worker: str  # a key of WORKERS
    flags: tuple[str, ...] = ()  # extra elastic-train flags


def arms(save_every: int) -> dict[str, Arm]:
    """bench/goodput.py's arms by name; ``save_every``: the torchrun script's own cadence."""
    return {
        "torchrun": Arm(name=f"torchrun, save every {save_every}", launcher="torchrun",
                        worker="plain"),
        "elastic-train": Arm(name="elastic-train (defaults)", launcher="elastic-train",
                             worker="session"),
        "elastic-train-mem1": Arm(name="elastic-train --memory-snapshot-every 1",
                                  launcher="elastic-train", worker="session",
                                  flags=("--memory-snapshot-every", "1")),
    }  # fmt: skip


class AuditTail:
    """The audit file's rows, read incrementally (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows = path, 0, list[Row]()

    def poll(self) -> list[Row]:
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self.offset += end
            self.rows += parse_audit(chunk[:end].decode(errors="replace"))
        return self.rows


def wait_until(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_S)
    return bool(predicate())


class Job:
    """The two nodes of one run, and what is done to them."""

    def __init__(self, arm: Arm, tmp: Path, steps: int, step_time: float, save_every: int):
        self.arm, self.tmp, self.steps = arm, tmp, steps
        self.step_time, self.save_every = step_time, save_every
        self.port = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.relaunches: list[float] = []  # when the job was launched again after dying
        self.node_lost = False  # node b is down on purpose, its replacement not yet started
        self.audit = AuditTail(tmp / "audit")

    def cmd(self, node: str) -> list[str]:
        tmp = self.tmp
        job = [WORKERS[self.arm.worker], "--steps", str(self.steps),
               "--step-time", str(self.step_time),
               "--audit", str(tmp / "audit"), "--markers", str(tmp / "markers")]  # fmt: skip
        # failures tolerated: more than the schedule can inject (membership changes are free)
        restarts = ["--max-restarts", "1000"]
        if self.arm.launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                    "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "goodput",
                    "--log-dir", str(tmp / "torchrun-logs"),  # not a folder left in /tmp
                    *restarts, *job]  # fmt: skip
        return [sys.executable, "-m", "elastic_trainer", "--min-nodes", "1", "--max-nodes", "2",
                "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--job-id", "goodput", "--snapshot-dir", str(tmp / "snap"), *restarts,
                *self.arm.flags, "--log-format", "json",
                "--log-file", str(tmp / f"{node}.jsonl"), "--node", node, *job]  # fmt: skip

    def env(self, node: str) -> dict[str, str]:
        extra = {"PYTHONPATH": str(ROOT), "LOGLEVEL": "INFO"}
        (self.tmp / "snap").mkdir(exist_ok=True)
        if self.arm.launcher == "torchrun":  # the plain script's protocol, set by hand
            control = self.tmp / f"control-{node}"
            control.mkdir(exist_ok=True)
            extra |= {"ELASTIC_TRAIN_CONTROL_DIR": str(control),
                      "ELASTIC_TRAIN_SNAPSHOT_DIR": str(self.tmp / "snap"),
                      "ELASTIC_TRAIN_SNAPSHOT_EVERY": str(self.save_every)}  # fmt: skip
        return plain_env(os.environ, **extra)

    def start(self, node: str) -> None:
        log = open(self.tmp / f"{node}.out", "ab")  # noqa: SIM115  (closed with the process)
        self.procs[node] = subprocess.Popen(
            self.cmd(node), env=self.env(node), stdout=log, stderr=subprocess.STDOUT
        )

    def launch(self) -> None:
        """Start both nodes (node a hosts the store)."""
        self.port = free_port()
        self.start("a")
        if not wait_until(lambda: listening(self.port), 60):
            raise RuntimeError(f"{self.arm.name}: the first node never hosted the store")
        self.start("b")

    def done(self) -> bool:
        """The job's last step is done; a job whose launchers all exited before it is launched
        again, from its snapshots, as a user's retry would (counted in ``relaunches``)."""
        if any(r[0] >= self.steps for r in self.audit.poll()):
            return True
        if all(p.poll() is not None for p in self.procs.values()):
            if len(self.relaunches) >= MAX_RELAUNCHES:
                raise RuntimeError(f"{self.arm.name}: the job died {MAX_RELAUNCHES + 1} times")
            self.relaunches.append(time.time())
            print(f"    the job died: launched again ({len(self.relaunches)})", file=sys.stderr)
            self.launch()
            return False
        for node, proc in list(self.procs.items()):
            if proc.poll() is not None and not (node == "b" and self.node_lost):
                # its launcher gave up while the other goes on: a scheduler replaces the node
                print(f"    node {node}'s launcher exited: started again", file=sys.stderr)
                self.start(node)
        return False

    def trains_at(self, world: int, since: float) -> bool:
        return any(r[2] == world and r[3] > since for r in self.audit.poll())

    def inject(self, kind: str) -> float:
        """SIGKILL node b (all of it, then start it again once the job goes on without it), or
        node b's worker alone; returns when the fault happened."""
        b = self.procs["b"]
        script = WORKERS[self.arm.worker]
        victims = tree(b) if kind == "node_loss" else workers_of(b, script, self.tmp / "b.jsonl")
        if not victims:
            raise RuntimeError(f"{self.arm.name}: no {kind} victim found on node b")
        at = time.time()
        self.node_lost = kind == "node_loss"
        kill(victims)
        if self.node_lost:
            with contextlib.suppress(subprocess.TimeoutExpired):
                b.wait(10)
            # the replacement node arrives once the job trains without it (or after the wait)
            wait_until(lambda: self.done() or self.trains_at(1, at), RECOVER_TIMEOUT_S)
            self.node_lost = False
            if self.procs["b"] is b:  # not launched again with the whole job meanwhile
                self.start("b")
        return at

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)  # the job is done: the launchers exit by themselves
            kill(tree(proc))
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


class NoRecovery(RuntimeError):
    """The launcher did not bring the job back: its row says so instead of a goodput."""


def _not_back(failures: list[tuple[str, float]], launched: float) -> str:
    why = f"never trained at world size 2 again within {RECOVER_TIMEOUT_S:.0f} s"
    if not failures:
        return why
    kind, at = failures[-1]
    return f"{why} after the {kind.replace('_', ' ')} at +{at - launched:.0f} s"


def schedule(job: Job, launched: float, every: float, deadline: float) -> list[tuple[str, float]]:
    """Inject failures every ``every`` seconds from ``launched`` until the job is done."""
    failures: list[tuple[str, float]] = []
    last = launched
    while not job.done():
        due = due_at(launched, every, len(failures))
        wait_until(lambda: job.done() or time.time() >= due, deadline - time.monotonic())  # noqa: B023
        if job.done():
            break
        # only a job at full size is failed again (a node loss needs node b in the group)
        if not wait_until(lambda: job.done() or job.trains_at(2, last + 0.5), RECOVER_TIMEOUT_S):  # noqa: B023
            raise NoRecovery(_not_back(failures, launched))
        if job.done():
            break
        kind = failure_kind(len(failures))
        last = job.inject(kind)
        failures.append((kind, last))
        print(f"    {kind} at +{last - launched:.1f} s", file=sys.stderr)
    return failures


def run_job(
    arm: Arm,
    *,
    steps: int,
    step_time: float,
    save_every: int,
    failure_every: float | None,
    keep_logs: str = "",
) -> Run:
    """One run of ``arm``'s job to its last step, with failures every ``failure_every`` s."""
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmpdir:
        tmp = Path(tmpdir)
        job = Job(arm, tmp, steps, step_time, save_every)
        deadline = time.monotonic() + 3 * steps * step_time + 600
        launched = time.time()
        try:
            job.launch()
            failures = schedule(job, launched, failure_every, deadline) if failure_every else []
            if not wait_until(job.done, deadline - time.monotonic()):
                raise NoRecovery(f"the job did not reach step {steps} in time")
            rows = job.audit.poll()
            finished = min(r[3] for r in rows if r[0] >= steps)
            job.stop()
            text = (tmp / "markers").read_text(errors="replace")
            restored = [t for name, t in parse_markers(text) if name == "restored"]
            return Run(steps=steps, wall=finished - launched, rows=list(job.audit.poll()),
                       restored=restored, failures=failures,
                       relaunches=job.relaunches)  # fmt: skip
        finally:
            for proc in job.procs.values():
                kill(tree(proc))
            if keep_logs:
                label = "failures" if failure_every else "free"
                name = f"{arm.launcher}-{arm.worker}-{label}-{int(time.time())}"
                shutil.copytree(tmp, Path(keep_logs) / name)
