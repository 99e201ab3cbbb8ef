"""The byte layout of an in-memory copy (``runtime.memory_tier``): a small ``torch.save`` of
the state's skeleton, then the raw bytes of its dense tensors.

Why not ``torch.save`` of the whole tree: its zip writer computes a CRC32 of every byte,
half its cost here, for a file that lives in memory and never crosses a disk or a network.
The skeleton is read back with ``weights_only=True`` after the whole copy's BLAKE3 checksum
(kept in the commit marker) is verified, so loading a copy executes no code and damage is
never used.

Layout: 8 bytes (little-endian length of the skeleton), the skeleton, then every tensor's
bytes in order. The skeleton maps each tensor to (dtype, shape, offset, bytes).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch

from snapshots import manifest

_TENSOR = "__elastic_train_memory_tensor__"  # placeholder key in the skeleton
_HEADER = struct.Struct("<Q")
_KEEP = object()


CHECKSUM_ALGORITHM = "blake3"  # as new storage snapshots (snapshots.manifest): ~13 ms / 90 MB


def write(payload: Mapping[str, Any], f: IO[bytes]) -> str:
    """Write the copy; returns the checksum of every byte written (the commit marker keeps it:
    a copy is checked before its skeleton is unpickled, like a storage snapshot)."""
    hasher = manifest.hasher(CHECKSUM_ALGORITHM)

    def put(data: Any) -> None:
        f.write(data)
        hasher.update(data)

    tensors: list[torch.Tensor] = []
    skeleton = _walk(dict(payload), lambda obj: _strip(obj, tensors))
    table, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        table.append((str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes))
        offset += nbytes
    head = io.BytesIO()
    torch.save({"skeleton": skeleton, "tensors": table}, head)
    put(_HEADER.pack(head.tell()))
    put(head.getbuffer())
    for t in tensors:
        put(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return str(hasher.hexdigest())


def verify(data: bytes | bytearray, expected: Any, what: str) -> None:
    """Raise ValueError unless ``data`` has the checksum ``expected`` (damage, or a copy
    written before copies had one: either way not used)."""
    if not manifest.is_hex_digest(expected, CHECKSUM_ALGORITHM):
        raise ValueError(f"{what} has no valid {CHECKSUM_ALGORITHM} checksum")
    if manifest.checksum(memoryview(data), CHECKSUM_ALGORITHM) != expected:
        raise ValueError(f"{what} fails its {CHECKSUM_ALGORITHM} checksum (damaged)")


def read(data: bytearray) -> dict[str, Any]:
    """Tensors share ``data``'s memory (no copy). Call ``verify`` first."""
    (length,) = _HEADER.unpack_from(data)
    head = torch.load(io.BytesIO(data[_HEADER.size : _HEADER.size + length]), weights_only=True)
    start = _HEADER.size + length
    tensors = []
    for dtype, shape, offset, nbytes in head["tensors"]:
        if start + offset + nbytes > len(data):
            raise ValueError(f"the copy is truncated ({len(data)} bytes)")
        raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=start + offset)
        tensors.append(raw.view(getattr(torch, dtype)).reshape(shape))
    return _walk(head["skeleton"], lambda obj: _fill(obj, tensors))


def _raw(t: torch.Tensor) -> bool:
    """Dense CPU tensors go raw; anything else stays in the (pickled) skeleton."""
    plain = t.layout == torch.strided and t.device.type == "cpu" and not t.is_quantized
    return plain and t.is_contiguous() and type(t) is torch.Tensor


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
