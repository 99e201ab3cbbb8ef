"""The modes of the folders and files local storage creates: the job's user's alone.

A snapshot holds the model, and ``owner.json`` the run's token and lineage; under the
usual umask (022) they would be 0644 files in 0755 folders, readable by every local user.
So every folder this package creates is 0700 and every file 0600, or 0750 and 0640 with
group access (``storage_options={"group_access": True}``: the group may read, never
write). The mode is set on what was just created, through a descriptor (``fchmod``), so
no umask widens or narrows it, and the process's umask (the training script's own) is
never changed. A folder that already exists keeps its mode: its owner chose it.

Object stores have no modes: their access is the bucket's policy.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# What a file system without modes (vfat, some FUSE or SMB mounts) answers to chmod. The mode
# given at creation, less the umask, stands then: never wider than the one asked for.
_NO_MODES = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL}


@dataclass(frozen=True)
class Modes:
    folder: int
    file: int


PRIVATE = Modes(folder=0o700, file=0o600)
GROUP = Modes(folder=0o750, file=0o640)


def modes_for(group_access: bool) -> Modes:
    return GROUP if group_access else PRIVATE


def make_folder(path: str, mode: int) -> None:
    """Create the folder ``path`` (its parent exists) with exactly ``mode``.
    FileExistsError when something is there already (left as it is)."""
    os.mkdir(path, mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC)
    try:
        set_mode(fd, mode)
    finally:
        os.close(fd)


def create_file(path: str, flags: int, mode: int) -> int:
    """A descriptor of the new file ``path`` (``O_EXCL``: never one that exists), of
    exactly ``mode``."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        set_mode(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def set_mode(fd: int, mode: int) -> None:
    """``fchmod``, where the file system has modes."""
    try:
        os.fchmod(fd, mode)
    except OSError as exc:
        if exc.errno not in _NO_MODES:
            raise
