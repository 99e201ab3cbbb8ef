"""Folders and files of ours in places every local user can write (``/dev/shm``, ``/tmp``).

Another user can create a name there before we do, or swap a file we left for a symbolic
link to one of root's files. So a folder is used only once it is checked to be a real
folder (not a link), owned by us, with no permission for anyone else; a file only through a
descriptor opened with ``O_NOFOLLOW`` and checked the same way (``fstat`` of what was
opened, not of a name that can change under us). Inside a folder that passes, nobody else
can add, rename or remove anything, which is what makes the names below it safe to use.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import IO

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class NotOursError(PermissionError):
    """A folder or file that is not ours alone: never read, written or followed."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path = path


def _why_not_ours(st: os.stat_result, *, want_dir: bool) -> str | None:
    if want_dir and not stat.S_ISDIR(st.st_mode):
        return "is not a folder (a link or another kind of file)"
    if not want_dir and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: other users may use it"
    return None


def check_private_dir(path: str) -> None:
    """NotOursError unless ``path`` is a folder (not a link to one) of ours, mode 0700."""
    reason = _why_not_ours(os.lstat(path), want_dir=True)
    if reason is not None:
        raise NotOursError(path, reason)


def private_dir(path: str) -> str:
    """``path``, created mode 0700 if missing (its parent must exist), then checked."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_DIR_MODE)
    check_private_dir(path)
    return path


def private_dirs(path: str) -> str:
    """``path`` and every missing folder above it created mode 0700; ``path`` checked.
    Only below a folder already checked private (``private_dir``): the folders above
    ``path`` that exist are not checked here."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        private_dirs(parent)
    return private_dir(path)


def _open(path: str, flags: int) -> int:
    if not flags & os.O_CREAT:
        return os.open(path, flags)
    try:
        return os.open(path, flags & ~os.O_CREAT)
    except FileNotFoundError:
        return os.open(path, flags | os.O_EXCL, PRIVATE_FILE_MODE)


def open_private(path: str, flags: int) -> int:
    """A descriptor of the regular file ``path`` of ours, mode 0600, opened without
    following a link; with ``os.O_CREAT`` a missing file is created (``O_EXCL``: never one
    someone puts there in between). NotOursError for anything else, closed."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = _open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise NotOursError(path, "is a symbolic link") from exc
        raise
    reason = _why_not_ours(os.fstat(fd), want_dir=False)
    if reason is not None:
        os.close(fd)
        raise NotOursError(path, reason)
    return fd


_MODES = {
    "r": os.O_RDONLY,
    "rb": os.O_RDONLY,
    "w": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "wb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


def open_file(path: str, mode: str) -> IO:  # type: ignore[type-arg]
    """``open(path, mode)`` through ``open_private``. Writing modes create a new file only
    (a temporary name, then ``os.replace``): "w" never writes into an existing file."""
    flags = _MODES[mode]
    if flags & os.O_CREAT:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    else:
        fd = open_private(path, flags)
    return os.fdopen(fd, mode)
