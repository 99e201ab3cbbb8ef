"""The narrow storage protocol the store is written against, and its implementations.

Paths are ``str`` relative to the store's root, '/'-separated (pathlib mangles ``gs://``).
- ``LocalStorage`` (``snapshots.storage.local``): atomic, durable local writes.
- ``FsspecStorage``: any other fsspec URL. One object per file, written in one call;
  never renamed. Exclusive create (S3 ``If-None-Match: *``) where the backend has it.
- ``RetryingStorage``: retries transient errors with exponential backoff (tenacity) within
  one deadline per operation (``storage_timeout``; ``snapshots.storage.retry`` says how the layers
  are bounded), records whether storage answers (``health``), and turns everything else
  except FileNotFoundError/FileExistsError into StorageError. ``single_attempt()``: the
  same without retries, for best-effort clean-up.

Optional extras beyond the five protocol methods, read with ``getattr`` so that any
Storage (a test's wrapper included) works without them: ``object_store`` (True: reads cost
network traffic, so post-write verification may use listings), ``etag_of(data)`` (the
ETag the backend's listing will show for ``data`` written by ``write``, or None) and
``read_range`` (``snapshots.storage.base``), and ``write_streamed(path, fill)`` with
``digest(path, algorithm)`` (``snapshots.storage.local``: a save's bytes go from
``torch.save`` straight into the file and are hashed on the way, never held in memory whole).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import tenacity

from snapshots.errors import SnapshotCorruptError, StorageError
from snapshots.events import emit
from snapshots.storage import faults
from snapshots.storage.base import Entry, Storage, read_range, within
from snapshots.storage.health import StorageHealth
from snapshots.storage.local import LocalStorage, kill_point
from snapshots.storage.retry import RetryPolicy, is_transient, s3_options

T = TypeVar("T")

_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s:]+(:[^/@\s]*)?@")
_SECRET_QUERY = re.compile(
    r"(?i)(?P<key>[?&](?:[a-z0-9_.-]*(?:secret|token|signature|password|key|credential|sig)"
    r"[a-z0-9_.-]*))=[^&\s]*"
)
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})
S3_PROTOCOLS = frozenset({"s3", "s3a"})
# s3fs's pipe_file uploads in parts of this size once data reaches two parts (its default).
S3FS_PART_SIZE = 50 * 2**20


# fsspec protocol -> the extra of this package that installs its backend.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def backend_fix(scheme: str) -> str:
    """How to install the fsspec backend of ``scheme`` (for an error message)."""
    extra = EXTRAS.get(scheme)
    return (
        f"pip install 'elastic-train[{extra}]'"
        if extra
        else f"install the {scheme}:// fsspec backend"
    )


def redact_url(text: str) -> str:
    """Remove credentials (user:password@, secret query parameters) from a URL."""
    return _SECRET_QUERY.sub(r"\g<key>=***", _URL_USERINFO.sub(r"\g<scheme>***@", text))


class FsspecStorage:
    """Any fsspec URL (memory://, s3://, gs://...). Objects are written whole, never renamed."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec  # imported here: local-only users never pay for it

        self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.root = root.rstrip("/")
        self.url = redact_url(url.rstrip("/"))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.object_store = bool(OBJECT_STORE_PROTOCOLS.intersection(protocols))
        self._s3 = bool(S3_PROTOCOLS.intersection(protocols))

    def etag_of(self, data: bytes) -> str | None:
        """The ETag S3 will list for ``data`` written by ``write``; None on other backends."""
        return s3_etag(data) if self._s3 else None

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}".rstrip("/") if path else self.root

    def check(self, *, create: bool = True) -> None:
        try:
            self.fs.ls(self.root)
            return
        except FileNotFoundError:
            pass
        if self.object_store:
            bucket = self.root.split("/", 1)[0]
            try:
                self.fs.ls(bucket)
            except FileNotFoundError as exc:
                raise FileNotFoundError(
                    errno.ENOENT, f"bucket {bucket!r} does not exist; create it first", bucket
                ) from exc
        elif create:
            self.fs.makedirs(self.root, exist_ok=True)
        else:
            raise FileNotFoundError(errno.ENOENT, "no such folder", self.root)

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        target = self._abs(path)
        faults.hit(kill_point(path))  # an object PUT is all-or-nothing; a crash here = none
        if not exclusive:
            self.fs.pipe_file(target, data)
            return
        try:
            self.fs.pipe_file(target, data, mode="create")
        except FileExistsError:
            raise
        except OSError as exc:
            if "PreconditionFailed" in str(exc) or "If-None-Match" in str(exc):
                raise FileExistsError(errno.EEXIST, "already exists", target) from exc
            raise
        except (TypeError, NotImplementedError, ValueError):
            # Backends without exclusive create: check, then write. Not atomic against a
            # concurrent writer of the same step; the per-save file tokens still keep data apart.
            if self.fs.exists(target):
                raise FileExistsError(errno.EEXIST, "already exists", target) from None
            self.fs.pipe_file(target, data)

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        if limit is None:
            return self.fs.cat_file(self._abs(path))
        # A ranged read: a replaced object may be arbitrarily large.
        return within(path, self.fs.cat_file(self._abs(path), start=0, end=limit + 1), limit)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return self.fs.cat_file(self._abs(path), start=start, end=start + length)

    def list(self, path: str = "") -> list[Entry]:
        folder = self._abs(path)
        self.fs.invalidate_cache(folder)  # another process may have written since
        try:
            items = self.fs.ls(folder, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        entries = [_fsspec_entry(item) for item in items]
        # Some backends list a file itself when asked for a file path; only children count.
        return [e for e in entries if e.name and f"{folder}/{e.name}" != folder]

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._abs(path), recursive=True)


