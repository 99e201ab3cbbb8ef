"""The storage protocol's types: what a listing returns, what a backend provides.

Three optional extras beyond the five protocol methods are read with ``getattr``, so that any
Storage (a test's wrapper included) works without them: ``object_store``, ``etag_of(data)``
(``snapshots.storage``) and ``read_range(path, start, length)`` (``read_range`` below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from snapshots.errors import FileTooLargeError, SnapshotCorruptError


@dataclass(frozen=True, kw_only=True)
class Entry:
    name: str  # base name
    is_dir: bool
    size: int | None = None
    mtime: float | None = None
    etag: str | None = None  # the backend's entity tag, quotes stripped (S3: a content MD5)


@runtime_checkable
class Storage(Protocol):
    url: str  # for messages and events: redacted

    def check(self, *, create: bool = True) -> None: ...
    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None: ...
    def read(self, path: str) -> bytes: ...  # may take limit=N (see RetryingStorage.read)
    def list(self, path: str = "") -> list[Entry]: ...
    def delete(self, path: str) -> None: ...


def within(path: str, data: bytes, limit: int) -> bytes:
    if len(data) > limit:
        raise FileTooLargeError(f"{path} holds more than the {limit} bytes expected")
    return data


def read_range(storage: Storage, path: str, start: int, length: int) -> bytes:
    """``length`` bytes of a file from ``start`` (a shard file's chunk): the backend's ranged
    read where it has one, else the whole file, sliced. SnapshotCorruptError when the file
    ends first (truncated), FileNotFoundError when it is missing."""
    ranged = getattr(storage, "read_range", None)
    if ranged is not None:
        data = ranged(path, start, length)
    else:
        data = storage.read(path)[start : start + length]
    if len(data) != length:
        raise SnapshotCorruptError(
            f"file {path.rsplit('/', 1)[-1]} ends before byte {start + length} (truncated)"
        )
    return data
