"""Local (or network-mounted POSIX) storage: durable atomic file writes.

A temp file in the target folder, fsync, ``os.replace`` (or ``os.link`` for an exclusive
create), fsync the folder. fsspec transactions are not used: they stage in the system temp
dir, so their final move is a copy, not an atomic rename.

Two extras beyond the protocol, for the writer thread's hot path: ``write_streamed`` lets a
producer (``torch.save``) write straight into the temp file, so a snapshot is never held as
one more in-memory copy (a fresh ~state-sized buffer per save costs a page fault per 4 KiB),
and ``digest`` hashes a file through one small reused buffer, without the GIL.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import numpy as np

from snapshots.errors import NotRegularFileError
from snapshots.format import layout, manifest
from snapshots.storage import faults, modes
from snapshots.storage.base import Entry, within

T = TypeVar("T")
# Writes smaller than this are gathered (zip headers, the pickle); larger ones (tensor
# storages) go to the file as they are, with no copy. Also the digest's read size.
CHUNK = 1 << 20


def kill_point(path: str) -> str:
    return "mid_manifest" if path.endswith(layout.MANIFEST_NAME) else "mid_file"


class LocalStorage:
    """A local (or network-mounted POSIX) folder, with durable atomic file writes."""

    def __init__(
        self,
        root: str,
        *,
        direct_io: bool = True,
        reuse_files: bool = True,
        writer_process: bool = False,
        group_access: bool = False,
    ) -> None:
        """``direct_io``: large aligned writes go past the page cache (``_direct_part``).
        ``reuse_files``: a deleted snapshot's large data files are kept for the next save to
        write into (see ``REUSE_MIN``). ``writer_process``: a large save's files may be
        serialised by the writer process (``snapshots.write.writer_process``).
        ``group_access``: what is created is 0750/0640 instead of 0700/0600 (``modes``)."""
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        self.direct_io = direct_io
        self.reuse_files = reuse_files
        self.writer_process = writer_process
        self.modes = modes.modes_for(group_access)

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
        view = memoryview(data).cast("B")
        half = len(view) // 2 // DIRECT_ALIGN * DIRECT_ALIGN  # both halves may go direct

        def fill(sink: BinaryIO) -> None:
            sink.write(view[:half])  # the mid_file kill point falls between the halves
            sink.write(view[half:])

        self.write_streamed(path, fill, exclusive=exclusive)

    def write_streamed(
        self, path: str, fill: Callable[[BinaryIO], T], *, exclusive: bool = False
    ) -> T:
        """Like ``write``, with the bytes written by ``fill(file)``; returns what it returns.
        The file appears at ``path`` (atomically, durably) only once ``fill`` returned."""
        target = self._abs(path)
        folder = os.path.dirname(target)
        self._makedirs(folder)
        tmp = os.path.join(folder, layout.temp_name(os.path.basename(target), os.getpid()))
        reused = not exclusive and self._take_set_aside(os.path.basename(target), tmp)
        try:
            result = _fill_temp(
                tmp, fill, kill_point(path), direct=self.direct_io, reused=reused,
                writer_process=self.writer_process, mode=self.modes.file,
            )  # fmt: skip
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
        return result

    def _makedirs(self, folder: str) -> None:
        if os.path.isdir(folder):
            return
        parent = os.path.dirname(folder)
        if parent != folder:
            self._makedirs(parent)
        try:
            modes.make_folder(folder, self.modes.folder)  # one that exists keeps its mode
        except FileExistsError:
            return
        _fsync_dir(parent)  # make the new folder's entry durable before files appear in it

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        """A regular file's bytes; at most ``limit`` of them (more: FileTooLargeError).

        Opened without following a symlink and without blocking (a FIFO), then checked with
        fstat on the open descriptor, so nothing can swap the file between check and read.
        """
        fd, size = self._open_regular(path)
        with os.fdopen(fd, "rb") as fh:
            cap = size if limit is None else min(size, limit)
            data = fh.read(cap + 1)  # one byte more than allowed proves "too large"
        return within(path, data, cap if limit is None else limit)

    def digest(self, path: str, algorithm: str) -> tuple[int, str]:
        """(size, hex digest) of a regular file, read through one small buffer: no copy of
        the whole file in memory, and hashlib releases the GIL on each chunk."""
        fd, _ = self._open_regular(path)
        hasher = manifest.hasher(algorithm)
        buf = memoryview(bytearray(CHUNK))
        size = 0
        with os.fdopen(fd, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                hasher.update(buf[:n])
                size += n
        return size, hasher.hexdigest()

    def _open_regular(self, path: str) -> tuple[int, int]:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self._abs(path), flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise NotRegularFileError(f"{path} is not a regular file ({exc.strerror})") from exc
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotRegularFileError(f"{path} is not a regular file")
        return fd, st.st_size

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` of a regular file, opened as ``read`` opens one (a
        link or FIFO is NotRegularFileError, never followed nor waited on). A file that ends
        first is read no further than its end (``base.read_range`` names it truncated)."""
        fd, size = self._open_regular(path)
        with os.fdopen(fd, "rb") as fh:
            if start >= size:
                return b""
            fh.seek(start)
            return fh.read(min(length, size - start))

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
            self._set_aside(target)
            shutil.rmtree(target, ignore_errors=False, onerror=_ignore_missing)
        else:
            _unlink_quietly(target)

    def _set_aside(self, folder: str) -> None:
        """Move the large data files of a folder being deleted into the reuse folder, one
        per ``layout.reuse_key`` (an older one of the same key is replaced). Best effort:
        what is not moved is deleted with the folder."""
        if not self.reuse_files:
            return
        aside = os.path.join(self.root, layout.REUSE_DIR)
        try:
            items = list(os.scandir(folder))
        except OSError:
            return
        for item in items:
            key = layout.reuse_key(item.name)
            with contextlib.suppress(OSError):
                st = item.stat(follow_symlinks=False)
                if key is None or not stat.S_ISREG(st.st_mode) or st.st_size < REUSE_MIN:
                    continue
                self._makedirs(aside)
                os.replace(item.path, os.path.join(aside, key))

    def release_set_aside(self) -> int:
        """Delete the files set aside for the next save (the job has ended: there is none):
        the bytes freed. Best effort; a file another save takes meanwhile stays its."""
        aside = os.path.join(self.root, layout.REUSE_DIR)
        freed = 0
        try:
            items = list(os.scandir(aside))
        except OSError:
            return 0
        for item in items:
            with contextlib.suppress(OSError):
                size = item.stat(follow_symlinks=False).st_size
                os.unlink(item.path)
                freed += size
        with contextlib.suppress(OSError):
            os.rmdir(aside)
        return freed

    def _take_set_aside(self, name: str, tmp: str) -> bool:
        """Rename the set-aside file of ``name``'s key to ``tmp`` (atomic: of two writers
        after the same file, one gets it); False when there is none."""
        key = layout.reuse_key(name) if self.reuse_files else None
        if key is None:
            return False
        try:
            os.rename(os.path.join(self.root, layout.REUSE_DIR, key), tmp)
        except OSError:  # none set aside (or the folder is gone): a new file
            return False
        return True


