"""Tensors <-> shard files, with torch.distributed.checkpoint's planners doing the geometry.

Save: ``DefaultSavePlanner`` turns each rank's flat ``{fqn: tensor or DTensor}`` into write
items (a DTensor's local shard with its global offsets; a plain tensor whole); its global
plan (``create_global_plan``, computed identically on every rank from the all-gathered local
plans) deduplicates replicated items, giving each to the rank with the fewest bytes planned
so far, so each rank writes about 1/W of the replicated bytes. Each rank stages its items'
tensors into reused buffers (the only part the training loop waits for) and writes them as
one raw file; every chunk gets its own BLAKE3 checksum.

Load: ``DefaultLoadPlanner`` is given templates (this rank's current DTensors, or full empty
tensors) and a DCP ``Metadata`` built in memory from our JSON table (DCP's pickled
``.metadata`` file is never written nor read), and returns read items: which box of which
stored chunk goes where in which local tensor. We range-read each needed chunk once (runs
of consecutive chunks in one read, ``snapshots.read.spans``), check its checksum (the table
names the algorithm), view it with ``torch.frombuffer`` (no unpickling), and copy the boxes
in.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.tensor import DTensor

from snapshots.errors import SnapshotCorruptError
from snapshots.format import layout, sharding
from snapshots.format.manifest import FileEntry, checksum
from snapshots.format.serialization import staging_buffer
from snapshots.format.sharding import CHUNK_ALGORITHM, Chunk, ShardTable, TensorRecord
from snapshots.read import spans
from snapshots.storage.base import Storage, read_range

# A stored chunk is at most this long: a local shard is cut into blocks of whole rows (dim 0)
# so that a rank loading at another world size reads, and hashes, little it does not need.
CHUNK_BYTES = 2**20


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One chunk this rank writes: where it sits in the global tensor and in the file."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    byte_offset: int
    nbytes: int
    placements: str | None


@dataclass(frozen=True, kw_only=True)
class StagedShard:
    """This rank's shard file, staged: ``data`` is the file's bytes (a view of a buffer
    reused across saves), the pieces back to back."""

    pieces: list[Piece]
    data: memoryview
    # (buffer view, source) copies left for later: an overlapped save's tensors that change
    # only in ``optimizer.step()``; ``snapshots.write.capture`` hands them to its Stager, whose
    # writer thread and step hook copy them
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def copy_deferred(self) -> None:
        """Copy what is still deferred here (nothing once a SnapshotStore's capture took the
        copies over); for callers that stage shards outside a SnapshotStore."""
        _copy(self.deferred)
        self.deferred.clear()


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buf, source in pairs:
            buf.copy_(source)


def local_plan(tensors: Mapping[str, torch.Tensor]) -> tuple[DefaultSavePlanner, SavePlan]:
    """This rank's write items for its flat tensors (to be all-gathered)."""
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner.set_up_planner(dict(tensors), is_coordinator=False)
    return planner, planner.create_local_plan()


def my_items(planner: DefaultSavePlanner, all_plans: list[SavePlan], rank: int) -> SavePlan:
    """This rank's share after deduplication; the same answer on every rank."""
    global_plans, _ = planner.create_global_plan(all_plans)
    return global_plans[rank]


class ShardStager:
    """Copies this rank's planned chunks into one buffer reused across saves: the file is
    that buffer, so writing it copies nothing more (the only copy the training loop waits
    for is this one)."""

    def __init__(self) -> None:
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._layout: list[Piece] = []

    def stage(
        self,
        planner: DefaultSavePlanner,
        plan: SavePlan,
        tensors: Mapping[str, torch.Tensor],
        *,
        defer: frozenset[int] = frozenset(),
    ) -> StagedShard:
        """``defer``: data pointers (``step_tensors``) of tensors to copy later, on the
        writer thread or in ``optimizer.step()``'s hook (``StagedShard.deferred``); the rest
        is copied now."""
        pieces, blocks, later, size = [], [], [], 0
        for item, source in _sources(planner, plan):
            where = tuple(item.tensor_data.chunk.offsets)
            for row, block in _blocks(source.detach()):
                # Only CPU sources: a device copy on the writer thread would need its own
                # stream synchronisation (as in serialization.Stager).
                later.append(source.device.type == "cpu" and source.data_ptr() in defer)
                nbytes = block.numel() * block.element_size()
                pieces.append(
                    Piece(
                        fqn=item.index.fqn,
                        dtype=str(source.dtype),
                        shape=tuple(item.tensor_data.size),
                        offsets=(where[0] + row, *where[1:]) if where else (),
                        sizes=tuple(block.shape),
                        byte_offset=size,
                        nbytes=nbytes,
                        placements=_placements(tensors[item.index.fqn]),
                    )
                )
                blocks.append(block)
                size += nbytes
        arena = self._arena_for(pieces, size)
        copies = [(_box(arena, p, b.dtype), b) for p, b in zip(pieces, blocks, strict=True)]
        _copy([c for c, deferred in zip(copies, later, strict=True) if not deferred])
        return StagedShard(
            pieces=pieces,
            data=memoryview(arena.numpy())[:size],
            deferred=[c for c, deferred in zip(copies, later, strict=True) if deferred],
        )

    def _arena_for(self, pieces: list[Piece], size: int) -> torch.Tensor:
        if pieces != self._layout or self._arena.numel() < size:
            # its own pages: page-aligned, so the file can be written past the page cache
            self._arena = staging_buffer(torch.Size([size]), torch.uint8)
            self._layout = pieces
        return self._arena


