"""Process titles with the real setproctitle, in real processes: what ``ps`` shows, and the
environment the node sentinel reads (/proc/PID/environ) left intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPORT = textwrap.dedent(
    """
    import json, sys
    def read(name):
        with open("/proc/self/" + name, "rb") as f:
            return f.read()
    print(json.dumps({
        "cmdline": read("cmdline").replace(b"\\0", b" ").decode().strip(),
        "comm": read("comm").decode().strip(),
        "environ": read("environ").decode(errors="replace").split("\\0"),
        "argv": sys.argv,
    }))
    """
)

WORKER_MODULE = "elastic_trainer.entrypoints.worker"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SPT_NOENV")}
    return {**env, **extra}


def test_a_worker_shows_its_rank_and_script_before_the_script_runs(tmp_path) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    done = subprocess.run(
        [sys.executable, "-u", "-m", WORKER_MODULE, str(script), "--lr", "1"],
        env=_env(RANK="3", MARK="ours"), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    seen = json.loads(done.stdout)
    assert seen["cmdline"] == f"elastic-train worker 3: {script} --lr 1"
    assert seen["comm"] == "et-worker 3"
    assert "MARK=ours" in seen["environ"]  # what the sentinel finds our processes by
    assert seen["argv"] == [str(script), "--lr", "1"]  # the script's own view is unchanged


def test_a_title_longer_than_the_command_line_is_cut_and_the_environment_stays() -> None:
    code = (
        "from elastic_trainer import proc_title; "
        "proc_title.set_title(proc_title.Title('elastic-train ' + 'x' * 4000, 'et-x'))\n" + REPORT
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(MARK="ours"),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    seen = json.loads(done.stdout)
    assert seen["cmdline"].startswith("elastic-train xxx")
    assert len(seen["cmdline"]) < 4000  # cut to the room of the original command line
    assert seen["comm"] == "et-x"
    assert "MARK=ours" in seen["environ"]
