"""Where a job's secret (``auth.JobKey``) comes from: the operator, or made on first use.

In order:

1. ``--rdzv-secret-file PATH`` (``ELASTIC_TRAIN_RDZV_SECRET_FILE``): the operator's file, the
   same on every node (a Kubernetes Secret mounted as a file, a file in a Slurm job's shared
   folder). Its bytes, surrounding whitespace removed, at least 16 of them; a file that other
   users may write is refused.
2. The job's snapshot folder, which every node already shares and trusts: ``rdzv-secret``
   there, created by the first node that finds none (exclusively: ``O_EXCL`` on a local
   folder, a conditional write on object stores), mode 0600, and read by every other node.
3. Neither: a private file of this user on this machine (``$XDG_RUNTIME_DIR/elastic-train``
   when that folder is ours and private, else ``~/.cache/elastic-train``), one per job id --
   what every node of a job on one machine shares. Nodes on several machines with neither a
   secret file nor a shared snapshot folder get different secrets: the second node's
   rendezvous then ends with one line naming the fix (``state_backend.ForeignSecret``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.errors import ConfigError
from elastic_trainer.private_files import (
    NotOursError,
    check_private_dir,
    open_private,
    private_dirs,
)

SECRET_NAME = "rdzv-secret"
MAX_SECRET_BYTES = 4096
MIN_SECRET_BYTES = 16


def job_key(
    *, secret_file: str | None, snapshot_dir: str | None, job_id: str, create: bool = True
) -> JobKey:
    """The job's key, from the first source above that applies (``create`` False: a reader
    such as ``status``, which never makes one). ConfigError (exit 2) for an operator's file
    that cannot be used, or a folder where no secret can be kept or none is found."""
    if secret_file:
        return JobKey(_read_operator_file(secret_file))
    if snapshot_dir:
        return JobKey(_in_folder(snapshot_dir, create=create))
    return JobKey(_per_user(job_id, create=create))


def _read_operator_file(path: str) -> bytes:
    flag = f"--rdzv-secret-file={path}"
    try:
        # links are fine here: Kubernetes mounts a Secret's files as links into ..data/
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot be read ({exc.strerror}): fix the path") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{flag}: not a regular file: point it at a file of random bytes")
        if st.st_mode & 0o002:
            raise ConfigError(f"{flag}: any local user may write it: chmod o-w, or 0600")
        data = f.read(MAX_SECRET_BYTES + 1).strip()
    if not MIN_SECRET_BYTES <= len(data) <= MAX_SECRET_BYTES:
        raise ConfigError(
            f"{flag}: holds {len(data)} bytes; a secret needs {MIN_SECRET_BYTES}.."
            f"{MAX_SECRET_BYTES}: e.g. `openssl rand -hex 32 > FILE`"
        )
    return data


def new_secret() -> bytes:
    """What a made secret holds: 64 hex characters (text, so an operator can copy it)."""
    return secrets.token_hex(32).encode()


def _in_folder(snapshot_dir: str, *, create: bool) -> bytes:
    if "://" not in snapshot_dir or snapshot_dir.startswith("file://"):  # as open_storage
        path = os.path.join(snapshot_dir.removeprefix("file://"), SECRET_NAME)
        return _local_secret(path, create=create)
    return _remote_secret(snapshot_dir, create=create)


def _local_secret(path: str, *, create: bool = True) -> bytes:
    """Read ``path``, or create it exclusively (0600) when missing; a link, another user's
    file or one others may read is refused (never followed, never trusted)."""
    if not create:
        if not os.path.lexists(path):
            raise ConfigError(f"{path}: no job secret there: pass the job's --rdzv-secret-file")
        return _read_private(path)
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot hold the job's secret ({exc.strerror})") from exc
    # written whole under a name of its own, then linked to ``path``: a node that finds
    # ``path`` never finds it empty, and of two nodes making it at once one link wins
    made = new_secret()
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot hold the job's secret ({exc.strerror})") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(made)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    except FileExistsError:
        return _read_private(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot hold the job's secret ({exc.strerror})") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return made


def _read_private(path: str) -> bytes:
    try:  # no link followed, a FIFO never waited on; ours alone, or refused
        fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"the job's secret is refused: {exc}: remove {path}") from exc
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_SECRET_BYTES + 1).strip()
    if not MIN_SECRET_BYTES <= len(data) <= MAX_SECRET_BYTES:
        raise ConfigError(f"{path}: not a job secret ({len(data)} bytes): remove it")
    return data


def _remote_secret(snapshot_dir: str, *, create: bool = True) -> bytes:
    """An object store: the first node's conditional write wins, every node reads back."""
    from snapshots.storage import S3_PROTOCOLS, FsspecStorage
    from snapshots.storage.retry import RetryPolicy, s3_options

    scheme = snapshot_dir.split("://", 1)[0].lower()
    options = s3_options({}, RetryPolicy()) if scheme in S3_PROTOCOLS else {}
    storage = FsspecStorage(snapshot_dir, options)
    fs, path = storage.fs, f"{storage.root}/{SECRET_NAME}"
    # S3: If-None-Match, GCS: ifGenerationMatch=0; an existing secret is read below
    if create:
        with (
            contextlib.suppress(FileExistsError, NotImplementedError, ValueError, OSError),
            fs.open(path, "xb") as f,
        ):
            f.write(new_secret())
    try:
        with fs.open(path, "rb") as f:
            data = f.read(MAX_SECRET_BYTES + 1).strip()
    except OSError as exc:
        raise ConfigError(
            f"{snapshot_dir}/{SECRET_NAME}: the job's secret cannot be read or made ({exc}): "
            "check the folder's permissions, or pass --rdzv-secret-file"
        ) from exc
    if not MIN_SECRET_BYTES <= len(data) <= MAX_SECRET_BYTES:
        raise ConfigError(f"{snapshot_dir}/{SECRET_NAME}: not a job secret: remove it")
    return data


def _per_user(job_id: str, *, create: bool) -> bytes:
    name = "rdzv-" + hashlib.sha256(job_id.encode()).hexdigest()[:24] + ".secret"
    return _local_secret(os.path.join(per_user_dir(), name), create=create)


def per_user_dir() -> str:
    """This user's private folder for job secrets on this machine (created 0700)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        with contextlib.suppress(OSError):
            check_private_dir(runtime)
            return private_dirs(os.path.join(runtime, "elastic-train"))
    home = os.path.expanduser("~")
    base = os.path.join(home, ".cache", "elastic-train")
    try:
        os.makedirs(os.path.dirname(base), mode=0o700, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(base, 0o700)
        check_private_dir(base)
    except NotOursError as exc:
        raise ConfigError(
            f"{exc}: the job's secret cannot be kept there: fix its mode "
            "(chmod 700) or pass --rdzv-secret-file"
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"{base}: no private folder for the job's secret ({exc.strerror}): set "
            "XDG_RUNTIME_DIR or HOME to a folder of yours, or pass --rdzv-secret-file"
        ) from exc
    return base
