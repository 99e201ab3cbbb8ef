"""The byte layout of an in-memory copy (``worker.memory.tier``): the raw bytes of the state's
dense tensors, then a small ``torch.save`` of its skeleton.

Why not ``torch.save`` of the whole tree: its zip writer computes a CRC32 of every byte,
a large share of its cost, for a file that lives in memory and never crosses a disk or a
network.
The skeleton is read back with ``weights_only=True`` after the whole copy's checksum (kept in
the commit marker) is verified, so loading a copy executes no code and damage is never used.

Checksum: xxh3_128 (python-xxhash), not the BLAKE3 of storage snapshots. The digest lives in
the commit marker beside the data, in the supervisor's private tmpfs folder: whoever could
forge a copy could forge its marker too (one trust domain), so the checksum guards against
torn and damaged copies, not a forger, and a cryptographic hash buys nothing here while
costing several times as much per byte, on every copy. A copy
names its algorithm (the marker's key); one with another or none is not used.

Layout: a 16-byte header (little-endian offset and length of the skeleton), every tensor's
bytes at a 64-byte aligned offset (the gaps are zeros), then the skeleton, which maps each
tensor to (dtype, shape, offset, bytes). Tensors come first so that their offsets depend only
on their shapes and dtypes: a slot file keeps its layout from step to step (``plan`` then
``write_into`` a mapped slot) while numbers in the skeleton grow.
"""

from __future__ import annotations

import io
import mmap
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch
import xxhash

_TENSOR = "__elastic_train_memory_tensor__"  # placeholder key in the skeleton
_HEADER = struct.Struct("<QQ")
_ALIGN = 64  # every tensor's offset: a cache line, and a multiple of any element size
_KEEP = object()
# Large tensors are copied and checksummed in pieces this size: each piece is hashed while it
# is still in the cache from its copy (a 9 MB tensor would have left it).
CHUNK_BYTES = 1 << 20

CHECKSUM_ALGORITHM = "xxh3_128"  # fast, non-cryptographic (see above); the marker's key


def hasher() -> Any:
    return xxhash.xxh3_128()


def checksum(data: Any) -> str:
    """The hex digest of ``data`` (bytes-like) by ``CHECKSUM_ALGORITHM``."""
    return str(xxhash.xxh3_128_hexdigest(data))


def is_hex_digest(value: Any) -> bool:
    """Whether ``value`` is a lowercase hex digest of ``CHECKSUM_ALGORITHM``'s length."""
    length = hasher().digest_size * 2
    return isinstance(value, str) and len(value) == length and not value.strip("0123456789abcdef")


@dataclass(frozen=True)
class Layout:
    """Where everything of one copy goes (``plan``): the tensors, in order, at ``offsets``."""

    tensors: list[torch.Tensor]
    offsets: list[int]
    skeleton: bytes
    skeleton_offset: int
    split_from: int  # where the tensors known to be equal on every rank start (``plan``)

    @property
    def size(self) -> int:
        return self.skeleton_offset + len(self.skeleton)

    def header(self) -> bytes:
        return _HEADER.pack(self.skeleton_offset, len(self.skeleton))


def plan(
    payload: Mapping[str, Any], replicated: Callable[[torch.Tensor], bool] | None = None
) -> Layout:
    """Lay out ``payload``: its strided tensors (on any device) go raw, the rest of it into the
    skeleton (pickled; it must be what ``torch.load(weights_only=True)`` reads back). Tensors
    that ``replicated`` says are equal on every rank (DDP's parameters and optimizer state, not
    its buffers) go last, from ``split_from``: the ranks of a node may split those bytes."""
    found: list[torch.Tensor] = []
    skeleton = _walk(dict(payload), lambda obj: _strip(obj, found))
    same = [replicated is not None and replicated(t) for t in found]
    order = sorted(range(len(found)), key=lambda i: same[i])  # stable: the others first
    table: list[Any] = [None] * len(found)  # in the skeleton's order: its placeholders index it
    offsets, end, split_from = [], _HEADER.size, None
    for i in order:
        t = found[i]
        offset, nbytes = _aligned(end), t.numel() * t.element_size()
        if same[i] and split_from is None:
            split_from = offset
        table[i] = (str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes)
        offsets.append(offset)
        end = offset + nbytes
    head = io.BytesIO()
    torch.save({"skeleton": skeleton, "tensors": table}, head)
    tensors = [found[i] for i in order]
    end = _aligned(end)
    return Layout(tensors, offsets, head.getvalue(), end, end if split_from is None else split_from)


