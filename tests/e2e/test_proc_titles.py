"""What ``ps`` shows for a live one-node job: every process names its role (the worker its
rank and script), none shows the warm pool's or the bootstrap's module any more, and the
environment our clean-up finds processes by stays readable (``elastic_trainer/proc_title.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from tests.e2e.workers.harness import (
    HERE,
    env_with,
    free_port,
    processes_with_env,
    start_agent,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TITLED = str(HERE / "titled.py")
# what every process of ours showed before it had a title
MODULES = (
    "elastic_trainer.entrypoints.warm_pool",
    "elastic_trainer.entrypoints.worker",
    "elastic_trainer.entrypoints.sentinel",
)


def shown(pid: int) -> str:
    """The command line ``ps`` shows for ``pid`` (a title is one string, padded with NULs)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def tree(root: int) -> dict[int, str]:
    """pid -> what ``ps`` shows, for every live process under ``root``."""
    out = {}
    for proc in psutil.Process(root).children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out[proc.pid] = shown(proc.pid)
        except (psutil.Error, OSError):
            continue  # ended meanwhile
    return out


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_every_process_of_a_job_shows_its_role(tmp_path: Path, worker_env, agents, warm) -> None:
    env = env_with(worker_env, TITLES_DIR=str(tmp_path))
    flags = ["--warm-workers" if warm else "--no-warm-workers"]
    argv = ["--nproc-per-node", "1", *flags, TITLED, str(tmp_path)]
    agent = start_agent(tmp_path, "n0", argv, env, port=free_port())
    agents.append(agent)
    waiting = tmp_path / "waiting.json"
    wait_for(lambda: waiting.exists() or agent.proc.poll() is not None, 120, "the worker")
    assert waiting.exists(), agent.stderr_file.read_text()[-2000:]
    try:
        pids = json.loads(waiting.read_text())
        seen = tree(agent.proc.pid)
        worker = f"elastic-train worker 0: {TITLED}"
        assert seen[pids["worker"]].startswith(worker), seen
        assert psutil.Process(pids["worker"]).name() == "et-worker 0"
        # the worker's own child (a DataLoader worker, say) is the worker's: its title
        assert seen[pids["child"]] == seen[pids["worker"]], seen
        sentinel = f"elastic-train sentinel (supervisor {agent.proc.pid})"
        assert sentinel in seen.values(), seen
        pools = [e["pid"] for e in agent.events("warm_pool.ready")]
        assert [seen[p] for p in pools] == (["elastic-train warm pool (node n0)"] if warm else [])
        assert [s for s in seen.values() if any(m in s for m in MODULES)] == [], seen
        # the clean-up's way of finding them (sentinel.py): a title leaves it readable
        marked = {p.pid for p in processes_with_env("TITLES_DIR", str(tmp_path))}
        assert {pids["worker"], pids["child"], *pools} <= marked
    finally:
        (tmp_path / "go").touch()
    assert agent.wait(90) == 0, agent.stderr_file.read_text()[-2000:]
