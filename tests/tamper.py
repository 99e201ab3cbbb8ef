"""Test helpers: replace a snapshot's file with other bytes and re-sign the manifest, so that
every checksum matches and only the loader stands between the bytes and the process."""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from snapshots.format import layout
from snapshots.format.manifest import checksum


class Payload:
    """Unpickling this would create the sentinel file: the classic pickle exploit."""

    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


def evil_bytes(sentinel: Path) -> bytes:
    """A normal-looking torch archive with the payload inside."""
    buf = io.BytesIO()
    torch.save({"weight": Payload(str(sentinel))}, buf)
    return buf.getvalue()


def resign(root: Path, step: int, pick: Callable[[dict], bool], data: bytes) -> Path:
    """Write ``data`` over the first file ``pick`` selects and fix its manifest entry."""
    manifest = root / layout.manifest_path(step)
    body = json.loads(manifest.read_bytes())
    entry = next(f for f in body["files"] if pick(f))
    target = root / layout.step_dir(step) / entry["name"]
    target.write_bytes(data)
    entry.update(size=len(data), checksum=checksum(data))
    manifest.write_text(json.dumps(body))
    return target


def raw_pickle(sentinel: Path) -> bytes:
    """The payload as a bare pickle (no torch archive around it)."""
    return pickle.dumps(Payload(str(sentinel)))


EXPLOITS: dict[str, Callable[[Path], bytes]] = {
    "torch archive": evil_bytes,
    "raw pickle": raw_pickle,
}


def damage(path: Path, how: str) -> None:
    """Damage a file the ways storage does: ``flip`` a byte, ``truncate`` it, ``delete`` it."""
    if how == "delete":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    path.write_bytes(bytes(data))
