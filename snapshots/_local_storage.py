"""Local (or network-mounted POSIX) storage: durable atomic file writes.

A temp file in the target folder, fsync, ``os.replace`` (or ``os.link`` for an exclusive
create), fsync the folder. fsspec transactions are not used: they stage in the system temp
dir, so their final move is a copy, not an atomic rename.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from typing import Any

from snapshots import _faults, layout
from snapshots._storage_base import Entry, within
from snapshots.errors import NotRegularFileError


def kill_point(path: str) -> str:
    return "mid_manifest" if path.endswith(layout.MANIFEST_NAME) else "mid_file"


class LocalStorage:
    """A local (or network-mounted POSIX) folder, with durable atomic file writes."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *[p for p in path.split("/") if p])

    def check(self, *, create: bool = True) -> None:
        if create:
            self._makedirs(self.root)
        elif not os.path.isdir(self.root):
            raise FileNotFoundError(errno.ENOENT, "no such folder", self.root)
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "folder is not writable", self.root)

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        target = self._abs(path)
        folder = os.path.dirname(target)
        self._makedirs(folder)
        tmp = os.path.join(folder, layout.temp_name(os.path.basename(target), os.getpid()))
        try:
            self._write_temp(tmp, data, kill_point(path))
            if exclusive:
                # link() fails with EEXIST instead of replacing: an atomic "create if absent".
                os.link(tmp, target)
                os.unlink(tmp)
            else:
                os.replace(tmp, target)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        _fsync_dir(folder)

    @staticmethod
    def _write_temp(tmp: str, data: bytes, point: str) -> None:
        view = memoryview(data).cast("B")
        half = len(view) // 2
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, view[:half])
            _faults.hit(point)
            _write_all(fd, view[half:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def _makedirs(self, folder: str) -> None:
        if os.path.isdir(folder):
            return
        parent = os.path.dirname(folder)
        if parent != folder:
            self._makedirs(parent)
        try:
            os.mkdir(folder)
        except FileExistsError:
            return
        _fsync_dir(parent)  # make the new folder's entry durable before files appear in it

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        """A regular file's bytes; at most ``limit`` of them (more: FileTooLargeError).

        Opened without following a symlink and without blocking (a FIFO), then checked with
        fstat on the open descriptor, so nothing can swap the file between check and read.
        """
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        target = self._abs(path)
        try:
            fd = os.open(target, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise NotRegularFileError(f"{path} is not a regular file ({exc.strerror})") from exc
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotRegularFileError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb") as fh:
            cap = st.st_size if limit is None else min(st.st_size, limit)
            data = fh.read(cap + 1)  # one byte more than allowed proves "too large"
        return within(path, data, cap if limit is None else limit)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with open(self._abs(path), "rb") as fh:
            fh.seek(start)
            return fh.read(length)

    def list(self, path: str = "") -> list[Entry]:
        folder = self._abs(path)
        try:
            items = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [_local_entry(item) for item in items]

    def delete(self, path: str) -> None:
        target = self._abs(path)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target, ignore_errors=False, onerror=_ignore_missing)
        else:
            _unlink_quietly(target)


def _local_entry(item: os.DirEntry[str]) -> Entry:
    try:
        st = item.stat(follow_symlinks=False)
    except FileNotFoundError:
        return Entry(name=item.name, is_dir=False)
    is_dir = item.is_dir(follow_symlinks=False)
    return Entry(
        name=item.name, is_dir=is_dir, size=None if is_dir else st.st_size, mtime=st.st_mtime
    )


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # platforms without directory fds (Windows) have no directory fsync
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _ignore_missing(func: Any, path: str, exc_info: Any) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
