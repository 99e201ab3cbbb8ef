"""One exception root for the snapshots package; each failure family is a subclass."""

from __future__ import annotations


class SnapshotError(Exception):
    """Root of every error raised by the snapshots package."""


class StorageError(SnapshotError):
    """The storage behind a URL failed or cannot be reached (after retries)."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot failed verification (size, checksum, manifest) or could not be loaded safely."""


class NotRegularFileError(SnapshotCorruptError):
    """A path that must be a regular file is a FIFO, a device, a symlink or a folder."""


class FileTooLargeError(SnapshotCorruptError):
    """A file holds more bytes than its manifest (or the manifest size cap) allows."""


class NoValidSnapshotError(SnapshotError):
    """Snapshots exist at the URL, but none of them passes verification."""


class SnapshotSaveError(SnapshotError):
    """A save failed. Raised by ``SaveHandle.result()``, ``wait()``, ``close()`` and, for an
    earlier asynchronous save, by the next ``save()`` *after* it started the new save
    (``handle`` is that new save's handle, so catching and ignoring this error loses nothing)."""

    def __init__(self, message: str, *, step: int | None = None, handle: object = None) -> None:
        super().__init__(message)
        self.step = step
        self.handle = handle


class SnapshotExistsError(SnapshotSaveError):
    """A committed snapshot already holds this step; committed snapshots are never overwritten."""


class SnapshotOwnerError(SnapshotError):
    """The snapshot folder belongs to another job, or another run of this job took it over."""


class SnapshotNotFoundError(SnapshotError):
    """No committed snapshot (of the requested step) exists at the URL."""


class UnsafeStateError(SnapshotError):
    """A value in the state cannot be loaded back without executing code (not a plain value)."""