def _fsspec_entry(item: Mapping[str, Any]) -> Entry:
    name = str(item["name"]).rstrip("/").rsplit("/", 1)[-1]
    is_dir = item.get("type") == "directory"
    mtime = item.get("mtime") or item.get("LastModified") or item.get("created")
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    etag = item.get("ETag") or item.get("etag")
    return Entry(
        name=name,
        is_dir=is_dir,
        size=None if is_dir else int(item.get("size") or 0),
        mtime=float(mtime) if isinstance(mtime, (int, float)) else None,
        etag=str(etag).strip('"') if etag else None,
    )


def s3_etag(data: bytes | memoryview, part_size: int = S3FS_PART_SIZE) -> str:
    """S3's ETag for an unencrypted (or SSE-S3) upload: the MD5 of a single PUT, or for a
    multipart upload the MD5 of the parts' MD5s and ``-<parts>``. SSE-KMS/SSE-C ETags are
    not MD5s; a mismatch is therefore never taken as proof of damage by itself."""
    view = memoryview(data).cast("B")
    if len(view) < 2 * part_size:  # s3fs: one PUT below two parts
        return hashlib.md5(view, usedforsecurity=False).hexdigest()
    digests = [
        hashlib.md5(view[i : i + part_size], usedforsecurity=False).digest()
        for i in range(0, len(view), part_size)
    ]
    whole = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
    return f"{whole}-{len(digests)}"


