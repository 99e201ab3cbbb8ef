"""Pure: the manifest (the commit marker of a snapshot) and its JSON form.

The manifest is written last; a step folder without one does not exist for readers. It
lists every data file with its size and checksum, so a reader can prove a snapshot whole
before it deserialises a single byte.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3

from snapshots.errors import SnapshotCorruptError
from snapshots.format import layout

FORMAT_VERSION = 1
# 2: a sharded snapshot (``snapshots.format.sharding``): shard files and a shard table beside the
# entry (skeleton) and per-rank files. Format 1 snapshots keep loading.
SHARDED_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, 2})
# New snapshots: BLAKE3, a cryptographic hash several times faster than sha256 on one core,
# SHA-NI or not (docs/snapshots.md, "Sharded snapshots"); both release the GIL on large
# buffers. The hashing competes with training for CPU, so a cheaper hash is wall time saved.
# Snapshots written with sha256 keep verifying: readers take any algorithm below.
CHECKSUM_ALGORITHM = "blake3"
# Readers accept only these: a manifest naming a weak (md5) or a variable-length (shake_128)
# hash would let damage pass or make checksumming itself fail. sha256 and stronger; blake3
# (not in hashlib) hashes the chunks of sharded snapshots (``snapshots.format.sharding``).
CHECKSUM_ALGORITHMS = frozenset(
    {"sha256", "sha384", "sha512", "sha3_256", "sha3_384", "sha3_512", "blake2b", "blake3"}
)
# Sizes, ranks, epochs: far beyond any real value, small enough to never overflow a C long.
MAX_COUNT = 2**62
# A manifest lists a few files: anything near this size is not one of ours. Bounds the read.
MAX_MANIFEST_BYTES = 4 * 2**20


def hasher(algorithm: str) -> Any:
    """A fresh hash object for an allowed algorithm: hashlib's, or BLAKE3's (its own package;
    single-threaded, it releases the GIL on large buffers like hashlib)."""
    if algorithm == "blake3":
        return blake3.blake3()
    return hashlib.new(algorithm)


def checksum(data: bytes | memoryview, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    digest = hasher(algorithm)
    digest.update(data)
    return digest.hexdigest()


def is_hex_digest(value: Any, algorithm: str) -> bool:
    """Whether ``value`` is a lowercase hex digest of ``algorithm``'s length."""
    length = hasher(algorithm).digest_size * 2
    return isinstance(value, str) and len(value) == length and not value.strip("0123456789abcdef")


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One data file of a snapshot. ``key`` names a state entry; ``rank`` a per-rank file;
    ``shard`` the rank that wrote a shard file; ``table`` marks the shard table (format 2)."""

    name: str
    size: int
    checksum: str
    key: str | None = None
    rank: int | None = None
    shard: int | None = None
    table: bool = False


@dataclass(frozen=True, kw_only=True)
class Manifest:
    step: int
    epoch: int
    world_size: int
    torch_version: str
    created_at: str
    files: tuple[FileEntry, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry_files(self) -> dict[str, FileEntry]:
        return {f.key: f for f in self.files if f.key is not None}

    def rank_files(self) -> dict[int, FileEntry]:
        return {f.rank: f for f in self.files if f.rank is not None}

    def shard_files(self) -> dict[int, FileEntry]:
        return {f.shard: f for f in self.files if f.shard is not None}

    def table_file(self) -> FileEntry | None:
        return next((f for f in self.files if f.table), None)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def to_json(manifest: Manifest) -> bytes:
    body = asdict(manifest)
    body["files"] = [_file_json(f) for f in manifest.files]
    body["metadata"] = dict(manifest.metadata)
    return json.dumps(body, indent=1, sort_keys=True).encode("utf-8")


def _file_json(f: FileEntry) -> dict[str, Any]:
    body = asdict(f)
    # Format 1 manifests stay byte-for-byte what format-1 readers know.
    if f.shard is None:
        del body["shard"]
    if not f.table:
        del body["table"]
    return body


def from_json(data: bytes, *, expected_step: int | None = None) -> Manifest:
    """Parse and validate a manifest; every problem is a SnapshotCorruptError naming it."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise SnapshotCorruptError(
            f"manifest has {len(data)} bytes, more than a manifest may ({MAX_MANIFEST_BYTES})"
        )
    try:
        body = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and the duplicate keys refused by _unique_keys;
        # RecursionError a pathologically deep nesting.
        raise SnapshotCorruptError(f"manifest is not valid JSON: {_short(exc)}") from exc
    if not isinstance(body, dict):
        raise SnapshotCorruptError("manifest is not a JSON object")
    _check_version(body.get("format_version"))
    try:
        manifest = _build(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotCorruptError(f"manifest field missing or malformed: {_short(exc)}") from exc
    if expected_step is not None and manifest.step != expected_step:
        raise SnapshotCorruptError(
            f"manifest says step {manifest.step} but sits in the folder of step {expected_step}"
        )
    return manifest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    body = dict(pairs)
    if len(body) != len(pairs):
        seen = [k for k, _ in pairs]
        raise ValueError(f"key {next(k for k in seen if seen.count(k) > 1)!r} appears twice")
    return body


def _short(exc: BaseException) -> str:
    text = str(exc) if not isinstance(exc, KeyError) else f"key {exc} is missing"
    return text[:200] or type(exc).__name__


def _check_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int):
        raise SnapshotCorruptError(f"manifest format_version {version!r} is not an integer")
    if version not in SUPPORTED_VERSIONS:
        raise SnapshotCorruptError(
            f"manifest format_version {version} is not supported by this version of snapshots "
            f"(supported: {sorted(SUPPORTED_VERSIONS)}); upgrade the package to read it"
        )


