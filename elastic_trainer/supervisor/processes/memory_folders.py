"""The in-memory tier's folders on this machine, as supervisors pick, claim and free them.

Layout: ``<root>/<job id>/<supervisor pid>/``, one folder per node (per supervisor); its
workers write below it (``worker.memory``).

The root is this user's private folder (``private_files``) in a shared tmpfs, found again
by every later run of this user on the machine, whatever its job: ``elastic-train-<uid>``;
when another user holds that name (or it is a link, or open to others), the first of
``elastic-train-<uid>.1`` .. ``.<FALLBACKS>`` that is ours or can be made ours, then
``$XDG_RUNTIME_DIR/elastic-train`` (only a private folder on tmpfs). The names are fixed, so
a squatter cannot make us create a new folder per run (one that no later run would find or
free), and later runs agree on the choice. ``$XDG_RUNTIME_DIR`` comes last, not first: it is
set in login sessions only (not under cron or most batch schedulers, so two runs of one user
would disagree), logind caps it at 10 % of the memory (``/dev/shm``: 50 %), and removes it at
the user's last logout, which can come in the middle of a job.

A node's folder is claimed by its supervisor for as long as it lives: an ``flock`` held on
its ``owner.lock`` (``claim``; the kernel releases it when the holder dies, SIGKILL too, and
no reused PID can hold it). Every supervisor start and end frees the folders, of any job, in
every root of this user, whose owner is provably gone (``abandoned``): a tmpfs is memory.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from elastic_trainer.private_files import check_private_dir, open_private, private_dir

ROOT_PREFIX = "elastic-train-"
FALLBACKS = 8  # numbered roots after the first: more only helps someone squatting them all
RUNTIME_NAME = "elastic-train"
OWNER_LOCK = "owner.lock"
RAM_FILESYSTEMS = frozenset({"tmpfs"})  # not ramfs: it has no size limit, a full one hangs


# --- decisions ------------------------------------------------------------------------------
def root_candidates(base: str, uid: int, runtime_dir: str | None) -> list[str]:
    """The roots this user's tier may use, in the order they are tried."""
    first = os.path.join(base, f"{ROOT_PREFIX}{uid}")
    # a dot, not a dash: never the control folders' ``elastic-train-<pid>-<random>``, which
    # ``workerenv.remove_stale_control_roots`` removes where both share /tmp
    numbered = [f"{first}.{n}" for n in range(1, FALLBACKS + 1)]
    return [first, *numbered, *([os.path.join(runtime_dir, RUNTIME_NAME)] if runtime_dir else [])]


def filesystem_of(path: str, mounts: str) -> str | None:
    """The type of the filesystem ``path`` (absolute, no links) is on, from ``/proc/mounts``'
    text: the longest mount point above it, the last one mounted where several share it."""
    best, kind = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


class Claim(enum.Enum):
    """What a node folder's ``owner.lock`` says of its supervisor."""

    HELD = "held"  # its supervisor lives
    FREE = "free"  # nobody holds it: its supervisor died
    MISSING = "missing"  # an earlier version's folder, or one mid-claim
    REFUSED = "refused"  # not ours alone, unreadable: never opened, so never proof


def abandoned(claim: Claim, name: str, running: Callable[[int], bool]) -> bool:
    """Whether a node folder's supervisor is provably gone. Without a lock, its name (the
    supervisor's PID) decides: a PID that runs, reused or not, keeps it."""
    if claim is Claim.FREE:
        return True
    if claim is Claim.MISSING:
        return name.isdigit() and not running(int(name))
    return False


# --- the root ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RootChoice:
    path: str | None  # None: no root is ours, the tier is off for this run
    refused: tuple[tuple[str, str], ...]  # (candidate, why) for those tried before it


def read_mounts() -> str:
    try:
        with open("/proc/mounts") as f:
            return f.read()
    except OSError:
        return ""  # no proof of tmpfs: the runtime folder is not used


def choose_root(
    base: str, uid: int, runtime_dir: str | None, mounts: Callable[[], str] = read_mounts
) -> RootChoice:
    """The first candidate root that is ours or is made ours (mode 0700, no link)."""
    refused: list[tuple[str, str]] = []
    runtime = os.path.join(runtime_dir, RUNTIME_NAME) if runtime_dir else None
    for path in root_candidates(base, uid, runtime_dir):
        try:
            if runtime_dir and path == runtime:
                _check_runtime_dir(runtime_dir, mounts)
            return RootChoice(path=private_dir(path), refused=tuple(refused))
        except OSError as exc:  # NotOursError among them
            refused.append((path, str(exc)))
    return RootChoice(path=None, refused=tuple(refused))


