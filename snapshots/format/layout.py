"""Pure naming rules for what a snapshot store holds under its root.

    <root>/step-000000001200/manifest.json          commit marker, written last
    <root>/step-000000001200/<entry>.<token>.pt     one file per top-level state entry
    <root>/step-000000001200/rank-00001.<token>.pt  per-rank state
    <root>/step-000000001200/shard-00001.<token>.bin, shards.<token>.json   sharded
                                                    snapshots (``snapshots.format.sharding``)
    <root>/step-.../.tmp-<name>-<pid>-<rand>        a local write in progress (never read)

The random ``token`` makes every save's data file names unique, so two writers of one step
(two generations of a job) never overwrite each other's data: only the manifest decides.
"""

from __future__ import annotations

import re
import secrets

STEP_PREFIX = "step-"
STEP_DIGITS = 12
MANIFEST_NAME = "manifest.json"
TEMP_PREFIX = ".tmp-"
# Data files of deleted snapshots kept for the next save to write into (``_local_storage``).
REUSE_DIR = ".reuse"
DATA_SUFFIX = ".pt"
MAX_STEP = 10**STEP_DIGITS - 1

_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS}}})$")
# A safe file name: no separators, no leading dot, nothing that could leave the folder.
_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
# Data (.pt), shard (.bin) and shard-table (.json) files of one save share its token.
_DATA_FILE = re.compile(r"^[A-Za-z0-9_-]+\.([0-9a-f]{8})\.(pt|bin|json)$")


def step_dir(step: int) -> str:
    """The folder name of a step: ``step-`` and 12 zero-padded digits (sorts by name)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a folder name, or None when the name is not a step folder."""
    match = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def manifest_path(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def new_token() -> str:
    return secrets.token_hex(4)


def entry_file_name(index: int, key: str, token: str) -> str:
    """Data file for one top-level state entry; the key is sanitised (the manifest maps back)."""
    safe = _UNSAFE_CHARS.sub("_", key).strip("_")[:60] or "entry"
    return f"{index:03d}-{safe}.{token}{DATA_SUFFIX}"


def rank_file_name(rank: int, token: str) -> str:
    return f"rank-{rank:05d}.{token}{DATA_SUFFIX}"


def token_of(name: str) -> str | None:
    """The save token in a data file name this package writes, or None for any other name."""
    match = _DATA_FILE.match(name)
    return match.group(1) if match else None


def reuse_key(name: str) -> str | None:
    """A data file's name without its save token (``000-model.pt``, ``shard-00003.bin``), or
    None for any other name: the same entry, rank or shard of the next save has the same key,
    so that save may write into this file's disk blocks (``_local_storage``)."""
    match = _DATA_FILE.match(name)
    if match is None:
        return None
    return name[: match.start(1) - 1] + name[match.end(1) :]


def is_safe_file_name(name: str) -> bool:
    """True for a plain file name inside a step folder (no '/', '..', leading dot, NUL)."""
    return bool(_SAFE_FILE.match(name)) and ".." not in name


def is_temp_name(name: str) -> bool:
    return name.rsplit("/", 1)[-1].startswith(TEMP_PREFIX)


def temp_name(name: str, pid: int) -> str:
    return f"{TEMP_PREFIX}{name}-{pid}-{secrets.token_hex(4)}"