def step_tensors(optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """Data pointers of the (local) tensors that change only in ``optimizer.step()``: its
    parameters and state. An overlapped save copies them later; a tensor it does not list
    (a buffer, a state-dict copy) is copied at the call."""

    def ptr(t: torch.Tensor) -> int:
        return (t.to_local() if isinstance(t, DTensor) else t).data_ptr()

    found = {ptr(p) for group in optimizer.param_groups for p in group["params"]}
    for per_param in optimizer.state.values():
        found.update(ptr(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return frozenset(found)


def _sources(planner: DefaultSavePlanner, plan: SavePlan) -> list[tuple[Any, torch.Tensor]]:
    """The planned tensors, largest element size first: every chunk then starts at a multiple
    of its element size (sizes are powers of two), so it can be viewed as its dtype in the
    buffer without padding, and every byte of the file is covered by a chunk's checksum."""
    found = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            continue  # we pass tensors only; plain values live in the skeleton
        source = planner.resolve_data(item)
        if isinstance(source, torch.Tensor):  # tensors only were planned
            found.append((item, source))
    return sorted(found, key=lambda pair: -pair[1].element_size())


def _blocks(tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``tensor`` cut along dim 0 into blocks of at most CHUNK_BYTES (at least one row)."""
    if tensor.dim() == 0 or tensor.shape[0] <= 1:
        return [(0, tensor)]
    row = tensor[0].numel() * tensor.element_size()
    rows = max(1, CHUNK_BYTES // max(row, 1))
    return [(r, tensor[r : r + rows]) for r in range(0, tensor.shape[0], rows)]


def _box(arena: torch.Tensor, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
    """The piece's bytes in the buffer, viewed as its tensor (see ``_sources``)."""
    flat = arena[piece.byte_offset : piece.byte_offset + piece.nbytes]
    return flat.view(dtype).view(piece.sizes)


def _placements(tensor: torch.Tensor) -> str | None:
    if isinstance(tensor, DTensor):
        return f"{tuple(tensor.placements)} on mesh {tuple(tensor.device_mesh.shape)}"
    return None


def encode(staged: StagedShard, name: str, *, shard: int) -> tuple[FileEntry, dict]:
    """The manifest entry of one rank's shard file and the table records ``{fqn:
    TensorRecord}`` of its chunks; each chunk is hashed once, the file once."""
    records: dict[str, TensorRecord] = {}
    for p in staged.pieces:
        raw = staged.data[p.byte_offset : p.byte_offset + p.nbytes]
        chunk = Chunk(
            file=name,
            offsets=p.offsets,
            sizes=p.sizes,
            byte_offset=p.byte_offset,
            nbytes=p.nbytes,
            checksum=checksum(raw, CHUNK_ALGORITHM),
        )
        known = records.get(p.fqn)
        chunks = (*known.chunks, chunk) if known is not None else (chunk,)
        records[p.fqn] = TensorRecord(
            dtype=p.dtype, shape=p.shape, chunks=chunks, placements=p.placements
        )
    data = staged.data
    entry = FileEntry(name=name, size=len(data), checksum=checksum(data), shard=shard)
    return entry, records


def merge(world_size: int, reports: list[Mapping[str, TensorRecord]]) -> ShardTable:
    """Rank 0: one table from every rank's records (chunks in rank order)."""
    tensors: dict[str, TensorRecord] = {}
    for records in reports:
        for name, record in records.items():
            known = tensors.get(name)
            if known is None:
                tensors[name] = record
            else:
                merged = (*known.chunks, *record.chunks)
                tensors[name] = TensorRecord(
                    dtype=known.dtype, shape=known.shape, chunks=merged, placements=known.placements
                )
    return ShardTable(world_size=world_size, tensors=tensors)


# ---------------------------------------------------------------- load
def dtype_of(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise SnapshotCorruptError(f"shard table names an unknown dtype {name[:40]!r}")
    return value


def itemsize_of(name: str) -> int:
    return torch.empty((), dtype=dtype_of(name)).element_size()


def full_templates(table: ShardTable, names: list[str]) -> dict[str, torch.Tensor]:
    """Empty full tensors to read whole tensors into (export, replicated state)."""
    out = {}
    for name in names:
        record = _record(table, name)
        out[name] = torch.empty(record.shape, dtype=dtype_of(record.dtype))
    return out


def _record(table: ShardTable, name: str) -> TensorRecord:
    record = table.tensors.get(name)
    if record is None:
        raise SnapshotCorruptError(f"skeleton names tensor {name[:120]} not in the shard table")
    return record


def to_dcp_metadata(table: ShardTable, names: list[str]) -> Metadata:
    """DCP's Metadata for ``names``, built from our table (never from a pickle)."""
    entries = {}
    for name in names:
        record = _record(table, name)
        entries[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_of(record.dtype)),
            size=torch.Size(record.shape),
            chunks=[
                ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                for c in record.chunks
            ],
        )
    return Metadata(state_dict_metadata=entries)


def read_into(
    storage: Storage, step: int, table: ShardTable, templates: Mapping[str, torch.Tensor]
) -> None:
    """Fill ``templates`` (local shards or full tensors) from the chunks overlapping them.
    Every chunk's checksum is checked before its bytes are viewed as a tensor."""
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner.set_up_planner(dict(templates), to_dcp_metadata(table, list(templates)), False)
    by_chunk: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    for item in planner.create_local_plan().items:
        key = (item.storage_index.fqn, tuple(item.storage_index.offset))
        by_chunk.setdefault(key, []).append(item)
    stored = {(n, c.offsets): (r, c) for n, r in table.tensors.items() for c in r.chunks}
    keys = {stored[key][1]: key for key in by_chunk}
    with torch.no_grad():
        for span in spans.spans(keys):
            data = read_range(
                storage, f"{layout.step_dir(step)}/{span.file}", span.start, span.length
            )
            for chunk in span.chunks:
                begin = chunk.byte_offset - span.start
                raw = memoryview(data)[begin : begin + chunk.nbytes]
                key = keys[chunk]
                source = _chunk_tensor(raw, table, stored[key][0], chunk)
                for item in by_chunk[key]:
                    box = _narrow(source, item.storage_offsets, item.lengths)
                    dest = planner.resolve_tensor(item).detach()
                    dest.copy_(box)
                    planner.commit_tensor(item, dest)


def _chunk_tensor(
    data: memoryview, table: ShardTable, record: TensorRecord, chunk: Chunk
) -> torch.Tensor:
    """The chunk's bytes as its tensor (no copy), once they pass its checksum."""
    if checksum(data, table.checksum_algorithm) != chunk.checksum:
        raise SnapshotCorruptError(
            f"file {chunk.file}: the chunk at byte {chunk.byte_offset} fails its "
            f"{table.checksum_algorithm} checksum (damaged)"
        )
    dtype = dtype_of(record.dtype)
    count = 1
    for size in chunk.sizes:
        count *= size
    if count * torch.empty((), dtype=dtype).element_size() != len(data):
        raise SnapshotCorruptError(f"file {chunk.file}: a chunk's length does not match its box")
    if not data:
        return torch.empty(chunk.sizes, dtype=dtype)
    with warnings.catch_warnings():
        # Read-only bytes, viewed without a copy: this tensor is only ever copied from.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype).reshape(chunk.sizes)


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


TemplateFn = Callable[[ShardTable, Mapping[str, Any]], dict[str, torch.Tensor]]


def assemble(
    storage: Storage,
    step: int,
    table: ShardTable,
    skeleton: Mapping[str, Any],
    templates: TemplateFn | None = None,
) -> dict[str, Any]:
    """The state of a sharded snapshot: each skeleton with its tensors read in.
    ``templates(table, skeleton)`` gives local shards to fill (default: full tensors)."""
    chosen = templates(table, skeleton) if templates is not None else {}
    wanted = [n for sk in skeleton.values() for n in sharding.markers(sk)]
    chosen.update(full_templates(table, [n for n in wanted if n not in chosen]))
    read_into(storage, step, table, chosen)
    return {k: sharding.fill(v, chosen) for k, v in skeleton.items()}
