"""deploy/slurm/elastic-train.sbatch: the #SBATCH directives the preemption story relies on.

The script's behaviour is tested on a real local Slurm in tests/e2e/test_store_slurm.py.
"""

from __future__ import annotations

import os
import pwd
import re
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "elastic-train.sbatch"
SUPERVISOR_GRACE_S = 25


def directives() -> dict[str, str]:
    found = {}
    for match in re.finditer(r"^#SBATCH\s+(--[a-z-]+)(?:=(\S+))?", SCRIPT.read_text(), re.M):
        found[match[1]] = match[2] or ""
    return found


def test_warning_signal_goes_to_the_batch_script_well_before_the_time_limit() -> None:
    signal = re.fullmatch(r"B:USR1@(\d+)", directives()["--signal"])
    assert signal, "use --signal=B:USR1@SECONDS: the script forwards it to the supervisors"
    # The lead time must cover the supervisor's grace period plus the requeue itself.
    assert int(signal[1]) >= 2 * SUPERVISOR_GRACE_S


def test_job_can_requeue_and_survives_a_lost_node() -> None:
    found = directives()
    assert "--requeue" in found
    assert "--no-kill" in found  # a failed node must not end the allocation
    assert found["--ntasks-per-node"] == "1"  # one supervisor per node


def test_supervisors_join_the_batch_host_store_as_clients() -> None:
    text = SCRIPT.read_text()
    assert re.search(r'"\$ELASTIC_TRAIN" store --host "\$STORE_HOST"', text)
    assert "--rdzv-conf is_host=false" in text
    assert "--kill-on-bad-exit=0" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text


def test_the_warning_signal_reaches_the_supervisors_alone() -> None:
    """A signal Slurm delivers to a step reaches the workers too and kills them unsaved."""
    text = SCRIPT.read_text()
    assert re.search(
        r"srun --overlap .*\\\n\s+bash -c \"\$private_dir\"'kill -USR1 \"\$\(<\"\$d/\$0\"\)\"'",
        text,
    )
    assert 'echo "$$" >"$d/$0" && exec "$@"' in text  # the supervisor's PID, per node
    assert 'kill -USR1 "$srun_pid"' not in text


def test_the_store_outlives_slurms_sigterm_long_enough() -> None:
    match = re.search(r"--linger (\d+)", SCRIPT.read_text())
    assert match and int(match[1]) > SUPERVISOR_GRACE_S


def test_allocation_knobs_are_offered_for_auto_to_see() -> None:
    """`--nproc-per-node auto` counts what the job was given: the script shows how to ask."""
    text = SCRIPT.read_text()
    for knob in ("--gpus-per-node", "--cpus-per-task"):
        assert re.search(rf"^##SBATCH {knob}=\d+$", text, re.M), f"offer {knob} (commented)"
    assert "one per GPU, else 1" not in text  # the old comment contradicted the code


# --- the script run for real, with stand-ins for Slurm's commands ----------------------------
# No Slurm needed: hostname, getent and srun are fakes on PATH, elastic-train is a stub that
# records its arguments. The stub "store" writes its ready file and exits; nothing listens.

FAKE_ELASTIC_TRAIN = """#!/usr/bin/env bash
printf '%s\\n' "$*" >>"$FAKE_LOG/elastic-train.args"
for ((i = 1; i <= $#; i++)); do
    if [[ "${!i}" == --ready-file ]]; then j=$((i + 1)); echo "127.0.0.1:1" >"${!j}"; fi
done
"""


