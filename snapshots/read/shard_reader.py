"""Reading sharded snapshots (format 2): the table, cheap checks first, then the chunks.

The manifest's checksum covers the shard table, whose size is bounded before it is read.
Every size and offset in the table is checked against the shard files' real sizes and the
tensors' shapes before anything is allocated (``sharding.check_extents``). Each shard file is
checked against the manifest's size from one listing before any chunk is read (a truncated or
deleted file is named at once), and every chunk read is checked against its own checksum
(BLAKE3; sha256 in tables of format 1) before its bytes are viewed as a tensor. A rank reads
only the chunks it needs, so it does not hash whole files it reads a part of: the unit of
verification on load is the chunk, the bytes actually used. ``verify`` (and ``snapshots
verify``) checks every whole file against the manifest.

Nothing here imports torch until a table is checked for a load or a deep verify (its dtypes'
item sizes): the read-only tools use the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from snapshots.errors import SnapshotCorruptError
from snapshots.format import sharding
from snapshots.format.manifest import FileEntry, Manifest, checksum
from snapshots.format.sharding import ShardTable
from snapshots.read import reader
from snapshots.storage import Storage

if TYPE_CHECKING:
    from snapshots.sharded.shards import TemplateFn


def table_entry(manifest: Manifest) -> FileEntry | None:
    """The manifest's shard table entry, refused as damage when it is larger than any table
    could be: checked before the table is read, so a damaged size costs no download."""
    entry = manifest.table_file()
    if entry is not None and entry.size > sharding.MAX_TABLE_BYTES:
        raise SnapshotCorruptError(f"file {entry.name}: {sharding.table_size_problem(entry.size)}")
    return entry


def parse_table(manifest: Manifest, data: bytes) -> ShardTable:
    table = sharding.from_json(data)
    shard_names = {f.name for f in manifest.shard_files().values()}
    for name, record in table.tensors.items():
        for chunk in record.chunks:
            if chunk.file not in shard_names:
                raise SnapshotCorruptError(
                    f"shard table puts tensor {name[:120]} in {chunk.file}, which the "
                    "manifest does not list"
                )
    return table


def check_extents(manifest: Manifest, table: ShardTable) -> None:
    """Every chunk inside its shard file (the manifest's sizes, which a load checks against a
    listing first) and consistent with its tensor's dtype and shape."""
    from snapshots.sharded import shards

    sizes = {f.name: f.size for f in manifest.shard_files().values()}
    sharding.check_extents(table, sizes, shards.itemsize_of)


def assemble(
    storage: Storage,
    step: int,
    manifest: Manifest,
    table_bytes: bytes,
    skeleton: Mapping[str, Any],
    templates: TemplateFn | None,
) -> dict[str, Any]:
    """The loaded state: skeletons with their tensors (local shards where templated)."""
    from snapshots.sharded import shards

    table = parse_table(manifest, table_bytes)
    problems = reader.check_sizes(storage, step, manifest.shard_files().values())
    if problems:
        raise SnapshotCorruptError("; ".join(problems))
    check_extents(manifest, table)
    return shards.assemble(storage, step, table, skeleton, templates)


def chunk_problems(manifest: Manifest, data: Mapping[str, bytes]) -> list[str]:
    """Deep verification of verified whole files: the table parses and matches the manifest,
    and every chunk's bytes pass their own checksum."""
    table_file = manifest.table_file()
    if table_file is None or table_file.name not in data:
        return []
    try:
        table = parse_table(manifest, data[table_file.name])
        check_extents(manifest, table)
    except SnapshotCorruptError as exc:
        return [f"file {table_file.name}: {exc}"]
    problems, algorithm = [], table.checksum_algorithm
    for name, chunks in table.files().items():
        blob = data.get(name, b"")
        for fqn, chunk in chunks:
            part = blob[chunk.byte_offset : chunk.byte_offset + chunk.nbytes]
            if len(part) != chunk.nbytes or checksum(part, algorithm) != chunk.checksum:
                problems.append(f"file {name}: the chunk of tensor {fqn[:120]} is damaged")
    return problems
