"""Pure: the layout of a sharded snapshot and its JSON shard table.

A sharded snapshot (manifest ``format_version`` 2) is written by every rank at once::

    step-000000001200/manifest.json                 commit marker, written last by rank 0
    step-000000001200/shards.<token>.json           the shard table (this module), rank 0
    step-000000001200/shard-00003.<token>.bin       rank 3's tensor bytes: raw, never pickled
    step-000000001200/000-model.<token>.pt          the *skeleton* of each top-level entry
    step-000000001200/rank-00003.<token>.pt         per-rank state (RNG), as in format 1

The skeleton is the entry's state tree with every tensor replaced by a marker
``{"__snapshots_tensor__": fqn}`` (plain values, read back with the weights-only loader after
their checksum). Every tensor lives in the shard files as *chunks*: a box of the global
tensor (``offsets`` and ``sizes`` per dimension) stored as its raw little-endian bytes at
``byte_offset`` of one shard file, with its own checksum: BLAKE3 (table format 2; format 1
tables, which new code still reads, used sha256). A tensor's ``fqn`` is the JSON text of
its path in the state tree (``["model", "layer.weight"]``), which keeps int and str keys apart.

The shard table lists, for every tensor, its global shape, dtype, the placements it had when
saved (informational: resharding needs only the chunks) and its chunks. It is JSON: nothing
read from a snapshot is ever unpickled except skeleton and per-rank files, through
``torch.load(weights_only=True)`` after their checksum; tensor bytes are not unpickled at all
(``torch.frombuffer`` over bytes whose checksum was checked). We do not use DCP's
``FileSystemReader`` or its ``.metadata`` file (a pickle): DCP's ``Metadata`` is built in
memory from this table (``to_dcp_metadata``) and handed to its load planner, which works out
which chunks overlap which local shards.

Commit: every rank writes its shard file in the background, then reports it (name, size,
sha256, chunk records) to rank 0 over the snapshot's own gloo group; rank 0 writes the
skeleton, the table, and the manifest last, listing every rank's file. A rank that failed or
died means no manifest: never some ranks' shards without the others'.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from snapshots.errors import SnapshotCorruptError
from snapshots.format import layout
from snapshots.format.manifest import CHECKSUM_ALGORITHMS, is_hex_digest

# 2: the table names its chunks' ``checksum_algorithm``, each chunk has a ``checksum``.
# 1 (read only): every chunk has a ``sha256``.
TABLE_FORMAT = 2
TABLE_FORMATS = frozenset({1, 2})
# A rank loading hashes every chunk it reads, and the load planner makes it read more than
# its share: BLAKE3 (cryptographic, like sha256) hashes several times faster than sha256 on
# one thread (docs/snapshots.md, "Sharded snapshots"). Whole files (the manifest) keep sha256.
CHUNK_ALGORITHM = "blake3"
TENSOR_MARKER = "__snapshots_tensor__"
SHARD_SUFFIX = ".bin"
TABLE_PREFIX = "shards"
# A shard table holds ~300 bytes per chunk, and chunks hold up to 1 MiB: 1 GiB of table
# lists ~3.5M chunks, ~3.5 TB of tensors. A load refuses a larger table before reading it;
# a save whose table would be larger fails instead of committing a snapshot no load takes.
MAX_TABLE_BYTES = 2**30
_DTYPE = re.compile(r"^torch\.[a-z0-9_]+$")


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One box of a tensor, stored raw in ``file`` at ``byte_offset`` (``nbytes`` long)."""

    file: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    byte_offset: int
    nbytes: int
    checksum: str  # hex, of the table's ``checksum_algorithm``


@dataclass(frozen=True, kw_only=True)
class TensorRecord:
    dtype: str  # "torch.float32"
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    placements: str | None = None  # the DTensor's placements when saved, for people


@dataclass(frozen=True, kw_only=True)
class ShardTable:
    world_size: int
    tensors: Mapping[str, TensorRecord]
    byteorder: str = "little"
    checksum_algorithm: str = CHUNK_ALGORITHM

    def files(self) -> dict[str, list[tuple[str, Chunk]]]:
        """Shard file name -> its chunks (fqn, chunk), for show/verify."""
        out: dict[str, list[tuple[str, Chunk]]] = {}
        for fqn, record in self.tensors.items():
            for chunk in record.chunks:
                out.setdefault(chunk.file, []).append((fqn, chunk))
        return out


def fqn(path: Sequence[Any]) -> str:
    return json.dumps(list(path), separators=(",", ":"))


def shard_file_name(rank: int, token: str) -> str:
    return f"shard-{rank:05d}.{token}{SHARD_SUFFIX}"


def table_file_name(token: str) -> str:
    return f"{TABLE_PREFIX}.{token}.json"


