"""One job of N forked agents (bench/scale.py's engine: processes, files and clocks here, the
arithmetic in _scale_calc.py).

The job: ``--min-nodes 1 --max-nodes N``, one worker per node (bench/_scale_worker.py, no
torch), agent 0 first (it hosts the store), then the others. The first round closes when all N
have joined (the maximum; the patient first last call is set far beyond it), later rounds as
soon as the survivors have (``decisions.close_round_now``). In order:

1. ``formation``: the last agent forked -> the last agent's ``rendezvous.completed`` (and its
   ``workers.started``);
2. ``idle``: a quiet window: CPU and memory per agent, connections per agent, store traffic
   per second (heartbeats, membership checks);
3. ``node_loss``: the process group (agent and worker) of a node that does not host the store
   is SIGKILLed -> every survivor's ``rendezvous.completed`` / ``workers.started``; the store
   operations and bytes of all agents in between are the round's;
4. ``join``: a fresh agent -> every member's ``rendezvous.completed`` at N again;
5. ``store_loss``: agent 0 (the store host) is SIGKILLed -> every survivor's
   ``rendezvous.completed`` on the failed-over store.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import _scale_fork
import psutil
from _recovery_run import free_port, listening
from _scale_calc import Phase, RoundTraffic

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "bench" / "_scale_worker.py")
DONE = ("rendezvous.completed", "workers.started")


def wait_until(predicate: Callable[[], object], timeout: float, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return False


def events(path: Path) -> list[tuple[str, float, dict]]:
    """(event, unix time, fields) of an agent's JSON log file, whole lines only."""
    found = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError):
                e = json.loads(line)
                at = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                found.append((e["event"], at, e))
    return found