class RetryingStorage:
    """Adds retries (transient errors only) and one error type (StorageError) to a Storage."""

    def __init__(
        self,
        inner: Storage,
        policy: RetryPolicy | None = None,
        *,
        health: StorageHealth | None = None,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.policy = policy or RetryPolicy()
        self.health = health or StorageHealth()

    def single_attempt(self) -> RetryingStorage:
        """The same storage and health, one attempt per call: for best-effort clean-up that
        must not start a retry chain of its own while storage is failing."""
        return RetryingStorage(self.inner, replace(self.policy, attempts=1), health=self.health)

    @property
    def object_store(self) -> bool:
        return bool(getattr(self.inner, "object_store", False))

    def etag_of(self, data: bytes) -> str | None:
        etag_of = getattr(self.inner, "etag_of", None)
        return etag_of(data) if etag_of is not None else None

    def check(self, *, create: bool = True) -> None:
        self._call("check", "", lambda: self.inner.check(create=create))

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self._call("write", path, lambda: self.inner.write(path, data, exclusive=exclusive))

    @property
    def streams(self) -> bool:
        """Whether ``write_streamed`` and ``digest`` are the backend's own (no whole copy)."""
        return callable(getattr(self.inner, "write_streamed", None)) and callable(
            getattr(self.inner, "digest", None)
        )

    def write_streamed(self, path: str, fill: Callable[[Any], T]) -> T:
        """``fill(file)`` writes the bytes; run again from the start on a retry. Only where
        ``streams``."""
        return self._call("write", path, lambda: self.inner.write_streamed(path, fill))  # type: ignore[attr-defined]

    def digest(self, path: str, algorithm: str) -> tuple[int, str]:
        """(size, hex digest) of a file, read in chunks. Only where ``streams``."""
        return self._call("read", path, lambda: self.inner.digest(path, algorithm))  # type: ignore[attr-defined]

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        return self._call("read", path, lambda: read_limited(self.inner, path, limit))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return self._call("read", path, lambda: read_range(self.inner, path, start, length))

    def list(self, path: str = "") -> list[Entry]:
        return self._call("list", path, lambda: self.inner.list(path))

    def delete(self, path: str) -> None:
        self._call("delete", path, lambda: self.inner.delete(path))

    def release_set_aside(self) -> int:
        """Local disk: delete the data files kept for the next save to write over (bytes
        freed). Elsewhere nothing is kept: 0."""
        release = getattr(self.inner, "release_set_aside", None)
        return int(release()) if release is not None else 0

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        p = self.policy
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(self._transient),
            stop=lambda rs: p.gives_up(
                attempt=rs.attempt_number,
                elapsed_s=rs.seconds_since_start or 0.0,
                next_wait_s=rs.upcoming_sleep,
            ),
            wait=tenacity.wait_exponential_jitter(
                multiplier=p.initial_s, max=p.max_s, jitter=p.initial_s
            ),
            before_sleep=lambda rs: emit(
                "snapshot.storage_retry",
                op=op,
                url=self._where(path),
                attempt=rs.attempt_number,
                error=redact_url(repr(rs.outcome.exception())),
            ),
            reraise=True,
        )
        try:
            result = retrying(fn)
        except (FileNotFoundError, FileExistsError, SnapshotCorruptError):
            self.health.answered()
            raise  # answers, not failures: the store decides what they mean
        except Exception as exc:
            if is_transient(exc):
                self.health.failed(redact_url(repr(exc)))
            raise StorageError(f"{op} {self._where(path)} failed: {redact_url(repr(exc))}") from exc
        self.health.answered()
        return result

    def _transient(self, exc: BaseException) -> bool:
        if is_transient(exc):
            self.health.failed(redact_url(repr(exc)))  # down while the retries run
            return True
        return False

    def _where(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url


def check_reachable(storage: RetryingStorage, url: str, create: bool) -> None:
    """Fail with one line naming the fix when the store's root cannot be used."""
    try:
        storage.check(create=create)
    except (StorageError, OSError) as exc:
        cause = exc.__cause__ or exc
        access = "writable" if create else "readable"
        raise StorageError(
            f"cannot use snapshot storage {redact_url(url)}: {redact_url(str(cause))}; "
            f"check that the folder or bucket exists and is {access}, and that the "
            "endpoint, credentials (storage_options) and network are right"
        ) from exc


def read_limited(storage: Storage, path: str, limit: int | None) -> bytes:
    """``read`` with a limit where the storage takes one; wrappers written against the
    five-method protocol (tests, user code) are read whole and checked after."""
    if limit is None:
        return storage.read(path)
    if "limit" in inspect.signature(storage.read).parameters:
        return storage.read(path, limit=limit)  # type: ignore[call-arg]
    return within(path, storage.read(path), limit)


def _local_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Local disk reads four options: ``direct_io`` (default True: large aligned writes go
    past the page cache; False: every write through it, e.g. on a mount that handles O_DIRECT
    badly), ``reuse_files`` (default True: a deleted snapshot's large files are written over
    by the next save instead of freed; False: deleted at once), ``writer_process``
    (default False; True: saves from 32 MB up are serialised in a writer process, off the
    training process's GIL: ``snapshots.write.writer_process``) and ``group_access``
    (default False: what is created is 0700/0600; True: 0750/0640, the group may read:
    ``snapshots.storage.modes``). Other keys are ignored there."""
    out = {}
    for key, default in LOCAL_OPTIONS.items():
        value = (options or {}).get(key, default)
        if not isinstance(value, bool):
            raise StorageError(f"storage_options[{key!r}] must be True or False, got {value!r}")
        out[key] = value
    return out


# The options local disk reads, with their defaults (see ``_local_options``).
LOCAL_OPTIONS = {
    "direct_io": True,
    "reuse_files": True,
    "writer_process": False,
    "group_access": False,
}


def open_storage(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> RetryingStorage:
    """Storage for a URL: the local fast path for paths and file://, fsspec for the rest.
    On S3, per-attempt timeouts from ``retry`` and no retries below ours (``s3_options``)."""
    if not isinstance(url, str) or not url:
        raise StorageError(f"snapshot URL must be a non-empty string, got {url!r}")
    policy = retry or RetryPolicy()
    if "://" not in url or url.startswith("file://"):
        inner: Storage = LocalStorage(
            url.removeprefix("file://"), **_local_options(storage_options)
        )
    else:
        scheme = url.split("://", 1)[0].lower()
        options = dict(storage_options or {})
        # A local folder's modes: an object store has none (its bucket policy decides), and
        # its backend must not be handed an option it does not know.
        options.pop("group_access", None)
        if scheme in S3_PROTOCOLS:
            options = s3_options(options, policy)
        try:
            inner = FsspecStorage(url, options)
        except (ImportError, ValueError) as exc:
            raise StorageError(
                f"cannot open snapshot URL {redact_url(url)}: {exc}; {backend_fix(scheme)}"
            ) from exc
        if scheme in S3_PROTOCOLS:
            inner.fs.retries = 1  # type: ignore[attr-defined]  # s3fs's own retry loop: off
    return RetryingStorage(inner, policy)


__all__ = ["Entry", "LocalStorage", "Storage", "read_range"]
