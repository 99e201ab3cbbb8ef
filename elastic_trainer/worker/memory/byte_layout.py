"""The byte layout of an in-memory copy (``worker.memory.tier``): the raw bytes of the state's
dense tensors, then a small ``torch.save`` of its skeleton.

Why not ``torch.save`` of the whole tree: its zip writer computes a CRC32 of every byte,
a large share of its cost, for a file that lives in memory and never crosses a disk or a
network.
The skeleton is read back with ``weights_only=True`` after the whole copy's checksum (kept in
the commit marker) is verified, so loading a copy executes no code and damage is never used.

Checksum: xxh3_128 (python-xxhash) of 16 MiB leaves, combined (``leaf_checksum``: the
leaves hash on several threads), not the BLAKE3 of storage snapshots. The digest lives in
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

from elastic_trainer.worker.memory import leaf_checksum

_TENSOR = "__elastic_train_memory_tensor__"  # placeholder key in the skeleton
_HEADER = struct.Struct("<QQ")
_ALIGN = 64  # every tensor's offset: a cache line, and a multiple of any element size
_KEEP = object()
# Large tensors are copied and checksummed in pieces this size: each piece is hashed while it
# is still in the cache from its copy (a 9 MB tensor would have left it).
CHUNK_BYTES = 1 << 20
# A tensor on the GPU is copied to the host in pieces this size: each is checksummed (on
# another thread) while the next crosses the device's link; larger than CHUNK_BYTES, as each
# copy from the device waits for it.
DEVICE_PIECE_BYTES = 16 << 20

# Tensors read back smaller than this get memory of their own (``read``).
OWN_MEMORY_BYTES = 1 << 16
CHECKSUM_ALGORITHM = leaf_checksum.ALGORITHM  # the marker's key


def checksum(data: Any) -> str:
    """The hex digest of ``data`` (bytes-like) by ``CHECKSUM_ALGORITHM``."""
    return leaf_checksum.checksum(data)


def is_hex_digest(value: Any) -> bool:
    """Whether ``value`` is a lowercase hex digest of ``CHECKSUM_ALGORITHM``'s length."""
    length = leaf_checksum.DIGEST_SIZE * 2
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

    @property
    def on_device(self) -> bool:
        """Whether any tensor is on a CUDA device (its copy crosses the device's link)."""
        return any(t.device.type == "cuda" for t in self.tensors)

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
    digest = leaf_checksum.Hasher()
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
    done = start  # bytes [start, done) are copied (and checksummed, or queued to be)
    # A state on the GPU: its leaves are checksummed on other threads while the next pieces
    # cross the device's link (on an H200, 10.7 GB: 0.17 s per GB with one thread hashing
    # beside the copy, 0.026 s per GB so). Else each piece in this thread right after its
    # copy, still in the cache: on 2 cores, threads made a CPU state's copy slower (0.24 s per
    # GB against 0.21).
    digest = leaf_checksum.RangeDigest(view, start, end, parallel=layout.on_device)
    with torch.no_grad(), digest:
        for t, offset in zip(layout.tensors, layout.offsets, strict=True):
            if start <= offset < end:
                view[max(done, _HEADER.size) : offset] = 0
                if offset < copied_below:
                    ends: Iterator[int] = iter((offset + t.numel() * t.element_size(),))
                else:
                    ends = _copy_tensor(t, slot, offset)
                for stop_at in ends:
                    digest.advance(stop_at)
                    done = stop_at
        view[max(done, _HEADER.size) : min(end, layout.skeleton_offset)] = 0
        if end == layout.size:
            skeleton = np.frombuffer(layout.skeleton, dtype=np.uint8)
            view[layout.skeleton_offset : layout.size] = skeleton
        digest.advance(end)
        return digest.hexdigest()


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
    piece = CHUNK_BYTES if copied_flat(t) else DEVICE_PIECE_BYTES if _flat_on_gpu(t) else 0
    if nbytes <= piece or not piece:  # one copy_ (strides, devices resolved)
        dst.view(t.dtype).view(t.shape).copy_(t)
        yield offset + nbytes
        return
    src = t.detach().reshape(-1).view(torch.uint8)
    for start in range(0, nbytes, piece):
        stop = min(start + piece, nbytes)
        dst[start:stop].copy_(src[start:stop])
        yield offset + stop


def _flat_on_gpu(t: torch.Tensor) -> bool:
    """A contiguous CUDA tensor: copied to the host piece by piece (``DEVICE_PIECE_BYTES``),
    each piece checksummed while the next crosses the link."""
    return t.device.type == "cuda" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


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
    compare(checksum(data), expected, what)


def compare(digest: str, expected: Any, what: str) -> None:
    """``verify`` for bytes already checksummed (``digest``, e.g. by ``checked_read``)."""
    if not is_hex_digest(expected):
        raise ValueError(f"{what} has no valid {CHECKSUM_ALGORITHM} checksum")
    if digest != expected:
        raise ValueError(f"{what} fails its {CHECKSUM_ALGORITHM} checksum (damaged)")


def read_buffer(size: int, *, populate: bool = True) -> bytearray | mmap.mmap:
    """Memory to read a copy of ``size`` bytes into: private anonymous pages, populated at
    once (``MAP_POPULATE``), about a third faster than a ``bytearray``, which zeroes its
    pages one fault at a time (``bench/memory_copy_cost.py``'s read); ``populate=False``
    for readers that fault them in from several threads (``checked_read``). A ``bytearray``
    where the flag is missing. Never a mapping of the slot file: the restored tensors share
    this memory, and the slot is written again by a later copy."""
    flag = getattr(mmap, "MAP_POPULATE", None)
    if flag is None or size == 0:
        return bytearray(size)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (flag if populate else 0)
    return mmap.mmap(-1, size, flags=flags)


def read(data: bytearray | mmap.mmap) -> dict[str, Any]:
    """Tensors share ``data``'s memory (no copy), but for those under ``OWN_MEMORY_BYTES``,
    copied out: an optimizer adopts its step counters as they are (``load_state_dict`` keeps
    a CPU ``step``), and one sharing ``data`` would keep all of it alive for the rest of the
    run, a whole state's worth of host memory where the large tensors went to the GPU. Call
    ``verify`` first."""
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
        tensor = raw.view(getattr(torch, dtype)).reshape(shape)
        tensors.append(tensor.clone() if nbytes < OWN_MEMORY_BYTES else tensor)
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
