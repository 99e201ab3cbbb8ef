"""The in-memory tier against another local user: folders and files in shared places are
used only when they are ours alone (``elastic_trainer.private_files``). The second user,
``other``, is ``tests/process/conftest.py``'s."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from elastic_trainer.private_files import (
    NotOursError,
    open_file,
    open_private,
    private_dir,
    private_dirs,
)
from elastic_trainer.supervisor.processes import memory_folders, workerenv
from elastic_trainer.worker.memory.rank_slots import RankSlots
from elastic_trainer.worker.memory.slots import NodeCopies
from tests.local_users import as_user, refused_all

SECRET = b"root's secret\n"


@pytest.fixture
def victim(tmp_path) -> str:
    """A root-only file in a root-only folder: what an attacker points a link at."""
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    path = folder / "victim"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return str(path)


# --- the checks themselves ------------------------------------------------------------------
def test_a_folder_open_to_others_or_a_link_is_refused_and_a_fresh_one_is_private(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(NotOursError, match="mode 0777"):
        private_dir(str(open_dir))
    (tmp_path / "link").symlink_to(open_dir)
    with pytest.raises(NotOursError, match="not a folder"):
        private_dir(str(tmp_path / "link"))
    made = private_dirs(str(tmp_path / "a" / "b"))
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(tmp_path / "a").st_mode) == 0o700


def test_a_folder_of_another_user_is_refused(tmp_path, other):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, other.pw_uid, other.pw_gid)
    with pytest.raises(NotOursError, match=f"owned by uid {other.pw_uid}"):
        private_dir(str(theirs))


def test_a_link_is_never_followed_and_a_file_open_to_others_never_read(tmp_path, victim):
    link = tmp_path / "slot-a"
    link.symlink_to(victim)
    for flags in (os.O_RDONLY, os.O_RDWR | os.O_CREAT):
        with pytest.raises(NotOursError, match="symbolic link"):
            open_private(str(link), flags)
    with pytest.raises(FileExistsError):
        open_file(str(link), "w")  # a new file only: never writes through a planted name
    shared_file = tmp_path / "marker"
    shared_file.write_text("{}")
    shared_file.chmod(0o666)
    with pytest.raises(NotOursError, match="mode 0666"):
        open_file(str(shared_file), "r")
    assert Path(victim).read_bytes() == SECRET
    fd = open_private(str(tmp_path / "new"), os.O_RDWR | os.O_CREAT)
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o600


# --- the tier's folder in a shared place ---------------------------------------------------------
def test_a_root_folder_another_user_made_first_is_not_used(shared, other, victim):
    job = os.path.join(shared, f"elastic-train-{os.geteuid()}", "shm-attack", str(os.getpid()))
    planted = as_user(
        other,
        f"import os; os.makedirs({job!r}); "
        f"[os.chmod(p, 0o777) for p in ({job!r}, os.path.dirname({job!r}), "
        f"os.path.dirname(os.path.dirname({job!r})))]; "
        f"os.symlink({victim!r}, os.path.join({job!r}, 'slot-0.pt'))",
    )
    assert planted.returncode == 0, planted.stderr
    with capture_logs() as logs:
        root = workerenv.memory_root(shared, os.geteuid())
    assert root != os.path.dirname(os.path.dirname(job))
    assert [e["event"] for e in logs] == ["snapshot.memory_refused"]
    assert f"owned by uid {other.pw_uid}" in logs[0]["reason"]
    folder = os.path.join(root, "shm-attack", str(os.getpid()))
    private_dirs(folder)
    NodeCopies(folder).write(1, {"weights": bytes(range(256)) * 64})
    assert Path(victim).read_bytes() == SECRET
    assert NodeCopies(folder).newest() == 1


# One supervisor start's choice of the tier's root, in a process of its own (as a later run
# is): the root it uses and the events it logged, as JSON.
CHOOSE_ROOT = """
import json, os, sys
from structlog.testing import capture_logs
from elastic_trainer.supervisor.processes import workerenv
with capture_logs() as logs:
    root = workerenv.memory_root(sys.argv[1], os.geteuid())
