"""deploy/slurm/elastic-train.sbatch on a real single-node Slurm cluster on 127.0.0.1.

Needs slurmctld, slurmd and the client commands (Debian's slurm-wlm, installed by
.ci/setup-system.sh) and root (the daemons switch to the job's user); skips otherwise. The
cluster lives in a temp dir with its own ports, auth/none, no cgroups.

``elastic-train`` is replaced by tests/e2e/workers/store_slurm_stub.py: the real
``elastic-train store``, and a stand-in supervisor (a step counter with a "final snapshot"
on SIGUSR1/SIGTERM), so these tests check the script's wiring (store start, signal
forwarding through srun, requeue, resume in the same snapshot folder) in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = ROOT / "deploy" / "slurm" / "elastic-train.sbatch"
STUB = ROOT / "tests" / "e2e" / "workers" / "store_slurm_stub.py"
REAL_WORKER = ROOT / "tests" / "e2e" / "workers" / "store_slurm_worker.py"
TOOLS = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "srun")

missing = [tool for tool in TOOLS if shutil.which(tool) is None]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        bool(missing), reason=f"Slurm is not installed ({', '.join(missing)}): .ci/setup-system.sh"
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="a local Slurm cluster needs root"),
]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=et{ctld_port}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
# auth/none: a throw-away cluster on 127.0.0.1; never do this on a real one (use munge).
AuthType=auth/none
CredType=cred/none
# A requeued job may start again only once its old credential expires (120 s by default).
AuthInfo=cred_expire=5
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
# A requeued job starts at the scheduler's next pass: every second here, not every 30-60 s.
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=60
MinJobAge=600
# What deploy/slurm/README asks of a real cluster: preemption requeues, with a grace time.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=low Nodes={node} Default=YES State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=high Nodes={node} State=UP PriorityTier=2 PreemptMode=OFF
"""


@dataclass(kw_only=True)
class Cluster:
    dir: Path
    env: dict[str, str]

    def run(self, *cmd: str) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed: {done.stderr}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict of its KEY=VALUE words."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(word.split("=", 1) for word in out.split() if "=" in word)


def _start_daemons(cluster: Cluster) -> list[subprocess.Popen]:
    node = socket.gethostname().split(".")[0]
    cmds = [["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", node]]
    procs = []
    for cmd in cmds:
        log = (cluster.dir / f"{cmd[0]}.out").open("w")
        procs.append(subprocess.Popen(cmd, env=cluster.env, stdout=log, stderr=subprocess.STDOUT))
    return procs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (base / sub).mkdir()
    node = socket.gethostname().split(".")[0]
    conf = SLURM_CONF.format(node=node, dir=base, ctld_port=free_port(), slurmd_port=free_port())
    (base / "slurm.conf").write_text(conf)
    # Nothing of an outer Slurm job (if these tests run inside one) may leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(SLURM_CONF=str(base / "slurm.conf"), OMP_NUM_THREADS="1")
    c = Cluster(dir=base, env=env)
    daemons = _start_daemons(c)
    try:
        wait_for(lambda: _node_idle(c), 60, "the local Slurm node to be idle")
        yield c
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, timeout=30)
        wait_for(lambda: not _squeue(c), 90, "every Slurm job to end")
        for proc in daemons:
            proc.terminate()
            proc.wait(timeout=30)


def _squeue(cluster: Cluster) -> str:
    done = subprocess.run(
        ["squeue", "--noheader"], env=cluster.env, capture_output=True, text=True, timeout=30
    )
    return done.stdout.strip()


def _node_idle(cluster: Cluster) -> bool:
    done = subprocess.run(
        ["sinfo", "--noheader", "-o", "%t"], env=cluster.env, capture_output=True, text=True
    )
    return done.returncode == 0 and done.stdout.split()[:1] == ["idle"]


@dataclass(kw_only=True)
class Job:
    cluster: Cluster
    id: str
    dir: Path

    def records(self) -> list[dict[str, Any]]:
        path = self.dir / "snap" / "attempts.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r["event"] == name]

    def steps_since_start(self, nth_start: int) -> int:
        starts = [i for i, r in enumerate(self.records()) if r["event"] == "start"]
        if len(starts) <= nth_start:
            return 0
        return sum(1 for r in self.records()[starts[nth_start] :] if r["event"] == "step")

    def state(self) -> str:
        return self.cluster.job(self.id)["JobState"]

    def output(self) -> str:
        return (self.dir / f"out-{self.id}.txt").read_text()


def stub_elastic_train(tmp_path: Path) -> str:
    shim = tmp_path / "elastic-train"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STUB}" "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return str(shim)


def submit(
    cluster: Cluster, tmp_path: Path, *script_args: str, elastic_train: str | None = None
) -> Job:
    env = {
        **cluster.env,
        "ELASTIC_TRAIN": elastic_train or stub_elastic_train(tmp_path),
        "SNAPSHOT_DIR": str(tmp_path / "snap"),
        "STORE_HOST": "127.0.0.1",
        "NPROC_PER_NODE": "1",
    }
    out = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--exclusive", "--time=10",
         f"--output={tmp_path}/out-%j.txt", f"--chdir={tmp_path}",
         str(SBATCH_SCRIPT), *(script_args or [str(tmp_path / "done")])],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return Job(cluster=cluster, id=out.stdout.strip().split(";")[0], dir=tmp_path)


