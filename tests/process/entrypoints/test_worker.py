"""The worker bootstrap behaves like ``python SCRIPT`` and skips only the finalization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_trainer.contract.protocol import ENV_SUPERVISOR_PID
from elastic_trainer.entrypoints.worker import EXIT_ORPHANED, exit_status
from tests import ROOT as TESTS_ROOT

BOOTSTRAP = [sys.executable, "-m", "elastic_trainer.entrypoints.worker"]
ROOT = str(TESTS_ROOT)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [*BOOTSTRAP, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def _script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / "scripts" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def test_the_script_sees_what_python_script_would_show_it(tmp_path):
    script = _script(
        tmp_path,
        """
        import json, sys
        out = {"argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__}
        print(json.dumps(out))
        """,
    )
    done = _run([str(script), "--flag", "x"], tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == [str(script), "--flag", "x"]
    assert seen["path0"] == str(script.parent)
    assert (seen["name"], seen["file"]) == ("__main__", str(script))


@pytest.mark.parametrize(
    ("body", "status", "stderr"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit(None)", 0, ""),
        ("import sys; sys.exit('bad input')", 1, "bad input"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("pass", 0, ""),
    ],
)
def test_exit_status_and_errors_are_those_of_python(tmp_path, body, status, stderr):
    done = _run([str(_script(tmp_path, body))], tmp_path)
    assert done.returncode == status
    assert stderr in done.stderr


def test_atexit_handlers_threads_and_open_files_are_finished_before_the_exit(tmp_path):
    out = tmp_path / "out.txt"
    script = _script(
        tmp_path,
        f"""
        import atexit, threading, time
        log = open({str(out)!r}, "w")  # never closed: the exit must flush it
        log.write("written;")
        def late():
            time.sleep(0.2)
            with open({str(out)!r} + ".thread", "w") as f:
                f.write("thread done")
        threading.Thread(target=late).start()  # non-daemon: waited for
        atexit.register(lambda: print("atexit ran", flush=True))
        """,
    )
    done = _run([str(script)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "atexit ran" in done.stdout
    assert out.read_text() == "written;"
    assert Path(f"{out}.thread").read_text() == "thread done"


def test_a_module_runs_as_with_python_dash_m(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(4)\n")
    done = _run(["-m", "mypkg.train", "a", "b"], tmp_path)
    assert done.returncode == 4, done.stderr
    assert done.stdout.strip() == "__main__ ['a', 'b']"


def test_exit_status_helper():
    assert [exit_status(c) for c in (None, 0, 7)] == [0, 0, 7]


# --- dying with the supervisor ---------------------------------------------------------------
PDEATHSIG_PROBE = """
import ctypes, signal
libc = ctypes.CDLL(None)
sig = ctypes.c_int()
libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
print(signal.Signals(sig.value).name if sig.value else "none")
"""


def _run_as_worker(tmp_path: Path, supervisor_pid: int) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin", ENV_SUPERVISOR_PID: str(supervisor_pid)}
    script = _script(tmp_path, PDEATHSIG_PROBE)
    return subprocess.run(
        [*BOOTSTRAP, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_a_worker_dies_by_sigkill_with_its_supervisor(tmp_path):
    done = _run_as_worker(tmp_path, os.getpid())  # we are its parent: the supervisor
    assert (done.returncode, done.stdout.strip()) == (0, "SIGKILL"), done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_a_worker_whose_supervisor_is_already_gone_exits_before_the_script(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is certainly not our worker's parent
    done = _run_as_worker(tmp_path, gone.pid)
    assert done.returncode == EXIT_ORPHANED and done.stdout == ""


def test_a_configuration_error_is_one_line_exit_2_and_reaches_the_error_file(tmp_path) -> None:
    """What the supervisor shows for a worker's exit 2 (job.finished error) comes from here."""
    import json

    script = tmp_path / "bad.py"
    script.write_text(
        "from elastic_trainer.errors import ConfigError\n"
        "raise ConfigError('--lr=-1 is invalid: use a number > 0')\n"
    )
    error_file = tmp_path / "error.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    done = subprocess.run(
        [sys.executable, "-m", "elastic_trainer.entrypoints.worker", str(script)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --lr=-1 is invalid: use a number > 0"
    assert "--lr=-1 is invalid" in json.dumps(json.loads(error_file.read_text()))


@pytest.mark.parametrize(("fmt", "seen"), [("json", b"Xhello\n"), ("console", b"helloX\n")])
def test_in_json_mode_a_line_reaches_stderr_in_one_write(fmt, seen):
    # Under -u, print() writes the text and the newline apart; another process's line
    # (here: a raw write to fd 2) landing between them would glue the two lines together.
    code = textwrap.dedent(
        """
        import os, sys
        from elastic_trainer.entrypoints.worker import whole_lines_on_stderr
        whole_lines_on_stderr()
        sys.stderr.write("hello")
        os.write(2, b"X")
        sys.stderr.write("\\n")
        """
    )
    env = {**os.environ, "ELASTIC_TRAIN_LOG_FORMAT": fmt}
    done = subprocess.run([sys.executable, "-u", "-c", code], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == seen
