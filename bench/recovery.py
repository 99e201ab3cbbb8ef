"""Recovery after SIGKILL of one node of two: elastic-train vs torchrun, side by side.

Each launcher runs the same tiny gloo job (tests/e2e/workers/proto_worker.py: an all-reduce
per step, 0.1 s steps, a snapshot every 5 steps) on two "nodes" (two agents on 127.0.0.1,
one worker each). Once both train at world size 2, the whole second node (agent + worker)
is SIGKILLed. We measure seconds from the kill to the first completed step at world size 1,
and steps lost (last step done before the kill minus the step the survivor resumed from).

torchrun runs with its defaults (--nnodes 1:2, c10d); elastic-train with its own.

    python bench/recovery.py [--trials N] [--timeout S]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "e2e" / "workers" / "proto_worker.py")


@dataclass(frozen=True, kw_only=True)
class Trial:
    recovery_s: float | None  # None: no step at world size 1 within the timeout
    steps_lost: int | None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def audit_rows(path: Path) -> list[tuple[int, int, int, float]]:
    rows = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                rows.append((int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])))
    return rows


def launcher_cmd(kind: str, port: int, node: str, tmp: Path) -> list[str]:
    job = [WORKER, "--steps", "100000", "--step-time", "0.1", "--audit", str(tmp / "audit")]
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
        "--max-restarts", "3", "--log-format", "json", "--log-file", str(tmp / f"{node}.jsonl"),
        "--node", node, *job,
    ]  # fmt: skip


def env_for(kind: str, tmp: Path, node: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    snap = tmp / "snap"
    snap.mkdir(exist_ok=True)
    if kind == "torchrun":  # the worker's protocol, set by hand for torchrun
        control = tmp / f"control-{node}"
        control.mkdir(exist_ok=True)
        env.update(ELASTIC_TRAIN_CONTROL_DIR=str(control), ELASTIC_TRAIN_SNAPSHOT_DIR=str(snap),
                   ELASTIC_TRAIN_SNAPSHOT_EVERY="5")  # fmt: skip
    else:
        env.update(ELASTIC_TRAIN_SNAPSHOT_DIR="")  # set through flags below instead
    return env


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def run_trial(kind: str, timeout: float) -> Trial:
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-") as tmpdir:
        tmp = Path(tmpdir)
        port = free_port()
        procs = []
        try:
            for node in ("a", "b"):
                cmd = launcher_cmd(kind, port, node, tmp)
                if kind == "elastic-train":
                    cmd[3:3] = ["--snapshot-dir", str(tmp / "snap"), "--snapshot-every", "5"]
                log = open(tmp / f"{node}.out", "wb")  # noqa: SIM115
                procs.append(subprocess.Popen(cmd, env=env_for(kind, tmp, node), stdout=log,
                                              stderr=subprocess.STDOUT))  # fmt: skip
                if node == "a" and not wait_until(lambda: listening(port), 60):
                    raise RuntimeError(f"{kind}: the first agent never hosted the store")
            audit = tmp / "audit"

            # kill between two snapshots (every 5 steps): 3 steps past one, so work is lost
            def at_two() -> bool:
                rows = audit_rows(audit)
                return any(r[2] == 2 and r[0] >= 13 and r[0] % 5 == 3 for r in rows)

            if not wait_until(at_two, 180):
                raise RuntimeError(f"{kind}: never trained at world size 2")
            last_before = max(r[0] for r in audit_rows(audit))
            killed_at = time.time()
            kill_tree(procs[1])
            after = lambda: [r for r in audit_rows(audit) if r[2] == 1 and r[3] > killed_at]  # noqa: E731
            if not wait_until(after, timeout):
                return Trial(recovery_s=None, steps_lost=None)
            first = min(after(), key=lambda r: r[3])
            # the survivor resumed from snapshot step first[0] - 1
            return Trial(
                recovery_s=first[3] - killed_at, steps_lost=max(0, last_before - (first[0] - 1))
            )
        finally:
            for proc in procs:
                kill_tree(proc)


def summarize(trials: list[Trial]) -> tuple[float | None, float | None, int]:
    ok = [t for t in trials if t.recovery_s is not None]
    if not ok:
        return None, None, 0
    return (
        statistics.median(t.recovery_s for t in ok),  # type: ignore[misc]
        statistics.median(t.steps_lost for t in ok),  # type: ignore[misc]
        len(ok),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=150.0, help="per recovery, seconds")
    args = parser.parse_args()
    results: dict[str, list[Trial]] = {"torchrun": [], "elastic-train": []}
    for _ in range(args.trials):
        for kind in results:  # interleaved, so both see the same machine load
            trial = run_trial(kind, args.timeout)
            results[kind].append(trial)
            print(f"  {kind:14s} recovery_s={trial.recovery_s} steps_lost={trial.steps_lost}",
                  file=sys.stderr)  # fmt: skip
    base_s, _, _ = summarize(results["torchrun"])
    print(f"\nRecovery after SIGKILL of 1 node of 2 (median of {args.trials}; 0.1 s steps)")
    print(
        f"{'launcher':14s} {'ok':>5s} {'recovery_s':>11s} {'steps_lost':>11s} {'time ratio':>11s}"
    )
    for kind, trials in results.items():
        rec, lost, n = summarize(trials)
        ratio = "-" if rec is None or base_s is None else f"{rec / base_s:.2f}"
        rec_txt = "timeout" if rec is None else f"{rec:.2f}"
        lost_txt = "-" if lost is None else f"{lost:.0f}"
        print(f"{kind:14s} {n:>2d}/{len(trials):<2d} {rec_txt:>11s} {lost_txt:>11s} {ratio:>11s}")
    ours, _, _ = summarize(results["elastic-train"])
    if ours is not None and base_s is not None:
        verdict = "meets" if ours <= base_s / 5 and ours < 10 else "misses"
        print(f"\ntarget (<= 1/5 of torchrun and < 10 s): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
