"""Reading snapshots back: discover step folders, parse manifests, verify files.

Every check that can be made from a listing (missing file, wrong size) is made before any
byte is downloaded, and every checksum is checked before anything is deserialised.
"""

from __future__ import annotations

from collections.abc import Iterable

from snapshots import layout
from snapshots.errors import SnapshotCorruptError
from snapshots.manifest import FileEntry, Manifest, checksum, from_json
from snapshots.storage import Storage


def step_folders(storage: Storage) -> list[int]:
    """Every step folder at the root, committed or not, newest first."""
    steps = (layout.parse_step_dir(e.name) for e in storage.list("") if e.is_dir)
    return sorted((s for s in steps if s is not None), reverse=True)


def has_manifest(storage: Storage, step: int) -> bool:
    names = {e.name for e in storage.list(layout.step_dir(step)) if not e.is_dir}
    return layout.MANIFEST_NAME in names


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The step's manifest. FileNotFoundError: not committed; SnapshotCorruptError: damaged."""
    data = storage.read(layout.manifest_path(step))
    return from_json(data, expected_step=step)


def check_files(
    storage: Storage, step: int, manifest: Manifest, files: Iterable[FileEntry]
) -> tuple[list[str], dict[str, bytes]]:
    """Size (from a listing) then checksum for each file. Returns (problems, verified bytes)."""
    folder = layout.step_dir(step)
    sizes = {e.name: e.size for e in storage.list(folder) if not e.is_dir}
    problems: list[str] = []
    wanted = list(files)
    for f in wanted:
        problem = _size_problem(f, sizes.get(f.name, -1) if f.name in sizes else None)
        if problem:
            problems.append(problem)
    if problems:
        return problems, {}
    verified: dict[str, bytes] = {}
    for f in wanted:
        try:
            data = storage.read(f"{folder}/{f.name}")
        except FileNotFoundError:
            problems.append(f"file {f.name} is missing")
            continue
        problem = _size_problem(f, len(data)) or _checksum_problem(f, data, manifest)
        if problem:
            problems.append(problem)
        else:
            verified[f.name] = data
    return problems, verified


def _size_problem(f: FileEntry, size: int | None) -> str | None:
    if size is None:
        return f"file {f.name} is missing"
    if size != f.size:
        return f"file {f.name} has {size} bytes, manifest says {f.size} (truncated or replaced)"
    return None


def _checksum_problem(f: FileEntry, data: bytes, manifest: Manifest) -> str | None:
    actual = checksum(data, manifest.checksum_algorithm)
    if actual != f.checksum:
        return f"file {f.name} fails its {manifest.checksum_algorithm} checksum (damaged)"
    return None


def verified_bytes(
    storage: Storage, step: int, manifest: Manifest, files: Iterable[FileEntry]
) -> dict[str, bytes]:
    problems, data = check_files(storage, step, manifest, files)
    if problems:
        raise SnapshotCorruptError("; ".join(problems))
    return data
