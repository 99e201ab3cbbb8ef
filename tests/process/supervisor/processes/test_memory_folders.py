"""The in-memory tier's folders on one machine (``supervisor.processes.memory_folders``,
``workerenv``'s memory functions): a supervisor's folder is claimed while it lives, and the
next supervisor of any job frees the folders of those that died; a live one's stays."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap

import psutil
from structlog.testing import capture_logs

from elastic_trainer.private_files import private_dir
from elastic_trainer.supervisor.cli import args
from elastic_trainer.supervisor.processes import memory_folders, workerenv
from tests.conftest import clean_worker_env

SLOT_BYTES = 1 << 20

# A supervisor as far as the tier's folder goes: it makes and claims its node folder in the
# shared ``argv[1]`` for job ``argv[2]``, fills a slot, says where, and lives until its stdin
# closes (or it is killed).
SUPERVISOR = textwrap.dedent(f"""
    import os, sys
    from elastic_trainer.supervisor.cli import args
    from elastic_trainer.supervisor.processes import workerenv
    cfg = args.parse(["--job-id", sys.argv[2], "x.py"])
    folder = workerenv.prepare_memory_dir(cfg, sys.argv[1])
    with open(os.path.join(folder, "slot-0.pt"), "wb") as f:
        f.write(b"x" * {SLOT_BYTES})
    print(folder, flush=True)
    sys.stdin.read()
""")


def _supervisor(base: str, job: str) -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in clean_worker_env().items() if k != "XDG_RUNTIME_DIR"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, base, job],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    folder = proc.stdout.readline().strip()  # its folder is claimed and filled
    assert folder, f"the supervisor of {job} exited with {proc.wait()}"
    return proc, folder


def test_a_killed_supervisors_folder_is_freed_by_the_next_start_of_another_job(shared):
    dead, dead_folder = _supervisor(shared, "job-a")
    live, live_folder = _supervisor(shared, "job-b")
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        with capture_logs() as logs:
            freed = workerenv.remove_stale_memory_dirs(
                args.parse(["--job-id", "job-c", "x.py"]), shared
            )
        assert not os.path.lexists(dead_folder)
        assert not os.path.lexists(os.path.dirname(dead_folder))  # its job's folder, empty
        assert sorted(os.listdir(live_folder)) == [memory_folders.OWNER_LOCK, "slot-0.pt"]
        assert freed.folders == 1 and freed.bytes >= SLOT_BYTES
        assert [(e["event"], e["folders"]) for e in logs] == [("snapshot.memory_freed", 1)]
    finally:
        live.communicate("")  # its stdin closed: it exits without removing its folder
    assert os.path.isdir(live_folder)  # gone too now, without a SIGKILL: freed the same way
    workerenv.remove_stale_memory_dirs(args.parse(["--job-id", "job-c", "x.py"]), shared)
    assert not os.path.lexists(os.path.dirname(live_folder))


def test_a_claimed_folder_is_kept_while_its_claim_is_held_even_by_this_process(tmp_path):
    root = private_dir(str(tmp_path / "root"))
    folder = memory_folders.make_node_folder(memory_folders.node_folder(root, "j", 1))
    fd = memory_folders.claim(folder)
    assert stat.S_IMODE(os.lstat(os.path.join(folder, memory_folders.OWNER_LOCK)).st_mode) == 0o600
    assert memory_folders.still_claimed(folder, fd)
    assert memory_folders.sweep([root], lambda pid: False) == memory_folders.Freed()
    assert os.path.isdir(folder)
    os.close(fd)  # as a SIGKILL would
    assert memory_folders.sweep([root], lambda pid: True).folders == 1  # a reused PID: moot
    assert os.listdir(root) == []


def test_an_unclaimed_folder_goes_by_its_pid_and_a_planted_lock_keeps_it(tmp_path):
    """A folder of an earlier version (no lock) goes once its supervisor's PID runs no more;
    one whose lock is a link is never opened, so never proven abandoned; nothing else in a
    job's folder (a file, a link to a folder) is touched."""
    root = private_dir(str(tmp_path / "root"))
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    old = memory_folders.make_node_folder(memory_folders.node_folder(root, "j", gone.pid))
    running = memory_folders.make_node_folder(memory_folders.node_folder(root, "j", os.getpid()))
    planted = memory_folders.make_node_folder(memory_folders.node_folder(root, "k", gone.pid))
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").touch()
    os.symlink(target / "keep", os.path.join(planted, memory_folders.OWNER_LOCK))
    os.symlink(target, os.path.join(root, "j", "12345678"))
    freed = memory_folders.sweep([root], psutil.pid_exists)
    assert freed.folders == 1 and not os.path.exists(old)
    assert os.path.isdir(running) and os.path.isdir(planted)
    assert (target / "keep").exists()


def test_a_supervisor_reclaims_its_folder_if_it_was_removed_and_frees_it_at_exit(shared):
    cfg = args.parse(["--job-id", "job-own", "x.py"])
    folder = workerenv.prepare_memory_dir(cfg, shared)
    assert folder is not None and workerenv.prepare_memory_dir(cfg, shared) == folder
    shutil.rmtree(folder)  # (by hand): the next attempt makes and claims it again
    assert workerenv.prepare_memory_dir(cfg, shared) == folder
    assert os.path.isfile(os.path.join(folder, memory_folders.OWNER_LOCK))
    assert workerenv.remove_stale_memory_dirs(cfg, shared).folders == 0
    workerenv.remove_memory_dir(cfg, shared)
    assert not os.path.lexists(os.path.dirname(folder))