print(json.dumps({"root": root, "events": logs}))
"""


def _a_run_chooses_root(base: str, runtime_dir: str | None = None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    if runtime_dir is not None:
        env["XDG_RUNTIME_DIR"] = runtime_dir
    done = subprocess.run([sys.executable, "-c", CHOOSE_ROOT, base], env=env,
                          capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return json.loads(done.stdout)


def test_every_run_finds_the_same_private_fallback_when_another_user_holds_the_root(shared, other):
    """Another user's ``elastic-train-<uid>``: each supervisor start used to make a new
    random folder that no later run found or freed. Two runs now use the same one."""
    ours = os.path.join(shared, f"elastic-train-{os.geteuid()}")
    planted = as_user(other, f"import os; os.mkdir({ours!r}); os.chmod({ours!r}, 0o777)")
    assert planted.returncode == 0, planted.stderr
    first, second = _a_run_chooses_root(shared), _a_run_chooses_root(shared)
    assert first["root"] == second["root"] == f"{ours}.1"
    for run in (first, second):
        (event,) = run["events"]
        assert event["event"] == "snapshot.memory_refused"
        assert (event["path"], event["using"]) == (ours, f"{ours}.1")
    st = os.lstat(first["root"])
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    folder = os.path.join(first["root"], "job", "1")
    NodeCopies(private_dirs(folder)).write(1, {"weights": b"the model" * 1000})
    attempt = refused_all(
        other,
        listed=[first["root"], folder],
        read=[os.path.join(folder, "slot-0.pt")],
    )
    assert attempt.returncode == 0, attempt.stdout + attempt.stderr
    assert sorted(os.listdir(shared)) == [
        f"elastic-train-{os.geteuid()}",
        f"elastic-train-{os.geteuid()}.1",
    ]


def test_with_every_numbered_root_taken_a_private_tmpfs_runtime_folder_or_none(
    shared, other, tmp_path
):
    """A squatter of all the fixed names makes no run create a folder it cannot find
    again: ``$XDG_RUNTIME_DIR/elastic-train`` where that is ours and on tmpfs, else no tier."""
    names = memory_folders.root_candidates(shared, os.geteuid(), None)
    planted = as_user(other, f"import os; [os.mkdir(p) for p in {names!r}]")
    assert planted.returncode == 0, planted.stderr
    on_disk = private_dir(str(tmp_path / "runtime"))  # tmp_path: not tmpfs here
    if memory_folders.filesystem_of(on_disk, memory_folders.read_mounts()) == "tmpfs":
        pytest.skip("the temporary folder is on tmpfs here")
    for runtime_dir in (None, on_disk):
        run = _a_run_chooses_root(shared, runtime_dir)
        assert run["root"] is None and run["events"][0]["using"] is None
    assert not os.path.exists(os.path.join(on_disk, "elastic-train"))
    runtime = private_dir(os.path.join(shared, "runtime"))  # a private folder on tmpfs
    if memory_folders.filesystem_of(runtime, memory_folders.read_mounts()) != "tmpfs":
        pytest.skip("no tmpfs here")
    chosen = [_a_run_chooses_root(shared, runtime)["root"] for _ in range(2)]
    assert chosen == [os.path.join(runtime, "elastic-train")] * 2
    assert stat.S_IMODE(os.lstat(chosen[0]).st_mode) == 0o700
    assert len(os.listdir(shared)) == len(names) + 1  # theirs, and the runtime folder


def test_another_user_can_neither_read_a_copy_nor_swap_a_link_in(shared, other, victim):
    folder = os.path.join(workerenv.memory_root(shared, os.geteuid()), "job", "1")
    private_dirs(folder)
    NodeCopies(folder).write(1, {"weights": b"the model" * 1000})
    attempt = as_user(
        other,
        "import os, sys\n"
        f"folder = {folder!r}\n"
        "for act in (lambda: open(os.path.join(folder, 'slot-0.pt'), 'rb').read(),\n"
        "            lambda: os.listdir(folder),\n"
        f"            lambda: os.symlink({victim!r}, os.path.join(folder, 'slot-1.pt')),\n"
        "            lambda: os.rename(os.path.join(folder, 'slot-0.pt'), folder + '.x')):\n"
        "    try:\n"
        "        act()\n"
        "    except PermissionError:\n"
        "        continue\n"
        "    sys.exit('allowed')\n",
    )
    assert attempt.returncode == 0, attempt.stdout + attempt.stderr
    NodeCopies(folder).write(2, {"weights": b"the model" * 1000})
    assert NodeCopies(folder).newest() == 2
    assert Path(victim).read_bytes() == SECRET


# --- planted files inside a folder (a user who could get in, or our own folder's mode) --------
def test_a_planted_marker_of_another_user_is_never_restored(tmp_path, other):
    folder = private_dirs(str(tmp_path / "node"))
    NodeCopies(folder).write(1, {"weights": b"good"})
    for name in os.listdir(folder):
        if name.endswith(".json"):  # a part marker: handed to the other user
            os.chown(os.path.join(folder, name), other.pw_uid, other.pw_gid)
    with capture_logs() as logs:
        assert NodeCopies(folder).newest() is None
    assert "snapshot.memory_refused" in [e["event"] for e in logs]


def test_a_slot_swapped_for_a_link_mid_run_is_not_written_through(tmp_path, victim):
    folder = private_dirs(str(tmp_path / "node"))
    copies = NodeCopies(folder)
    copies.write(1, {"weights": b"x" * 4096})
    copies.unmap()  # the next copy opens the slot file again
    slot = copies.slots["slot-1.pt"].path  # the slot the next copy goes to
    if os.path.exists(slot):
        os.unlink(slot)
    os.symlink(victim, slot)
    with pytest.raises(NotOursError):
        copies.write(2, {"weights": b"y" * 4096})
    assert Path(victim).read_bytes() == SECRET
    assert copies.newest() == 1


def test_a_slot_swapped_for_a_link_is_not_reserved_through(tmp_path, victim):
    folder = private_dirs(str(tmp_path / "node"))
    copies = NodeCopies(folder)
    os.symlink(victim, copies.slots["slot-0.pt"].path)  # the slot the first copy goes to
    with pytest.raises(NotOursError):
        copies.reserve(1 << 20)
    assert Path(victim).read_bytes() == SECRET


def test_a_rank_marker_open_to_others_is_not_read(tmp_path):
    folder = private_dirs(str(tmp_path / "rank"))
    slots = RankSlots(folder)
    slots.write(1, 2, {"w": b"abc"})
    assert [c.step for c in slots.copies()] == [1]
    marker = "committed.json"
    os.chmod(os.path.join(folder, marker), 0o666)
    with capture_logs() as logs:
        assert slots.copies() == []
    assert [e["event"] for e in logs] == ["snapshot.memory_refused"]