def is_marker(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and TENSOR_MARKER in value


# ---------------------------------------------------------------- JSON form
def to_json(table: ShardTable) -> bytes:
    body = {
        "format": TABLE_FORMAT,
        "world_size": table.world_size,
        "byteorder": table.byteorder,
        "checksum_algorithm": table.checksum_algorithm,
        "tensors": {k: _record_json(r) for k, r in sorted(table.tensors.items())},
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode("utf-8")


def _record_json(record: TensorRecord) -> dict[str, Any]:
    return {
        "dtype": record.dtype,
        "shape": list(record.shape),
        "placements": record.placements,
        "chunks": [
            {
                "file": c.file,
                "offsets": list(c.offsets),
                "sizes": list(c.sizes),
                "byte_offset": c.byte_offset,
                "nbytes": c.nbytes,
                "checksum": c.checksum,
            }
            for c in record.chunks
        ],
    }


def from_json(data: bytes) -> ShardTable:
    """Parse and validate; every problem is a SnapshotCorruptError naming it."""
    if len(data) > MAX_TABLE_BYTES:
        raise SnapshotCorruptError(table_size_problem(len(data)))
    try:
        body = json.loads(data.decode("utf-8"))
        table = _table(body)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise SnapshotCorruptError(f"shard table is malformed: {str(exc)[:200]}") from exc
    if table.byteorder != "little" or sys.byteorder != "little":
        raise SnapshotCorruptError(
            f"shard table byte order {table.byteorder!r}: only little-endian is supported"
        )
    return table


def _table(body: Any) -> ShardTable:
    if not isinstance(body, dict) or body.get("format") not in TABLE_FORMATS:
        raise ValueError(f"not a shard table of format {sorted(TABLE_FORMATS)}")
    tensors = body["tensors"]
    if not isinstance(tensors, dict):
        raise TypeError("tensors must be an object")
    algorithm, key = _digest_field(body)
    return ShardTable(
        world_size=_int(body["world_size"]),
        byteorder=str(body["byteorder"]),
        checksum_algorithm=algorithm,
        tensors={str(k): _record(k, v, algorithm, key) for k, v in tensors.items()},
    )


def _digest_field(body: dict[str, Any]) -> tuple[str, str]:
    """The chunks' checksum algorithm and the chunk field holding the digest; an unknown
    algorithm is damage, never a skipped check."""
    if body["format"] == 1:
        return "sha256", "sha256"
    algorithm = body["checksum_algorithm"]
    if algorithm not in CHECKSUM_ALGORITHMS:
        allowed = sorted(CHECKSUM_ALGORITHMS)
        raise ValueError(f"checksum_algorithm {str(algorithm)[:40]!r} is not one of {allowed}")
    return str(algorithm), "checksum"


def _record(name: str, raw: Any, algorithm: str, key: str) -> TensorRecord:
    dtype = raw["dtype"]
    if not isinstance(dtype, str) or not _DTYPE.match(dtype):
        raise ValueError(f"tensor {name[:80]}: dtype {str(dtype)[:40]!r} is not a torch dtype")
    shape = _ints(raw["shape"])
    chunks = tuple(_chunk(c, len(shape), algorithm, key) for c in raw["chunks"])
    placements = raw.get("placements")
    if placements is not None and not isinstance(placements, str):
        raise TypeError(f"tensor {name[:80]}: placements must be a string")
    return TensorRecord(dtype=dtype, shape=shape, chunks=chunks, placements=placements)


def _chunk(raw: Any, ndim: int, algorithm: str, key: str) -> Chunk:
    name = raw["file"]
    if not isinstance(name, str) or not layout.is_safe_file_name(name):
        raise ValueError(f"chunk file {str(name)[:80]!r} escapes the snapshot folder")
    offsets, sizes = _ints(raw["offsets"]), _ints(raw["sizes"])
    if len(offsets) != ndim or len(sizes) != ndim:
        raise ValueError(f"chunk in {name} has {len(offsets)} offsets for {ndim} dimensions")
    digest = raw[key]
    if not is_hex_digest(digest, algorithm):
        raise ValueError(f"chunk in {name}: checksum is not a {algorithm} hex digest")
    return Chunk(
        file=name,
        offsets=offsets,
        sizes=sizes,
        byte_offset=_int(raw["byte_offset"]),
        nbytes=_int(raw["nbytes"]),
        checksum=digest,
    )


def _ints(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise TypeError("expected a list of integers")
    return tuple(_int(v) for v in raw)


def table_size_problem(size: int) -> str:
    return f"shard table has {size} bytes, more than a table may ({MAX_TABLE_BYTES})"


def check_extents(
    table: ShardTable, file_sizes: Mapping[str, int], itemsize: Callable[[str], int]
) -> None:
    """Every size the table gives, checked before any of it is allocated or read: each chunk
    lies inside its shard file (``file_sizes``: the checked real sizes) and inside its
    tensor's shape, ``nbytes`` is its box's elements times the dtype's ``itemsize``, and a
    tensor holds no more bytes than its chunks do (the full tensor a load allocates).
    SnapshotCorruptError names the first entry that fails."""
    for name, record in table.tensors.items():
        width = itemsize(record.dtype)
        for chunk in record.chunks:
            problem = _chunk_problem(record, chunk, width, file_sizes.get(chunk.file, 0))
            if problem:
                raise SnapshotCorruptError(f"shard table, tensor {name[:120]}: {problem}")
        stored = sum(c.nbytes for c in record.chunks)
        if _volume(record.shape) * width > stored:
            raise SnapshotCorruptError(
                f"shard table, tensor {name[:120]}: shape {list(record.shape)[:8]} needs "
                f"more bytes than its chunks hold ({stored})"
            )


def _chunk_problem(record: TensorRecord, chunk: Chunk, width: int, file_size: int) -> str | None:
    where = f"the chunk at byte {chunk.byte_offset} of {chunk.file}"
    end = chunk.byte_offset + chunk.nbytes
    if end > file_size:
        return f"{where} ({chunk.nbytes} bytes) runs past the file's end ({file_size} bytes)"
    boxes = zip(chunk.offsets, chunk.sizes, record.shape, strict=True)
    if any(start + length > dim for start, length, dim in boxes):
        return f"{where} lies outside the tensor's shape {list(record.shape)[:8]}"
    expected = _volume(chunk.sizes) * width
    if chunk.nbytes != expected:
        return f"{where} has nbytes {chunk.nbytes}, its box of {record.dtype} needs {expected}"
    return None


def _volume(sizes: Sequence[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise ValueError(f"expected a non-negative integer, got {str(value)[:40]}")
    return value


# ---------------------------------------------------------------- summary
def summary(table: ShardTable, files: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    """For ``snapshots show``: ``files`` is each shard file's (rank, size) from the manifest;
    per rank, its file, bytes, and the chunks and tensors the table puts in it."""
    by_file = table.files()
    ranks = []
    for name, (rank, size) in sorted(files.items(), key=lambda item: item[1][0]):
        chunks = by_file.get(name, [])
        ranks.append(
            {
                "rank": rank,
                "file": name,
                "bytes": size,
                "chunks": len(chunks),
                "tensors": len({fqn for fqn, _ in chunks}),
            }
        )
    return {
        "world_size": table.world_size,
        "tensors": len(table.tensors),
        "chunks": sum(len(r.chunks) for r in table.tensors.values()),
        "chunk_checksum": table.checksum_algorithm,
        "bytes": sum(r["bytes"] for r in ranks),
        "ranks": ranks,
    }


# ---------------------------------------------------------------- trees
def split(tree: Any, path: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]:
    """The skeleton of ``tree`` (tensors replaced by markers) and its tensors by fqn."""
    tensors: dict[str, Any] = {}
    return _split(tree, path, tensors, _is_tensor), tensors


def _is_tensor(value: Any) -> bool:
    import torch  # only when trees are split: the read-only tools never come here

    return isinstance(value, torch.Tensor)


def _split(obj: Any, path: tuple[Any, ...], out: dict[str, Any], is_tensor: Any) -> Any:
    if is_tensor(obj):
        name = fqn(path)
        out[name] = obj
        return {TENSOR_MARKER: name}
    if isinstance(obj, Mapping):
        mapped = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            mapped[k] = _split(v, (*path, k), out, is_tensor)
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            mapped._metadata = metadata  # nn.Module versions (BatchNorm needs them)
        return mapped
    if type(obj) in (list, tuple):
        return type(obj)(_split(v, (*path, i), out, is_tensor) for i, v in enumerate(obj))
    return obj


def fill(skeleton: Any, tensors: Mapping[str, Any]) -> Any:
    """The skeleton with each marker replaced by ``tensors[fqn]`` (SnapshotCorruptError if a
    marker names a tensor the table does not hold)."""
    if is_marker(skeleton):
        name = skeleton[TENSOR_MARKER]
        if name not in tensors:
            raise SnapshotCorruptError(f"skeleton names tensor {str(name)[:120]} not in the table")
        return tensors[name]
    if isinstance(skeleton, Mapping):
        out = type(skeleton)() if type(skeleton) is not dict else {}
        for k, v in skeleton.items():
            out[k] = fill(v, tensors)
        metadata = getattr(skeleton, "_metadata", None)
        if metadata is not None:
            out._metadata = metadata
        return out
    if type(skeleton) in (list, tuple):
        return type(skeleton)(fill(v, tensors) for v in skeleton)
    return skeleton


def markers(skeleton: Any) -> list[str]:
    """Every fqn a skeleton refers to, in tree order."""
    found: list[str] = []
    fill(skeleton, _Recorder(found))
    return found


class _Recorder(dict):  # type: ignore[type-arg]
    """A mapping that holds every key and records the ones asked for."""

    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self._found = found

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> None:
        self._found.append(key)