def fake_bin(tmp_path: Path, addresses: str) -> Path:
    """hostname/getent that resolve this host to ``addresses`` (space-separated), and srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    first = addresses.split()[0]
    fakes = {
        "hostname": f'[[ "${{1:-}}" == -I ]] && echo "{addresses}" || echo node1',
        "getent": f'echo "{first}   STREAM node1"',
        # records its arguments; with FAKE_SRUN_RUNS set it also runs the step's command
        "srun": 'args="$*"; printf "%s\\n" "${args//$\'\\n\'/ }" >>"$FAKE_LOG/srun.args"\n'
        '[[ -n "${FAKE_SRUN_RUNS:-}" ]] || exit 0\n'
        'while [[ $# -gt 0 && "$1" != bash ]]; do shift; done\n'
        'exec "$@"',
        "elastic-train": FAKE_ELASTIC_TRAIN.removeprefix("#!/usr/bin/env bash\n"),
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_script(tmp_path: Path, addresses: str, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = fake_bin(tmp_path, addresses)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STORE_"))}
    base.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_LOG=str(tmp_path),
        TMPDIR=str(tmp_path),
        SLURM_JOB_ID="77",
        SLURM_JOB_NUM_NODES="2",
        SLURM_SUBMIT_DIR=str(tmp_path / "submit"),
        ELASTIC_TRAIN=str(bin_dir / "elastic-train"),
    )
    base.update(env)
    return subprocess.run(
        ["bash", str(SCRIPT), "train.py"], env=base, capture_output=True, text=True, timeout=60
    )


def recorded(tmp_path: Path, name: str) -> list[str]:
    path = tmp_path / f"{name}.args"
    return path.read_text().splitlines() if path.exists() else []


def test_each_node_keeps_its_supervisors_pid_in_a_private_folder(tmp_path: Path) -> None:
    done = run_script(tmp_path, "127.0.0.1", SLURM_JOB_NUM_NODES="1", FAKE_SRUN_RUNS="1")
    assert done.returncode == 0, done.stderr
    folder = tmp_path / f"elastic-train-slurm-{os.getuid()}"
    mode = folder.lstat()
    assert stat.S_ISDIR(mode.st_mode) and stat.S_IMODE(mode.st_mode) == 0o700
    assert mode.st_uid == os.getuid()
    assert (folder / "77.0.pid").read_text().strip().isdigit()


def test_the_pid_files_of_supervisors_no_longer_running_are_removed(tmp_path: Path) -> None:
    """A node keeps no file per job and restart for ever: the wrapper removes those whose
    supervisor has ended, and only those."""
    folder = tmp_path / f"elastic-train-slurm-{os.getuid()}"
    folder.mkdir(mode=0o700)
    ended = subprocess.Popen(["true"])
    ended.wait()  # its PID names no process now
    (folder / "12.0.pid").write_text(f"{ended.pid}\n")
    (folder / "77.0.pid").write_text(f"{ended.pid}\n")  # this job's, from an earlier run
    (folder / "13.1.pid").write_text(f"{os.getpid()}\n")  # a supervisor still running
    done = run_script(tmp_path, "127.0.0.1", SLURM_JOB_NUM_NODES="1", FAKE_SRUN_RUNS="1")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["13.1.pid", "77.0.pid"]
    assert (folder / "77.0.pid").read_text().strip() != str(ended.pid)


def _second_user() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no second local user (nobody) to create the folder first")


@pytest.mark.parametrize("made_first", ["another_users_folder", "link", "open_folder"])
def test_a_pid_folder_someone_made_first_is_refused_with_one_line(
    tmp_path: Path, made_first: str
) -> None:
    """Regression: the PID went to /tmp/elastic-train-JOB.N.pid, a name any local user could
    create first: a link to one of our files (overwritten) or a file whose PID they choose
    (then sent SIGUSR1 by us)."""
    folder = tmp_path / f"elastic-train-slurm-{os.getuid()}"
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    if made_first == "link":
        folder.symlink_to(victim)
    elif made_first == "open_folder":
        folder.mkdir()
        folder.chmod(0o777)
    else:
        if os.getuid() != 0:
            pytest.skip("creating a folder as another user needs root")
        folder.mkdir(mode=0o700)
        os.chown(folder, _second_user(), -1)
    done = run_script(tmp_path, "127.0.0.1", SLURM_JOB_NUM_NODES="1", FAKE_SRUN_RUNS="1")
    assert done.returncode == 2
    assert f"{folder} is not a private folder of ours" in done.stderr
    assert list(victim.iterdir()) == [] and not list(folder.glob("*.pid"))


def test_default_store_host_skips_the_debian_loopback_alias(tmp_path: Path) -> None:
    # /etc/hosts on Debian maps the hostname to 127.0.1.1; the interface has the real address.
    # (192.0.2.0/24 is the documentation range; nothing connects to it, the store is a stub.)
    done = run_script(tmp_path, "127.0.1.1 192.0.2.10")
    assert done.returncode == 0, done.stderr
    (store,) = recorded(tmp_path, "elastic-train")
    assert store.startswith("store --host 192.0.2.10 --port 0 ")


def test_a_loopback_store_host_is_refused_on_several_nodes(tmp_path: Path) -> None:
    done = run_script(tmp_path, "127.0.1.1")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "STORE_HOST='' cannot be reached from the other nodes" in line
    assert recorded(tmp_path, "elastic-train") == []  # nothing started

    explicit = run_script(tmp_path / "x", "192.0.2.10", STORE_HOST="127.0.0.1")
    assert explicit.returncode == 2 and "STORE_HOST='127.0.0.1'" in explicit.stderr


def test_a_single_node_job_may_use_loopback(tmp_path: Path) -> None:
    done = run_script(tmp_path, "127.0.1.1", SLURM_JOB_NUM_NODES="1")
    assert done.returncode == 0, done.stderr
    assert recorded(tmp_path, "elastic-train")[0].startswith("store --host 127.0.0.1 ")


def test_the_default_snapshot_folder_does_not_shadow_the_snapshots_package(
    tmp_path: Path,
) -> None:
    done = run_script(tmp_path, "192.0.2.10")
    assert done.returncode == 0, done.stderr
    (srun,) = recorded(tmp_path, "srun")
    folder = re.search(r"--snapshot-dir (\S+)", srun)[1]
    assert folder == f"{tmp_path}/submit/elastic-train-runs/77"
    assert "snapshots" not in Path(folder).parts


def test_the_supervisors_step_gets_the_jobs_cpus_and_gpus(tmp_path: Path) -> None:
    done = run_script(tmp_path, "192.0.2.10", SLURM_CPUS_PER_TASK="8", SLURM_GPUS_PER_NODE="a100:4")
    assert done.returncode == 0, done.stderr
    (srun,) = recorded(tmp_path, "srun")
    assert "--cpus-per-task=8 --gpus-per-node=a100:4 bash -c" in srun
    assert "--nproc-per-node auto" in srun

    plain = run_script(tmp_path / "x", "192.0.2.10")
    assert "--cpus-per-task" not in recorded(tmp_path / "x", "srun")[0], plain.stderr