def wait_requeued(job: Job) -> None:
    """The job went back to the queue (it starts again by itself after cred_expire)."""
    wait_for(lambda: job.cluster.job(job.id).get("Restarts") == "1", 60, "the requeue")


def test_time_limit_warning_snapshots_requeues_and_resumes(
    cluster: Cluster, tmp_path: Path
) -> None:
    job = submit(cluster, tmp_path)
    wait_for(lambda: job.steps_since_start(0) >= 5, 60, "the first run to make progress")
    assert job.events("start")[0]["store"] is True, "the rendezvous store was not reachable"

    # What `#SBATCH --signal=B:USR1@90` sends 90 s before the time limit.
    cluster.run("scancel", "--signal=USR1", "--batch", job.id)
    final = wait_for(lambda: job.events("final"), 60, "the final snapshot")[0]
    assert final["signal"] == "SIGUSR1"

    wait_requeued(job)
    wait_for(lambda: job.steps_since_start(1) >= 5, 90, "the requeued run to make progress")
    resumed = job.events("start")[1]
    assert resumed["restart"] == 1
    assert resumed["resumed_from"] == final["step"]
    assert resumed["job_id"] == job.id and resumed["store"] is True

    (tmp_path / "done").touch()
    wait_for(lambda: job.state() == "COMPLETED", 60, "the job to complete")
    assert job.cluster.job(job.id)["ExitCode"] == "0:0"


def test_preemption_snapshots_requeues_and_a_user_cancel_does_not(
    cluster: Cluster, tmp_path: Path
) -> None:
    job = submit(cluster, tmp_path)
    wait_for(lambda: job.steps_since_start(0) >= 5, 60, "the first run to make progress")

    # A job in the higher-priority partition needs the whole node: ours is preempted.
    urgent = cluster.run(
        "sbatch", "--parsable", "--partition=high", "--exclusive", f"--chdir={tmp_path}",
        f"--output={tmp_path}/urgent.txt", "--wrap", "echo urgent ran",
    ).strip()  # fmt: skip
    final = wait_for(lambda: job.events("final"), 90, "the final snapshot")[0]
    assert final["signal"] == "SIGTERM"
    wait_for(lambda: cluster.job(urgent)["JobState"] == "COMPLETED", 90, "the urgent job")

    wait_requeued(job)
    wait_for(lambda: job.steps_since_start(1) >= 5, 90, "the requeued run to make progress")
    assert job.events("start")[1]["resumed_from"] == final["step"]

    # A user's scancel also gets a final snapshot, but the job stays cancelled.
    cluster.run("scancel", job.id)
    wait_for(lambda: len(job.events("final")) == 2, 60, "the second final snapshot")
    wait_for(lambda: job.state() == "CANCELLED", 60, "the job to be cancelled")
    assert cluster.job(job.id)["Restarts"] == "1"
    assert "requeueing" not in job.output().split("restart count 1")[1]


def _steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def submit_real(cluster: Cluster, tmp_path: Path) -> Job:
    elastic_train = Path(sys.executable).parent / "elastic-train"
    if not elastic_train.exists():
        pytest.skip("elastic-train is not installed in this environment")
    job = submit(
        cluster, tmp_path, str(REAL_WORKER), str(tmp_path), str(tmp_path / "done"),
        elastic_train=str(elastic_train),
    )  # fmt: skip
    steps = tmp_path / "steps.jsonl"
    wait_for(lambda: len(_steps(steps)) >= 5, 180, "the first run to train 5 steps")
    return job


def check_resumed_from_final_snapshot(job: Job) -> None:
    steps = job.dir / "steps.jsonl"
    wait_requeued(job)
    first_run = [r for r in _steps(steps) if r["restart"] == 0]
    assert first_run[-1]["restored_step"] is None
    resumed = wait_for(
        lambda: [r for r in _steps(steps) if r["restart"] == 1], 180, "the requeued run to train"
    )
    # The final snapshot was committed at the step the coordinated stop happened.
    assert resumed[0]["restored_step"] == first_run[-1]["step"], job.output()
    assert resumed[0]["step"] == first_run[-1]["step"] + 1
    (job.dir / "done").touch()
    wait_for(lambda: job.state() == "COMPLETED", 120, "the job to complete")
    assert job.cluster.job(job.id)["ExitCode"] == "0:0", job.output()


@pytest.mark.timeout(400)
def test_real_supervisor_resumes_from_its_final_snapshot_after_requeue(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The time-limit story with the real elastic-train and a TrainingSession worker."""
    job = submit_real(cluster, tmp_path)
    cluster.run("scancel", "--signal=USR1", "--batch", job.id)
    check_resumed_from_final_snapshot(job)


@pytest.mark.timeout(400)
def test_real_supervisor_resumes_from_its_final_snapshot_after_preemption(
    cluster: Cluster, tmp_path: Path
) -> None:
    job = submit_real(cluster, tmp_path)
    cluster.run(
        "sbatch", "--parsable", "--partition=high", "--exclusive", f"--chdir={tmp_path}",
        f"--output={tmp_path}/urgent.txt", "--wrap", "echo urgent ran",
    )  # fmt: skip
    check_resumed_from_final_snapshot(job)