def _check_runtime_dir(runtime_dir: str, mounts: Callable[[], str]) -> None:
    check_private_dir(runtime_dir)
    kind = filesystem_of(os.path.realpath(runtime_dir), mounts())
    if kind not in RAM_FILESYSTEMS:
        raise OSError(f"{runtime_dir} is on {kind or 'an unknown filesystem'}, not tmpfs")


def our_roots(base: str, uid: int, runtime_dir: str | None) -> list[str]:
    """The candidate roots that exist and are ours: a run may have chosen any of them (a
    squatter came or went since), so all are freed of abandoned folders. None is made."""
    found = []
    for path in root_candidates(base, uid, runtime_dir):
        with contextlib.suppress(OSError):
            check_private_dir(path)
            found.append(path)
    return found


# --- a node's folder --------------------------------------------------------------------------
def node_folder(root: str, job_id: str, pid: int) -> str:
    job = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)
    if not job.strip("."):  # "." or "..": never a folder outside the job's own
        job = job.replace(".", "_")
    return os.path.join(root, job, str(pid))


def make_node_folder(path: str) -> str:
    """``path`` and its job's folder made private; a sweep removes a job's folder once it is
    empty, which can fall between the two: then again."""
    for _ in range(3):
        with contextlib.suppress(FileNotFoundError):
            private_dir(os.path.dirname(path))
            return private_dir(path)
    private_dir(os.path.dirname(path))
    return private_dir(path)


def claim(folder: str) -> int:
    """Hold ``folder``'s ``owner.lock`` for as long as the returned descriptor is open (close
    it only once the folder is gone). The lock is taken on a new file that is then renamed
    into place: a sweep never finds an ``owner.lock`` that is not yet locked."""
    staged = os.path.join(folder, f"{OWNER_LOCK}.{uuid.uuid4().hex}.tmp")
    fd = open_private(staged, os.O_RDWR | os.O_CREAT)  # O_CLOEXEC: workers never hold it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(staged, os.path.join(folder, OWNER_LOCK))
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    return fd


def still_claimed(folder: str, fd: int) -> bool:
    """Whether ``fd`` is still the lock of ``folder``'s ``owner.lock`` (not of a removed one)."""
    try:
        held, there = os.fstat(fd), os.lstat(os.path.join(folder, OWNER_LOCK))
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


@contextlib.contextmanager
def _probe(folder: str) -> Iterator[Claim]:
    """``folder``'s claim; FREE stays locked by us until the block ends: no new owner can
    take the folder while it is being removed."""
    fd, state = _try_claim(folder)
    try:
        yield state
    finally:
        if fd is not None:
            os.close(fd)


def _try_claim(folder: str) -> tuple[int | None, Claim]:
    try:
        fd = open_private(os.path.join(folder, OWNER_LOCK), os.O_RDONLY)
    except FileNotFoundError:
        return None, Claim.MISSING
    except OSError:  # a link, another user's: never followed, so never proof
        return None, Claim.REFUSED
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, Claim.HELD
    return fd, Claim.FREE


# --- freeing -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Freed:
    folders: int = 0
    bytes: int = 0

    def __add__(self, other: Freed) -> Freed:
        return Freed(folders=self.folders + other.folders, bytes=self.bytes + other.bytes)


def sweep(roots: Iterable[str], running: Callable[[int], bool]) -> Freed:
    """Remove every abandoned node folder below ``roots`` (private roots of ours), and job
    folders left empty. A live supervisor's folder is never touched."""
    freed = Freed()
    for root in roots:
        for job in _subfolders(root):
            for node in _subfolders(job):
                freed += _free_if_abandoned(node, running)
            with contextlib.suppress(OSError):  # only once empty
                os.rmdir(job)
    return freed


def _free_if_abandoned(node: str, running: Callable[[int], bool]) -> Freed:
    with _probe(node) as state:
        if not abandoned(state, os.path.basename(node), running):
            return Freed()
        size = _bytes_under(node)
        shutil.rmtree(node, ignore_errors=True)
    return Freed(folders=1, bytes=size)


def _subfolders(path: str) -> list[str]:
    """Real folders in ``path`` (never a link: ``is_dir`` of a DirEntry does not follow one
    when asked not to)."""
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _bytes_under(path: str) -> int:
    """The memory the files below ``path`` take (allocated blocks, as tmpfs counts them)."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total