class Job:
    def __init__(self, n: int, tmp: Path, *, last_call_s: float = 600.0) -> None:
        self.n, self.tmp = n, tmp
        self.port = free_port()
        self.pids: dict[str, int] = {}
        self.slots: dict[str, int] = {}
        (tmp / "snap").mkdir(mode=0o700)
        self._last_call_s = last_call_s
        self._env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def argv(self, node: str) -> list[str]:
        conf = f"first_last_call_timeout={self._last_call_s},join_timeout={self._last_call_s + 60}"
        return [
            "--min-nodes", "1", "--max-nodes", str(self.n), "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--job-id", "scale",
            "--rdzv-conf", conf, "--snapshot-dir", str(self.tmp / "snap"),
            "--max-restarts", "1000", "--log-format", "json",
            "--log-file", str(self.tmp / f"{node}.jsonl"), "--node", node,
            "--no-warm-workers", "--no-memory-tier", WORKER,
        ]  # fmt: skip

    def start(self, node: str) -> float:
        slot = len(self.slots)
        self.slots[node] = slot
        at = time.time()
        self.pids[node] = _scale_fork.start_agent(
            slot, self.argv(node), str(self.tmp / f"{node}.out"), self._env
        )
        return at

    def kill(self, node: str) -> float:
        at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pids[node], signal.SIGKILL)
        self._reap(node)
        return at

    def _reap(self, node: str) -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pids.pop(node), 0)

    def alive(self) -> list[str]:
        return list(self.pids)

    def completed_after(self, node: str, since: float, world: int) -> dict[str, float]:
        """The node's first ``rendezvous.completed`` at ``world`` after ``since`` and its
        ``workers.started`` after that (unix times)."""
        out: dict[str, float] = {}
        for name, at, e in events(self.tmp / f"{node}.jsonl"):
            if at < since or name in out:
                continue
            formed = name == DONE[0] and e.get("world_size") == world
            if formed or (name == DONE[1] and DONE[0] in out):
                out[name] = at
        return out

    def phase(self, since: float, world: int, timeout: float) -> Phase:
        """Wait until every live agent has formed ``world`` after ``since``; the last one's
        times (None where some never did within ``timeout``)."""
        done: dict[str, dict[str, float]] = {}

        def all_done() -> bool:
            for node in self.alive():
                if len(done.get(node, {})) < 2:
                    done[node] = self.completed_after(node, since, world)
            return all(len(done.get(node, {})) == 2 for node in self.alive())

        ok = wait_until(all_done, timeout, every_s=0.2)
        formed = [d.get(DONE[0]) for d in done.values()]
        started = [d.get(DONE[1]) for d in done.values()]
        return Phase(
            round_closed=max(formed) - since if ok and all(formed) else None,
            workers_started=max(started) - since if ok and all(started) else None,
            first_closed=min(formed) - since if ok and all(formed) else None,
        )

    def cpu_s(self) -> dict[str, float]:
        """Each live agent's own CPU time so far (user + system; its workers apart)."""
        out: dict[str, float] = {}
        for node, pid in self.pids.items():
            with contextlib.suppress(psutil.Error):
                out[node] = sum(psutil.Process(pid).cpu_times()[:2])
        return out

    def traffic(self) -> tuple[int, int]:
        """(operations, bytes both ways) of every agent's store client so far."""
        rows = _scale_fork.counters()
        return sum(r[0] for r in rows), sum(r[1] + r[2] for r in rows)

    def idle(self, window_s: float) -> dict[str, float]:
        """Per live agent (medians), over a quiet ``window_s``: CPU (% of a core), USS and
        PSS (MB), TCP connections; and the store traffic of all per second."""
        procs = {node: psutil.Process(pid) for node, pid in self.pids.items()}
        cpu0 = {node: sum(p.cpu_times()[:2]) for node, p in procs.items()}
        ops0, bytes0 = self.traffic()
        t0 = time.monotonic()
        time.sleep(window_s)
        elapsed = time.monotonic() - t0
        ops1, bytes1 = self.traffic()
        cpu = [100 * (sum(p.cpu_times()[:2]) - cpu0[n]) / elapsed for n, p in procs.items()]
        mem = [p.memory_full_info() for p in procs.values()]
        conns = [len(p.net_connections(kind="tcp")) for p in procs.values()]
        host = procs[min(self.slots, key=self.slots.__getitem__)]
        return {
            "cpu_pct": _median(cpu),
            "uss_mb": _median([m.uss / 2**20 for m in mem]),
            "pss_mb": _median([m.pss / 2**20 for m in mem]),
            "conns": _median([float(c) for c in conns]),
            "host_conns": float(len(host.net_connections(kind="tcp"))),
            "ops_per_s": (ops1 - ops0) / elapsed,
            "bytes_per_s": (bytes1 - bytes0) / elapsed,
        }

    def stop(self) -> None:
        for node in list(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pids[node], signal.SIGKILL)
        for node in list(self.pids):
            self._reap(node)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def run_job(n: int, *, idle_s: float, timeout: float, keep_logs: str = "") -> dict[str, object]:
    """Every phase of one job of ``n`` agents (module docstring); None for a phase that did
    not complete within ``timeout``."""
    with tempfile.TemporaryDirectory(prefix=f"bench-scale-{n}-") as tmpdir:
        job = Job(n, Path(tmpdir))
        out: dict[str, object] = {"n": n}
        try:
            job.start("n0")
            if not wait_until(lambda: listening(job.port), 60):
                raise RuntimeError("agent n0 never hosted the store")
            for i in range(1, n):
                last = job.start(f"n{i}")
            out["formation"] = job.phase(last if n > 1 else 0.0, n, timeout)
            time.sleep(min(idle_s, 2.0))  # the first membership checks and reads settle
            out["idle"] = job.idle(idle_s)
            if n < 3:
                return out
            before, cpu_before = job.traffic(), job.cpu_s()
            fault = job.kill(f"n{n - 1}")
            out["node_loss"] = job.phase(fault, n - 1, timeout)
            after, cpu_after = job.traffic(), job.cpu_s()
            spent = [cpu_after[a] - cpu_before[a] for a in cpu_after if a in cpu_before]
            out["round"] = RoundTraffic(
                ops=after[0] - before[0],
                bytes=after[1] - before[1],
                agent_cpu_ms=1000 * _median(spent),
                cpu_s=sum(spent),
            )
            time.sleep(1.0)
            joined = job.start(f"n{n}")
            out["join"] = job.phase(joined, n, timeout)
            time.sleep(1.0)
            fault = job.kill("n0")
            out["store_loss"] = job.phase(fault, n - 1, timeout)
            return out
        finally:
            job.stop()
            if keep_logs:
                import shutil

                shutil.copytree(tmpdir, Path(keep_logs) / f"scale-{n}-{int(time.time())}")


if __name__ == "__main__":  # a smoke run: python bench/_scale_run.py N
    print(run_job(int(sys.argv[1]), idle_s=5.0, timeout=120.0))
