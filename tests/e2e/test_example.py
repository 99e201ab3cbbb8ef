"""The README's fault-tolerance example runs as pasted, and resumes from its snapshots."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fault_tolerant_ddp.py"
STEPS_PER_EPOCH = 512 // 64  # dataset size / global batch in the example


def _run(tmp_path: Path, env: dict[str, str], epochs: int) -> list[dict]:
    log = tmp_path / f"events-{epochs}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "elastic_trainer",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--snapshot-dir",
        str(tmp_path / "snaps"),
        "--snapshot-every",
        "4",
        "--log-format",
        "json",
        "--log-file",
        str(log),
        str(EXAMPLE),
        str(epochs),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.integration
def test_example_trains_then_resumes_where_it_stopped(tmp_path, worker_env) -> None:
    first = _run(tmp_path, worker_env, epochs=1)
    saved = [e["step"] for e in first if e["event"] == "snapshot.saved"]
    assert saved[-1] == STEPS_PER_EPOCH
    second = _run(tmp_path, worker_env, epochs=2)
    restored = {e["step"] for e in second if e["event"] == "snapshot.restored"}
    assert restored == {STEPS_PER_EPOCH}
    saved = [e["step"] for e in second if e["event"] == "snapshot.saved"]
    assert saved[-1] == 2 * STEPS_PER_EPOCH


def test_readme_shows_the_example_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    match = re.search(
        r"<!-- example: examples/fault_tolerant_ddp.py -->\s*```python\n(.+?)```", readme, re.S
    )
    assert match, "README.md lacks the fault-tolerance example block"
    code = EXAMPLE.read_text()
    body = code[code.index('"""', 3) + 3 :].lstrip("\n")  # the file without its docstring
    assert match.group(1) == body