def _local_entry(item: os.DirEntry[str]) -> Entry:
    try:
        st = item.stat(follow_symlinks=False)
    except FileNotFoundError:
        return Entry(name=item.name, is_dir=False)
    is_dir = item.is_dir(follow_symlinks=False)
    return Entry(
        name=item.name, is_dir=is_dir, size=None if is_dir else st.st_size, mtime=st.st_mtime
    )


def _fill_temp(
    tmp: str,
    fill: Callable[[BinaryIO], T],
    point: str,
    *,
    direct: bool,
    reused: bool = False,
    writer_process: bool = False,
    mode: int = modes.PRIVATE.file,
) -> T:
    """``reused``: ``tmp`` is a set-aside file; written over from its start and cut to what
    was written (a file that is not a plain one of ours is replaced by a new one). The file
    gets ``mode`` either way: a set-aside file may have been made under another setting."""
    fd = _open_reused(tmp) if reused else None
    if fd is None:
        fd = modes.create_file(tmp, os.O_WRONLY, mode)
    try:
        if reused:
            modes.set_mode(fd, mode)
        sink = Sink(fd, point, direct=direct, writer_process=writer_process)
        result = fill(sink)  # type: ignore[arg-type]
        sink.flush()
        if reused:
            os.ftruncate(fd, sink.written)  # the old file's tail, where it was longer
        os.fsync(fd)
    finally:
        os.close(fd)
    return result


def _open_reused(tmp: str) -> int | None:
    """A set-aside file opened for writing over, or None (then removed) unless it is a
    regular file with one link, owned by this user: nothing planted in the folder (a link
    to another file) is ever written through."""
    flags = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(tmp, flags)
    except OSError:
        _unlink_quietly(tmp)
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
        return fd
    os.close(fd)
    _unlink_quietly(tmp)
    return None


