"""The in-memory tier's folder decisions (``supervisor.processes.memory_folders``): which
roots are tried, which filesystem a path is on, which node folder is abandoned."""

from __future__ import annotations

import pytest

from elastic_trainer.supervisor.processes.memory_folders import (
    FALLBACKS,
    Claim,
    abandoned,
    filesystem_of,
    node_folder,
    root_candidates,
)
from elastic_trainer.supervisor.processes.workerenv import CONTROL_ROOT_PREFIX

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
tmpfs /run/user/1000 tmpfs rw,nosuid,nodev,size=1638000k,mode=700,uid=1000 0 0
/dev/vdb /run/user/1000/over ext4 rw 0 0
tmpfs /run/user/1000/over tmpfs rw 0 0
/dev/vdc /mnt/with\\040space xfs rw 0 0
"""


def test_the_roots_are_fixed_names_first_ours_then_numbered_then_the_runtime_folder():
    roots = root_candidates("/dev/shm", 1000, "/run/user/1000")
    assert roots[0] == "/dev/shm/elastic-train-1000"
    assert roots[1:-1] == [f"/dev/shm/elastic-train-1000.{n}" for n in range(1, FALLBACKS + 1)]
    assert roots[-1] == "/run/user/1000/elastic-train"
    assert root_candidates("/dev/shm", 1000, None) == roots[:-1]
    assert root_candidates("/dev/shm", 1000, "/run/user/1000") == roots  # every run: the same


def test_no_fallback_root_looks_like_a_control_folder_of_a_dead_supervisor():
    """Where /tmp holds both, ``remove_stale_control_roots`` removes ``elastic-train-<pid>-*``
    whose PID does not run: a root named so would be taken for one."""
    for root in root_candidates("/tmp", 1000, None):
        rest = root.rsplit("/", 1)[1][len(CONTROL_ROOT_PREFIX) :]
        pid, _dash, random_part = rest.partition("-")
        assert not (pid.isdigit() and random_part), root


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/run/user/1000", "tmpfs"),
        ("/run/user/1000/elastic-train", "tmpfs"),
        ("/run/user/10000", "ext4"),  # a longer name, not below the mount point
        ("/run/user/1000/over/x", "tmpfs"),  # mounted over: the last mount counts
        ("/dev/shm", "tmpfs"),
        ("/mnt/with space/a", "xfs"),  # /proc/mounts escapes spaces
        ("/home/u", "ext4"),
    ],
)
def test_the_filesystem_of_a_path_is_its_longest_mount_points(path, kind):
    assert filesystem_of(path, MOUNTS) == kind


def test_no_mounts_known_means_no_filesystem():
    assert filesystem_of("/run/user/1000", "") is None


def test_a_node_folder_is_abandoned_only_when_its_supervisor_is_provably_gone():
    def running(pid: int) -> bool:
        return pid == 42

    assert abandoned(Claim.FREE, "42", running)  # the lock decides, a reused PID does not
    assert not abandoned(Claim.HELD, "7", running)
    assert not abandoned(Claim.REFUSED, "7", running)  # never opened: no proof
    # without a lock (an earlier version's folder, or one being claimed): its PID
    assert abandoned(Claim.MISSING, "7", running)
    assert not abandoned(Claim.MISSING, "42", running)
    assert not abandoned(Claim.MISSING, "logs", running)  # not a supervisor's


@pytest.mark.parametrize(
    ("job_id", "name"), [("run-1.a", "run-1.a"), ("a/../b", "a_.._b"), ("..", "__"), (".", "_")]
)
def test_a_node_folder_is_always_two_levels_below_the_root(job_id, name):
    assert node_folder("/r", job_id, 7) == f"/r/{name}/7"