def write(payload: Mapping[str, Any], f: IO[bytes]) -> str:
    """Write the copy to ``f``; returns the checksum of every byte written (the commit marker
    keeps it: a copy is checked before its skeleton is unpickled, like a storage snapshot)."""
    layout = plan(payload)
    digest = hasher()
    for data in _pieces(layout):
        f.write(data)
        digest.update(data)
    return str(digest.hexdigest())


def write_into(
    layout: Layout,
    slot: torch.Tensor,
    start: int = 0,
    stop: int | None = None,
    *,
    copied_below: int = 0,
) -> str:
    """Copy bytes [start, stop) of the copy (all of it by default; a part starts at a tensor's
    offset, ``plan.part_bounds``) into ``slot``, a uint8 CPU tensor of at least
    ``layout.size`` bytes (a mapped slot file), with one copy per tensor, checksumming each
    region right after copying it; returns the checksum of those bytes. ``copy_`` takes any
    source: a CUDA tensor is copied to the host on the way. ``copied_below``: the tensors
    starting below this offset are in the slot already (``copy_into``), only checksummed."""
    end = layout.size if stop is None else stop
    if slot.numel() < layout.size:
        raise ValueError(f"the slot has {slot.numel()} bytes; the copy needs {layout.size}")
    view = slot.numpy()  # zero-copy: the hasher reads its slices, small writes go through it
    if start == 0:
        view[: _HEADER.size] = np.frombuffer(layout.header(), dtype=np.uint8)
    digest, done = hasher(), start  # bytes [start, done) are copied and checksummed
    with torch.no_grad():
        for t, offset in zip(layout.tensors, layout.offsets, strict=True):
            if start <= offset < end:
                view[max(done, _HEADER.size) : offset] = 0
                if offset < copied_below:
                    ends: Iterator[int] = iter((offset + t.numel() * t.element_size(),))
                else:
                    ends = _copy_tensor(t, slot, offset)
                for stop_at in ends:
                    digest.update(view[done:stop_at])
                    done = stop_at
    view[max(done, _HEADER.size) : min(end, layout.skeleton_offset)] = 0
    if end == layout.size:
        skeleton = np.frombuffer(layout.skeleton, dtype=np.uint8)
        view[layout.skeleton_offset : layout.size] = skeleton
    digest.update(view[done:end])
    return str(digest.hexdigest())


def copy_into(layout: Layout, slot: torch.Tensor, start: int, stop: int, below: int) -> None:
    """Copy the tensors of bytes [start, stop) that start below ``below`` into ``slot``: the
    first half of ``write_into(..., copied_below=below)``, for the tensors that cannot wait."""
    if slot.numel() < layout.size:
        raise ValueError(f"the slot has {slot.numel()} bytes; the copy needs {layout.size}")
    with torch.no_grad():
        for t, offset in zip(layout.tensors, layout.offsets, strict=True):
            if start <= offset < min(stop, below):
                for _ in _copy_tensor(t, slot, offset):
                    pass


def _copy_tensor(t: torch.Tensor, slot: torch.Tensor, offset: int) -> Iterator[int]:
    """Copy ``t`` to ``slot[offset:]``; yields the end of what is copied, piece by piece."""
    nbytes = t.numel() * t.element_size()
    dst = slot[offset : offset + nbytes]
    if not copied_flat(t) or nbytes <= CHUNK_BYTES:  # one copy_ (strides, devices resolved)
        dst.view(t.dtype).view(t.shape).copy_(t)
        yield offset + nbytes
        return
    src = t.detach().reshape(-1).view(torch.uint8)
    for start in range(0, nbytes, CHUNK_BYTES):
        stop = min(start + CHUNK_BYTES, nbytes)
        dst[start:stop].copy_(src[start:stop])
        yield offset + stop