def _build(body: dict[str, Any]) -> Manifest:
    algorithm = _typed(body, "checksum_algorithm", str)
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise ValueError(
            f"checksum_algorithm {algorithm[:40]!r} is not one of {sorted(CHECKSUM_ALGORITHMS)}"
        )
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict):
        raise TypeError("metadata must be an object")
    return Manifest(
        step=_count(body, "step", maximum=layout.MAX_STEP),
        epoch=_count(body, "epoch"),
        world_size=_count(body, "world_size"),
        torch_version=_typed(body, "torch_version", str),
        created_at=_typed(body, "created_at", str),
        files=_files(body["files"], algorithm, body["format_version"]),
        metadata=metadata,
        checksum_algorithm=algorithm,
        format_version=body["format_version"],
    )


def _files(raw: Any, algorithm: str, version: int) -> tuple[FileEntry, ...]:
    if not isinstance(raw, list):
        raise TypeError("files must be a list")
    files = tuple(_file(item, algorithm) for item in raw)
    if not any(f.key is not None for f in files):
        # A snapshot with no entry restores nothing: load would fail after verify passed.
        raise ValueError("files lists no entry file (a snapshot holds at least one entry)")
    sharded = any(f.shard is not None or f.table for f in files)
    if sharded != (version == SHARDED_VERSION) or (sharded and sum(f.table for f in files) != 1):
        raise ValueError(
            f"format_version {version} does not match its files (shard files and exactly one "
            "shard table belong to format 2, and only there)"
        )
    for field_name in ("name", "key", "rank", "shard"):
        values = [getattr(f, field_name) for f in files if getattr(f, field_name) is not None]
        if len(set(values)) != len(values):
            raise ValueError(f"files lists the same {field_name} twice")
    return files


def _file(item: Any, algorithm: str) -> FileEntry:
    if not isinstance(item, dict):
        raise TypeError("each file must be an object")
    name = _typed(item, "name", str)
    if not layout.is_safe_file_name(name) or name == layout.MANIFEST_NAME:
        # Checked before anything touches storage: a name like '../x' or '/etc/passwd' would
        # make a reader open a file outside the snapshot's own folder.
        raise SnapshotCorruptError(f"manifest file name {name[:80]!r} escapes the snapshot folder")
    key, rank, shard = item.get("key"), item.get("rank"), item.get("shard")
    table = item.get("table", False)
    if key is not None and not isinstance(key, str):
        raise TypeError(f"file {name!r}: key must be a string")
    if not isinstance(table, bool):
        raise TypeError(f"file {name!r}: table must be true or false")
    rank = _count(item, "rank") if rank is not None else None
    shard = _count(item, "shard") if shard is not None else None
    if sum(v is not None for v in (key, rank, shard)) + table != 1:
        raise ValueError(f"file {name!r} must name exactly one of key, rank, shard and table")
    return FileEntry(
        name=name,
        size=_count(item, "size"),
        checksum=_digest(item, algorithm),
        key=key,
        rank=rank,
        shard=shard,
        table=table,
    )


def _count(body: Mapping[str, Any], name: str, *, maximum: int = MAX_COUNT) -> int:
    """A non-negative integer no larger than ``maximum`` (JSON allows any size)."""
    value = _typed(body, name, int)
    if not 0 <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [0, {maximum}], got {str(value)[:40]}")
    return value


def _digest(item: Mapping[str, Any], algorithm: str) -> str:
    value = _typed(item, "checksum", str)
    if not is_hex_digest(value, algorithm):
        raise ValueError(f"checksum {value[:80]!r} is not a {algorithm} hex digest")
    return value


def _typed(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body[name]
    if kind is int and isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {kind.__name__}, got {str(value)[:40]!r}")
    return value
