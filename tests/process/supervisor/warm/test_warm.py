"""The warm pool: its decisions, its protocol with a real pool process, torch's context on it.

The pool here preloads nothing (no torch), so each test costs a fork, not an import. The
test process stands in for the supervisor: it is made a child subreaper for the test, as
``procs.guard_node`` makes the supervisor, so that forked workers become its children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from elastic_trainer.contract.config import Entrypoint, RunConfig
from elastic_trainer.supervisor.processes import procs
from elastic_trainer.supervisor.processes.workerenv import BOOTSTRAP_MODULE
from elastic_trainer.supervisor.warm import client as warm_workers
from elastic_trainer.supervisor.warm.decisions import (
    BASE_MODULES,
    SESSION_MODULES,
    import_env_mismatch,
    modules_to_preload,
    pool_argv,
    pool_refusal,
)
from elastic_trainer.supervisor.warm.launcher import WarmPool, WarmPoolUnavailable
from elastic_trainer.supervisor.warm.process import WarmProcess
from tests import ROOT as TESTS_ROOT

ROOT = str(TESTS_ROOT)
pytestmark = pytest.mark.timeout(120)


# ---- pure decisions ----------------------------------------------------------------------
def test_only_the_bootstrap_command_goes_to_the_pool():
    py = "/usr/bin/python3"
    assert pool_argv(py, ("-u", "-m", BOOTSTRAP_MODULE, "job.py", "--x"), executable=py) == [
        "job.py",
        "--x",
    ]
    assert pool_argv(py, ("-u", "-m", BOOTSTRAP_MODULE, "-m", "pkg"), executable=py) == [
        "-m",
        "pkg",
    ]
    assert pool_argv("./train.sh", ("--x",), executable=py) is None  # --no-python
    assert pool_argv(py, ("-X", "dev", "job.py"), executable=py) is None
    assert pool_argv("/other/python", ("-u", "-m", BOOTSTRAP_MODULE, "j.py"), executable=py) is None


def test_preloads_the_imports_of_our_module_but_never_the_module_run_as_main():
    builtin = modules_to_preload(["-m", "elastic_trainer.jobs.default", "--epochs", "1"])
    assert builtin[: len(BASE_MODULES)] == list(BASE_MODULES)
    assert {"elastic_trainer.jobs.models", "elastic_trainer.worker.plan"} <= set(builtin)
    # imported in the pool, runpy would run a second copy of it as __main__
    assert "elastic_trainer.jobs.default" not in builtin
    assert modules_to_preload(["-m", "their.pkg"]) == list(BASE_MODULES)


def test_preloads_only_the_safe_top_level_imports_of_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch.nn as nn, requests
            from numpy import linalg
            from . import sibling
            from elastic_trainer.worker import TrainingSession
            def f():
                import torchvision
            """
        )
    )
    assert modules_to_preload([str(script)]) == [
        *BASE_MODULES,
        "torch.nn",
        "numpy",
        "numpy.linalg",
        "elastic_trainer.worker",
        "elastic_trainer.worker.TrainingSession",  # tried: from-imports may name modules
        *SESSION_MODULES,  # behind elastic_trainer's lazy attributes
    ]
    assert modules_to_preload([str(tmp_path / "missing.py")]) == list(BASE_MODULES)