def copied_flat(t: torch.Tensor) -> bool:
    """Whether ``t`` is copied as flat bytes, piece by piece: a contiguous CPU tensor. Any
    other (a CUDA tensor, strided, conjugated) goes through one ``copy_``, which resolves
    strides and copies device to host on the way."""
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def _pieces(layout: Layout) -> Iterator[Any]:
    """Every byte of the copy, in order (for ``write``)."""
    yield layout.header()
    end = _HEADER.size
    for t, offset in zip(layout.tensors, layout.offsets, strict=True):
        yield bytes(offset - end)
        host = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
        yield memoryview(host.reshape(-1).view(torch.uint8).numpy())
        end = offset + t.numel() * t.element_size()
    yield bytes(layout.skeleton_offset - end)
    yield layout.skeleton


def verify(data: bytes | bytearray | memoryview | mmap.mmap, expected: Any, what: str) -> None:
    """Raise ValueError unless ``data`` has the checksum ``expected`` (damage, or a copy
    checksummed by another algorithm or none: either way not used)."""
    if not is_hex_digest(expected):
        raise ValueError(f"{what} has no valid {CHECKSUM_ALGORITHM} checksum")
    if checksum(data) != expected:
        raise ValueError(f"{what} fails its {CHECKSUM_ALGORITHM} checksum (damaged)")


def read_buffer(size: int) -> bytearray | mmap.mmap:
    """Memory to read a copy of ``size`` bytes into: private anonymous pages, populated at
    once (``MAP_POPULATE``), about a third faster than a ``bytearray``, which zeroes its
    pages one fault at a time (``bench/memory_copy_cost.py``'s read); a ``bytearray`` where
    the flag is missing. Never a mapping of the slot file: the restored tensors share this
    memory, and the slot is written again by a later copy."""
    populate = getattr(mmap, "MAP_POPULATE", None)
    if populate is None or size == 0:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)


def read(data: bytearray | mmap.mmap) -> dict[str, Any]:
    """Tensors share ``data``'s memory (no copy). Call ``verify`` first."""
    start, length = _HEADER.unpack_from(data)
    if start + length > len(data):
        raise ValueError(f"the copy is truncated ({len(data)} bytes)")
    head = torch.load(io.BytesIO(data[start : start + length]), weights_only=True)
    tensors = []
    for dtype, shape, offset, nbytes in head["tensors"]:
        if offset + nbytes > start:
            raise ValueError(f"the copy's tensor table overlaps its skeleton at {offset}")
        if nbytes == 0:  # torch.frombuffer refuses a count of 0 (an uneven FSDP2 shard)
            tensors.append(torch.empty(shape, dtype=getattr(torch, dtype)))
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset)
        tensors.append(raw.view(getattr(torch, dtype)).reshape(shape))
    return _walk(head["skeleton"], lambda obj: _fill(obj, tensors))


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _raw(t: torch.Tensor) -> bool:
    """Strided tensors go raw (``copy_`` makes them contiguous and brings them to the host);
    sparse, quantized and tensor subclasses stay in the (pickled) skeleton."""
    plain = t.layout == torch.strided and not (t.is_quantized or t.is_nested or t.is_meta)
    return plain and type(t) is torch.Tensor


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor) and _raw(obj):
        tensors.append(obj)
        return {_TENSOR: len(tensors) - 1}
    return _KEEP


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, Mapping) and len(obj) == 1 and _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    return _KEEP


def _walk(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt with ``leaf``'s replacements (``_KEEP``: recurse or keep as is)."""
    replaced = leaf(obj)
    if replaced is not _KEEP:
        return replaced
    if isinstance(obj, Mapping):  # dict or OrderedDict (with a module's _metadata)
        out = obj.__class__()
        for k, v in obj.items():
            out[k] = _walk(v, leaf)
        if getattr(obj, "_metadata", None) is not None:
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_walk(v, leaf) for v in obj)
    return obj
