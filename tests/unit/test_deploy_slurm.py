"""deploy/slurm/elastic-train.sbatch: the #SBATCH directives the preemption story relies on.

The script's behaviour is tested on a real local Slurm in tests/e2e/test_store_slurm.py.
"""

from __future__ import annotations

import re
from pathlib import Path

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
    assert re.search(r"srun --overlap .*\\\n\s+bash -c 'kill -USR1 \"\$\(<\"\$0\"\)\"'", text)
    assert 'echo "$$" >"$0" && exec "$@"' in text  # the supervisor's PID, per node
    assert 'kill -USR1 "$srun_pid"' not in text


def test_the_store_outlives_slurms_sigterm_long_enough() -> None:
    match = re.search(r"--linger (\d+)", SCRIPT.read_text())
    assert match and int(match[1]) > SUPERVISOR_GRACE_S