def test_a_job_that_imports_elastic_trainer_gets_the_session_preloaded(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import elastic_trainer as et\n")
    assert modules_to_preload([str(script)]) == [*BASE_MODULES, "elastic_trainer", *SESSION_MODULES]
    script.write_text("import torch\n")  # a plain torchrun script: nothing of ours
    assert modules_to_preload([str(script)]) == list(BASE_MODULES)


def test_import_time_variables_that_differ_send_a_worker_the_old_way():
    pool = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    worker = {"OMP_NUM_THREADS": "4", "PATH": "/bin", "RANK": "3", "MKL_NUM_THREADS": "2"}
    assert import_env_mismatch(pool, worker) == ["MKL_NUM_THREADS", "OMP_NUM_THREADS"]
    assert import_env_mismatch(pool, {**pool, "RANK": "0", "LOCAL_RANK": "0"}) == []


def test_no_pool_when_off_for_non_python_workers_or_without_a_subreaper():
    cfg = RunConfig()
    assert pool_refusal(cfg, subreaper=True) is None
    assert pool_refusal(RunConfig(warm_workers=False), subreaper=True) == "--no-warm-workers"
    no_python = RunConfig(entrypoint=Entrypoint(script="./run.sh", no_python=True))
    assert "--no-python" in (pool_refusal(no_python, subreaper=True) or "")
    assert "subreaper" in (pool_refusal(cfg, subreaper=False) or "")


def test_the_pool_never_forks_after_cuda_was_initialised(monkeypatch):
    import torch

    from elastic_trainer.entrypoints import warm_pool

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "CUDA" in (warm_pool.fork_refusal() or "")


def test_warm_workers_flag_and_its_variable():
    from elastic_trainer.supervisor.cli.args import parse

    assert parse(["job.py"], {}).warm_workers is True
    assert parse(["--no-warm-workers", "job.py"], {}).warm_workers is False
    assert parse(["job.py"], {"ELASTIC_TRAIN_WARM_WORKERS": "0"}).warm_workers is False
    on = parse(["--warm-workers", "job.py"], {"ELASTIC_TRAIN_WARM_WORKERS": "0"})
    assert on.warm_workers is True  # a flag wins over its variable


# ---- a real pool -------------------------------------------------------------------------
@pytest.fixture
def subreaper():
    if not procs.become_subreaper():
        pytest.skip("needs Linux: workers are re-parented to a child subreaper")
    yield
    procs.become_subreaper(False)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_TRAIN_SUPERVISOR_PID"}
    env["PYTHONPATH"] = ROOT + os.pathsep + extra.pop("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture
def pool(subreaper, monkeypatch):
    # our environment is the pool's, as a supervisor's is: workers match its import-time vars
    monkeypatch.delenv("ELASTIC_TRAIN_SUPERVISOR_PID", raising=False)
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    started = WarmPool.start([])
    assert started.wait_ready(60), started.failure
    yield started
    started.close()


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


REPORT = """
    import json, os, sys
    print(json.dumps({"argv": sys.argv, "ppid": os.getppid(), "sid": os.getsid(0),
                      "pid": os.getpid(), "rank": os.environ.get("RANK"), "cwd": os.getcwd(),
                      "main": __name__}))
    sys.exit(int(os.environ.get("EXIT", "0")))
"""


def _spawn(pool: WarmPool, tmp_path: Path, argv: list[str], **env: str) -> tuple[int, Path]:
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.txt"
    with open(out, "w") as f:
        pid = pool.spawn(argv, _env(**env), [0, f.fileno(), 2])
    return pid, out


def test_a_worker_runs_its_script_as_our_child_in_a_session_of_its_own(pool, tmp_path, monkeypatch):
    script = _script(tmp_path, REPORT)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    pid, out = _spawn(pool, tmp_path, [script, "--lr", "1"], RANK="5", EXIT="3")
    assert WarmProcess(pid).wait(60) == 3  # the script's status, reaped by us
    seen = json.loads(out.read_text())
    assert seen["argv"] == [script, "--lr", "1"] and seen["main"] == "__main__"
    assert seen["ppid"] == os.getpid()  # re-parented to the "supervisor", not the pool
    assert seen["sid"] == seen["pid"] == pid  # torch's start_new_session
    assert (seen["rank"], seen["cwd"]) == ("5", str(work))


def test_a_worker_starts_with_the_pools_objects_out_of_the_collectors_sight(pool, tmp_path):
    """gc.freeze before fork: a worker's collections (one at its exit) skip what the pool
    imported, so an exit does not walk torch's objects (about a second on a loaded machine)."""
    script = _script(tmp_path, "import gc\nprint(gc.get_freeze_count())\n")
    pid, out = _spawn(pool, tmp_path, [script])
    assert WarmProcess(pid).wait(60) == 0
    assert int(out.read_text()) > 1000  # the pool's interpreter and its imports


def test_a_worker_that_buffers_its_stdout_still_has_it_written_at_exit(pool, tmp_path):
    # sys.stdout is the pool's object, frozen out of gc.get_objects: flushed by name
    body = "import sys\nsys.stdout.reconfigure(write_through=False)\nprint('last', end='')\n"
    pid, out = _spawn(pool, tmp_path, [_script(tmp_path, body)])
    assert WarmProcess(pid).wait(60) == 0
    assert out.read_text() == "last"


def test_a_worker_killed_reports_the_signal_and_wait_times_out_while_it_runs(pool, tmp_path):
    script = _script(tmp_path, "import sys\nsys.stdin.read()\n")
    read_end, write_end = os.pipe()  # stdin that never ends: the worker blocks
    try:
        pid = pool.spawn([script], _env(), [read_end, 1, 2])
        proc = WarmProcess(pid)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        assert proc.poll() is None
        warm_workers.WarmHandler(proc, 0).close(signal.SIGKILL)  # killpg, as torch does
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        os.close(read_end)
        os.close(write_end)


def test_run_gives_what_subprocess_run_gives_without_a_new_interpreter(pool, tmp_path):
    body = """
        import os, sys
        print("out", os.getppid(), sys.argv[1:])
        print("err", file=sys.stderr)
        sys.exit(3)
    """
    script = _script(tmp_path, body)
    done = pool.run([script, "--x"], _env(), timeout_s=60)
    assert (done.returncode, done.stderr) == (3, "err\n")
    assert done.stdout == f"out {os.getpid()} ['--x']\n"  # forked, re-parented to us


def test_run_kills_and_reaps_what_outlasts_its_timeout(pool, tmp_path):
    pid_file = tmp_path / "pid"
    body = (
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        pool.run([_script(tmp_path, body)], _env(), timeout_s=2)
    with pytest.raises(ProcessLookupError):  # killed and reaped: not even a zombie is left
        os.kill(int(pid_file.read_text()), 0)


def test_run_leaves_the_ready_event_to_the_first_workers_start(subreaper, tmp_path):
    """The preflight's fork comes before any worker, and a refused flag must end the start
    with its one line on stderr: no warm_pool.ready before it."""
    pool = WarmPool.start([], env=_env())
    try:
        with capture_logs() as logs:
            assert pool.run([_script(tmp_path, REPORT)], _env(), timeout_s=60).returncode == 0
            assert logs == []
            assert pool.wait_ready(60) and pool.wait_ready(60)
        assert [e["event"] for e in logs] == ["warm_pool.ready"]  # once
        assert logs[0]["pid"] == pool.pid and logs[0]["import_s"] >= 0
    finally:
        pool.close()


def test_run_on_a_pool_given_up_raises_for_the_caller_to_start_it_fresh(subreaper, tmp_path):
    pool = WarmPool.start([], env=_env())
    pool.proc.kill()
    pool.proc.wait()
    with capture_logs(), pytest.raises(WarmPoolUnavailable):
        pool.run([_script(tmp_path, REPORT)], _env(), timeout_s=60)
    pool.close()


def test_a_pool_with_a_thread_refuses_to_fork_and_is_given_up(subreaper, tmp_path):
    (tmp_path / "threaded.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"
    )
    pool = WarmPool.start(["threaded"], env=_env(PYTHONPATH=str(tmp_path)))
    try:
        assert pool.wait_ready(60)
        with capture_logs() as logs, pytest.raises(WarmPoolUnavailable, match="threads"):
            _spawn(pool, tmp_path, [_script(tmp_path, REPORT)])
        assert pool.failure is not None and "single-threaded" in pool.failure
        assert [e["event"] for e in logs] == ["warm_pool.unavailable"]
        assert logs[0]["log_level"] == "warning"
        assert "pays python and its imports again" in logs[0]["cost"]
        with pytest.raises(WarmPoolUnavailable):  # for good: the next worker starts fresh
            _spawn(pool, tmp_path, [_script(tmp_path, REPORT)])
    finally:
        pool.close()


def test_a_torch_pool_is_warmed_up_once_and_stays_single_threaded(subreaper, tmp_path):
    """The first optimizer step of a process imports torch._dynamo (seconds): the pool pays
    it once, a forked worker finds it imported; and the warm-up started no thread."""
    pool = WarmPool.start(["torch"], env=_env())
    try:
        with capture_logs() as logs:
            assert pool.wait_ready(120), pool.failure
        body = """
            import json, sys, torch
            before = "torch._dynamo" in sys.modules
            param = torch.nn.Parameter(torch.ones(2))
            opt = torch.optim.AdamW([param])
            param.sum().backward()
            opt.step()
            print(json.dumps({"before": before, "after": "torch._dynamo" in sys.modules}))
        """
        pid, out = _spawn(pool, tmp_path, [_script(tmp_path, body)])
        assert WarmProcess(pid).wait(120) == 0
        assert json.loads(out.read_text()) == {"before": True, "after": True}
        assert logs[-1]["event"] == "warm_pool.ready" and logs[-1]["warm_up_s"] > 0
        assert len(os.listdir(f"/proc/{pool.pid}/task")) == 1  # native threads too
    finally:
        pool.close()


THREADS = """
    import json, os, numpy, torch
    a = numpy.ones((512, 512))
    a @ a  # a forked worker starts numpy's BLAS threads here, a fresh one at import
    print(json.dumps({"torch": torch.get_num_threads(), "os": len(os.listdir("/proc/self/task"))}))
"""


def test_a_torch_pool_serves_where_no_thread_variable_is_set(subreaper, tmp_path, monkeypatch):
    """Users set no OMP_NUM_THREADS: then numpy's OpenBLAS (imported by torch) starts a thread
    per core at import, and a pool left so could fork nothing. Its worker gets the thread
    counts a fresh worker would have: torch's, and numpy's BLAS threads (OS threads)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    script = _script(tmp_path, THREADS)
    fresh = subprocess.run(
        [sys.executable, script], env=_env(), capture_output=True, text=True, check=True
    )
    pool = WarmPool.start(["torch"], env=_env())
    try:
        assert pool.wait_ready(120), pool.failure
        pid, out = _spawn(pool, tmp_path, [script])
        assert WarmProcess(pid).wait(120) == 0
        assert json.loads(out.read_text()) == json.loads(fresh.stdout)
    finally:
        pool.close()


def test_the_warm_up_runs_no_backward(monkeypatch):
    """The autograd engine's first run would count CUDA devices (driver initialised before
    fork) and start one thread per device: on a GPU node the pool could fork nothing."""
    import torch

    from elastic_trainer.entrypoints import warm_pool

    calls = []
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: calls.append(a))
    assert warm_pool.warm_up() > 0
    assert calls == []


def test_a_pool_without_torch_has_nothing_to_warm_up():
    assert "torch" in sys.modules  # this test process imported it: look at a fresh one
    code = "from elastic_trainer.entrypoints import warm_pool; import sys; "
    code += "print(warm_pool.warm_up(), 'torch' in sys.modules)"
    env = _env()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["0.0", "False"], done.stderr


def test_a_dead_pool_is_given_up_and_a_closed_one_exits(subreaper, tmp_path):
    pool = WarmPool.start([], env=_env())
    assert pool.wait_ready(60)
    pool.proc.kill()
    pool.proc.wait()
    with pytest.raises(WarmPoolUnavailable, match=r"exited|socket|listening"):
        _spawn(pool, tmp_path, [_script(tmp_path, REPORT)])
    assert not pool.wait_ready(1)
    other = WarmPool.start([], env=_env())
    assert other.wait_ready(60)
    other.close()  # EOF on its socket ends its loop
    assert other.proc.returncode == 0


def test_a_closed_pool_exits_without_finalizing_what_it_imported(subreaper, tmp_path, capfd):
    # what torch with triton does at finalization: print on the supervisor's stderr
    (tmp_path / "noisy.py").write_text(
        "import atexit, sys\natexit.register(lambda: print('leaked', file=sys.stderr))\n"
    )
    pool = WarmPool.start(["noisy"], env=_env(PYTHONPATH=str(tmp_path)))
    assert pool.wait_ready(60)
    pool.close()
    assert pool.proc.returncode == 0
    assert "leaked" not in capfd.readouterr().err


def test_a_pool_that_never_gets_ready_is_given_up_after_the_timeout(subreaper):
    pool = WarmPool.start([], env=_env())
    try:
        with capture_logs() as logs:
            assert not pool.wait_ready(0)
        assert "not ready" in (pool.failure or "")
        assert logs[-1]["event"] == "warm_pool.unavailable"
    finally:
        pool.close()


# ---- torch's context on the pool ---------------------------------------------------------
def _start_processes(pool: WarmPool, tmp_path: Path, entrypoint: str, args: tuple, **env: str):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    calls = []

    def original(**kwargs):
        calls.append(kwargs)
        from torch.distributed.elastic.multiprocessing import start_processes

        return start_processes(**kwargs)

    context = warm_workers.start_processes(
        original,
        pool,
        name="trainer",
        entrypoint=entrypoint,
        args={0: args, 1: args},
        envs={0: {"RANK": "0", **env}, 1: {"RANK": "1", **env}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL),
        log_line_prefixes=None,
        start_method="spawn",
        numa_options=None,
        duplicate_stdout_filters=None,
        duplicate_stderr_filters=None,
    )
    return context, calls


def test_torch_context_runs_warm_workers_with_its_log_files(pool, tmp_path):
    script = _script(tmp_path, "import os\nprint('rank', os.environ['RANK'])\n")
    args = ("-u", "-m", BOOTSTRAP_MODULE, script)
    context, calls = _start_processes(pool, tmp_path, sys.executable, args)
    result = context.wait(60, period=0.05)
    assert calls == [] and result is not None and not result.is_failed()
    handlers = context.subprocess_handlers
    assert warm_workers.all_warm({lr: h.proc for lr, h in handlers.items()})
    assert context.pids() == {lr: h.proc.pid for lr, h in handlers.items()}
    for rank in (0, 1):  # torch's per-rank stdout.log, written by the forked worker
        assert Path(result.stdouts[rank]).read_text() == f"rank {rank}\n"


def test_torch_context_starts_the_old_way_what_the_pool_cannot_serve(pool, tmp_path):
    script = _script(tmp_path, "import os\nprint('rank', os.environ['RANK'])\n")
    args = ("-u", "-m", BOOTSTRAP_MODULE, script)
    mismatch = {"OMP_NUM_THREADS": str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)}
    context, _ = _start_processes(pool, tmp_path, sys.executable, args, **mismatch)
    result = context.wait(60, period=0.05)
    assert result is not None and not result.is_failed()
    procs_ = [h.proc for h in context.subprocess_handlers.values()]
    assert all(isinstance(p, subprocess.Popen) for p in procs_)
    assert Path(result.stdouts[1]).read_text() == "rank 1\n"
    context, calls = _start_processes(pool, tmp_path / "b", "/bin/echo", ("hi",))
    assert context.wait(60, period=0.05) is not None
    assert len(calls) == 0 and not warm_workers.all_warm(
        {lr: h.proc for lr, h in context.subprocess_handlers.items()}
    )


def test_torch_context_closes_warm_workers_like_its_own(pool, tmp_path):
    script = _script(tmp_path, "import time\ntime.sleep(600)\n")
    context, _ = _start_processes(
        pool, tmp_path, sys.executable, ("-u", "-m", BOOTSTRAP_MODULE, script)
    )
    assert context.wait(0) is None  # running
    context.close(signal.SIGTERM, timeout=30)
    codes = [h.proc.poll() for h in context.subprocess_handlers.values()]
    assert codes == [-signal.SIGTERM, -signal.SIGTERM]


def test_the_start_processes_swap_is_undone_even_on_error():
    from torch.distributed.elastic.agent.server import local_elastic_agent

    from elastic_trainer.supervisor import torch_compat

    original = local_elastic_agent.start_processes
    seen = []
    with (
        pytest.raises(RuntimeError),
        torch_compat.processes_started_by(lambda orig, **kw: seen.append((orig, kw))),
    ):
        local_elastic_agent.start_processes(name="x")
        raise RuntimeError("boom")
    assert seen == [(original, {"name": "x"})]
    assert local_elastic_agent.start_processes is original


def test_a_pool_whose_supervisor_left_while_it_imported_ends_quietly():
    """Regression: a supervisor that ends on a bad flag while its pool still imports torch
    (the pool starts first) got the pool's ConnectionResetError traceback on its stderr,
    glued to its own one-line error."""
    import socket

    from elastic_trainer.supervisor.warm.launcher import POOL_MODULE

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pool = subprocess.Popen(
        [sys.executable, "-u", "-m", POOL_MODULE, str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    ours.close()  # the supervisor is gone before the pool could say it is ready
    _, stderr = pool.communicate(timeout=120)
    assert pool.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
