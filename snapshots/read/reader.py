"""Reading snapshots back: discover step folders, parse manifests, verify files.

Every check that can be made from a listing (missing file, wrong size) is made before any
byte is downloaded, and every checksum is checked before anything is deserialised.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from snapshots.errors import SnapshotCorruptError
from snapshots.format import layout
from snapshots.format.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest, checksum, from_json
from snapshots.storage import Entry, Storage, read_limited


def step_folders(storage: Storage) -> list[int]:
    """Every step folder at the root, committed or not, newest first."""
    steps = (layout.parse_step_dir(e.name) for e in storage.list("") if e.is_dir)
    return sorted((s for s in steps if s is not None), reverse=True)


def has_manifest(storage: Storage, step: int) -> bool:
    # Whatever holds the name counts (a folder or a FIFO too): reading it then reports the
    # damage, where skipping it would hide the snapshot from every report.
    return any(e.name == layout.MANIFEST_NAME for e in storage.list(layout.step_dir(step)))


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The step's manifest. FileNotFoundError: not committed; SnapshotCorruptError: damaged."""
    data = read_limited(storage, layout.manifest_path(step), MAX_MANIFEST_BYTES)
    return from_json(data, expected_step=step)


def check_files(
    storage: Storage, step: int, manifest: Manifest, files: Iterable[FileEntry]
) -> tuple[list[str], dict[str, bytes]]:
    """Size (from a listing) then checksum for each file. Returns (problems, verified bytes)."""
    wanted = list(files)
    listed = _listing(storage, step)
    problems = [p for f in wanted if (p := _size_problem(f, _listed_size(listed, f)))]
    if problems:
        return problems, {}
    return _check_contents(storage, step, manifest, wanted)


def check_sizes(storage: Storage, step: int, files: Iterable[FileEntry]) -> list[str]:
    """From one listing: every file present at the manifest's size (nothing is read)."""
    listed = _listing(storage, step)
    return [p for f in files if (p := _size_problem(f, _listed_size(listed, f)))]


def check_written(
    storage: Storage, step: int, manifest: Manifest, expected_etags: Mapping[str, str]
) -> list[str]:
    """Post-write check from one listing; downloads only the files the listing cannot prove.

    Every file must be listed at the manifest's size. A file with an expected ETag passes
    when the listing shows that ETag (a hash the server computed over the stored bytes);
    when it shows another one (SSE-KMS, a different multipart layout, or damage) the file is
    downloaded and checksummed. A file with no expected ETag passes on its size.
    """
    listed = _listing(storage, step)
    problems = [p for f in manifest.files if (p := _size_problem(f, _listed_size(listed, f)))]
    if problems:
        return problems
    unproven = [
        f
        for f in manifest.files
        if f.name in expected_etags and listed[f.name].etag != expected_etags[f.name]
    ]
    return _check_contents(storage, step, manifest, unproven)[0] if unproven else []


def _listing(storage: Storage, step: int) -> dict[str, Entry]:
    return {e.name: e for e in storage.list(layout.step_dir(step)) if not e.is_dir}


def _listed_size(listed: Mapping[str, Entry], f: FileEntry) -> int | None:
    entry = listed.get(f.name)
    return entry.size if entry is not None else None


def _check_contents(
    storage: Storage, step: int, manifest: Manifest, files: list[FileEntry]
) -> tuple[list[str], dict[str, bytes]]:
    folder = layout.step_dir(step)
    problems: list[str] = []
    verified: dict[str, bytes] = {}
    for f in files:
        try:
            # One byte more than the manifest's size is enough to prove a file too long.
            data = read_limited(storage, f"{folder}/{f.name}", f.size)
        except FileNotFoundError:
            problems.append(f"file {f.name} is missing")
            continue
        except SnapshotCorruptError as exc:  # not a regular file, or longer than listed
            problems.append(f"file {f.name}: {exc}")
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