class Sink:
    """A write-only file over a descriptor: small writes gathered, large ones written as
    they are (os.write releases the GIL), past the page cache where they can be (see
    ``_write_direct``). The mid_file kill point follows the first write.

    ``writer_process``: the writer process may fill this file instead (``fileno``,
    ``adopt``; ``restart`` when it was lost midway)."""

    def __init__(
        self, fd: int, point: str | None, *, direct: bool, writer_process: bool = False
    ) -> None:
        self._fd = fd
        self._point = point
        self._small = bytearray()
        self._offset = 0  # bytes written to the file so far
        self._direct = direct and _DIRECT_FLAG != 0
        self.writer_process = writer_process

    @property
    def direct(self) -> bool:
        return self._direct

    def fileno(self) -> int:
        return self._fd

    def adopt(self, written: int) -> None:
        """Another process wrote ``written`` bytes from the file's start (nothing before)."""
        if self._offset or self._small:
            raise ValueError("adopt() is for a file that this sink has not written to")
        self._offset = written

    def restart(self) -> None:
        """Back to an empty file at offset 0, whatever was written (by another process)."""
        self._small = bytearray()
        self._offset = 0
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.ftruncate(self._fd, 0)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) < CHUNK:
            self._small += view
            if len(self._small) >= CHUNK:
                self.flush()
        else:
            self.flush()
            self._write_large(view)
        if self._point is not None:
            self.flush()
            point, self._point = self._point, None
            faults.hit(point)
        return len(view)

    @property
    def written(self) -> int:
        """Bytes in the file so far (after ``flush``)."""
        return self._offset

    def flush(self) -> None:
        if self._small:
            _write_all(self._fd, memoryview(self._small))
            self._offset += len(self._small)
            self._small = bytearray()

    def _write_large(self, view: memoryview) -> None:
        direct = _direct_part(view, self._offset) if self._direct else 0
        done = _write_direct(self._fd, view[:direct]) if direct else 0
        if direct and not done:
            self._direct = False  # this file system refuses O_DIRECT: buffered from here
        _write_all(self._fd, view[done:])
        self._offset += len(view)


# Large writes bypass the page cache (O_DIRECT) where the file offset, the memory and the
# length allow it (multiples of DIRECT_ALIGN, which covers 512- and 4096-byte sectors): a
# snapshot is read again only at a restart, and copying it into fresh page-cache pages costs
# a core a first-touch page fault per page (in a VM, often a host fault too), while the disk
# takes the buffer by DMA. Staging buffers on their own pages
# (``serialization.staging_buffer``) qualify: shard files, and the tensors of a torch.save
# file, whose records start at multiples of DIRECT_ALIGN (``serialization.serialize_into``).
# fsync still makes the file and the disk's cache durable. A file system that refuses
# O_DIRECT (tmpfs) gets buffered writes. From 1 MB up (most of a model's bytes): each
# direct write waits for the disk, so small ones stay buffered.
DIRECT_ALIGN = 4096
DIRECT_MIN = CHUNK

# A deleted snapshot's data files from this size up are not unlinked but set aside
# (``layout.REUSE_DIR``, one per entry, rank or shard: ``layout.reuse_key``), and the next
# save of the same key writes over that file. Freeing a file's blocks costs the file system
# kernel time in proportion to the file's size (seconds for a multi-GB file on ext4), taken
# from the training step it overlaps and added to the job's tail; allocating them again costs
# the write too.
# The price: about one snapshot's disk space stays reserved for the next save.
REUSE_MIN = CHUNK
_DIRECT_FLAG = getattr(os, "O_DIRECT", 0)


def _direct_part(view: memoryview, offset: int) -> int:
    """How many leading bytes of ``view``, written at ``offset``, may go direct (0: none)."""
    if offset % DIRECT_ALIGN or len(view) < DIRECT_MIN or not view.c_contiguous:
        return 0
    if _address(view) % DIRECT_ALIGN:
        return 0
    return len(view) // DIRECT_ALIGN * DIRECT_ALIGN


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _write_direct(fd: int, view: memoryview) -> int:
    """Writes ``view`` with O_DIRECT (on for this call only) until done, refused (EINVAL)
    or a short write leaves an unaligned offset; returns how many bytes it wrote."""
    import fcntl  # POSIX only, as O_DIRECT

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _DIRECT_FLAG)
    except OSError as exc:  # some file systems (FUSE) refuse the flag itself
        if exc.errno != errno.EINVAL:
            raise
        return 0
    done = 0
    try:
        while done < len(view):
            try:
                written = os.write(fd, view[done:])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                break
            done += written
            if written % DIRECT_ALIGN:
                break
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done


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
