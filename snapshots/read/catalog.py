"""The read side of a store: which snapshots exist, verifying them, loading them.

Nothing here writes. A step counts only once its manifest exists; ``latest`` and ``load``
without a step walk committed steps newest first and fall back past damaged ones, reporting
each as ``snapshot.corrupt``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from snapshots.errors import NoValidSnapshotError, SnapshotCorruptError, SnapshotNotFoundError
from snapshots.events import emit
from snapshots.format import layout, sharding
from snapshots.format.manifest import Manifest
from snapshots.info import LoadedSnapshot, SnapshotInfo, VerifyResult
from snapshots.read import reader, shard_reader
from snapshots.storage import Storage

if TYPE_CHECKING:
    from snapshots.sharded.shards import TemplateFn


class Catalog:
    def __init__(self, storage: Storage, url: str) -> None:
        self._storage = storage
        self.url = url

    @property
    def storage(self) -> Storage:
        return self._storage

    def step_url(self, step: int) -> str:
        return f"{self.url}/{layout.step_dir(step)}"

    def committed(self) -> tuple[list[int], list[int]]:
        """(committed steps, partial steps), newest first."""
        committed, partial = [], []
        for step in reader.step_folders(self._storage):
            (committed if reader.has_manifest(self._storage, step) else partial).append(step)
        return committed, partial

    def list(self) -> list[SnapshotInfo]:
        """Committed snapshots whose manifest parses, oldest first (files are not verified)."""
        infos = []
        for step in sorted(self.committed()[0]):
            try:
                manifest = reader.read_manifest(self._storage, step)
            except (FileNotFoundError, SnapshotCorruptError):
                continue
            infos.append(SnapshotInfo.from_manifest(manifest, self.step_url(step)))
        return infos

    def describe(self, step: int) -> VerifyResult:
        """The manifest alone (no file is read): ``ok`` says only that it parses."""
        try:
            manifest = reader.read_manifest(self._storage, step)
        except (SnapshotCorruptError, FileNotFoundError) as exc:
            return VerifyResult(step=step, ok=False, problems=[_manifest_problem(exc)])
        info = SnapshotInfo.from_manifest(manifest, self.step_url(step))
        return VerifyResult(step=step, ok=True, problems=[], info=info)

    def verify(self, step: int, *, deep: bool = False) -> VerifyResult:
        """Check a snapshot's manifest, file sizes and checksums; ``deep`` also deserialises
        every file with the weights-only loader (nothing is restored into anything)."""
        try:
            manifest = reader.read_manifest(self._storage, step)
        except (SnapshotCorruptError, FileNotFoundError) as exc:
            return VerifyResult(step=step, ok=False, problems=[_manifest_problem(exc)])
        problems, data = _table_size_problems(manifest), {}
        if not problems:
            problems, data = reader.check_files(self._storage, step, manifest, manifest.files)
        if deep and not problems:
            problems = _load_problems(step, manifest, data)
        info = SnapshotInfo.from_manifest(manifest, self.step_url(step))
        return VerifyResult(step=step, ok=not problems, problems=problems, info=info)

    def shard_summary(self, step: int) -> dict[str, Any] | None:
        """A sharded snapshot's files per rank and its shard table in figures (``snapshots
        show``); None for a format-1 snapshot. SnapshotCorruptError: the table is damaged."""
        manifest = reader.read_manifest(self._storage, step)
        table = shard_reader.table_entry(manifest)
        if table is None:
            return None
        data = reader.verified_bytes(self._storage, step, manifest, [table])
        files = {f.name: (f.shard, f.size) for f in manifest.files if f.shard is not None}
        return sharding.summary(sharding.from_json(data[table.name]), files)

    def latest(self, *, deep: bool = False) -> SnapshotInfo | None:
        """The newest committed and verified snapshot; None only when nothing is committed."""
        committed, _ = self.committed()
        problems = []
        for step in committed:
            result = self.verify(step, deep=deep)
            if result.ok:
                return result.info
            problems.append(self._report_corrupt(step, "; ".join(result.problems)))
        if problems:
            raise self._none_valid(problems)
        return None

    def load_newest(self, rank: int | None, templates: TemplateFn | None = None) -> LoadedSnapshot:
        committed, _ = self.committed()
        if not committed:
            raise SnapshotNotFoundError(f"no committed snapshot at {self.url}")
        problems = []
        for step in committed:
            try:
                return self.load_step(step, rank, templates)
            except SnapshotCorruptError as exc:
                problems.append(self._report_corrupt(step, str(exc)))
        raise self._none_valid(problems)

    def load_step(
        self, step: int, rank: int | None, templates: TemplateFn | None = None
    ) -> LoadedSnapshot:
        """``templates``: for a sharded snapshot, the local shards to read (``_shards``)."""
        from snapshots.format.serialization import deserialize  # torch: only when loading

        try:
            manifest = reader.read_manifest(self._storage, step)
        except FileNotFoundError as exc:
            raise SnapshotNotFoundError(
                f"no committed snapshot of step {step} at {self.url}"
            ) from exc
        entry_files = manifest.entry_files()
        rank_files = manifest.rank_files()
        wanted = list(entry_files.values())
        table = shard_reader.table_entry(manifest)
        wanted += [table] if table is not None else []
        if rank is not None:
            wanted += [rank_files[rank]] if rank in rank_files else []
        else:
            wanted += list(rank_files.values())
        data = reader.verified_bytes(self._storage, step, manifest, wanted)  # before unpickling
        state = {
            k: deserialize(data[f.name], what=f"step {step} file {f.name}")
            for k, f in entry_files.items()
        }
        if table is not None:
            state = shard_reader.assemble(
                self._storage, step, manifest, data[table.name], state, templates
            )
        per_rank = {
            r: deserialize(data[f.name], what=f"step {step} file {f.name}")
            for r, f in rank_files.items()
            if f.name in data
        }
        info = SnapshotInfo.from_manifest(manifest, self.step_url(step))
        if rank is not None:
            return LoadedSnapshot(info=info, state=state, rank_state=per_rank.get(rank))
        return LoadedSnapshot(
            info=info, state=state, per_rank=[per_rank[r] for r in sorted(per_rank)]
        )

    def _report_corrupt(self, step: int, problem: str) -> str:
        emit("snapshot.corrupt", step=step, url=self.step_url(step), problem=problem)
        return f"step {step}: {problem}"

    def _none_valid(self, problems: list[str]) -> NoValidSnapshotError:
        return NoValidSnapshotError(
            f"{len(problems)} snapshot(s) at {self.url} but none passes verification "
            f"({' | '.join(problems)[:1000]}); run 'elastic-train snapshots verify {self.url}', "
            "then repair or remove them, or point to another snapshot URL"
        )


def _table_size_problems(manifest: Manifest) -> list[str]:
    try:
        shard_reader.table_entry(manifest)
    except SnapshotCorruptError as exc:
        return [str(exc)]
    return []


def _load_problems(step: int, manifest: Manifest, data: dict[str, bytes]) -> list[str]:
    """What the weights-only loader refuses among verified bytes (imports torch); for a
    sharded snapshot also the table and every chunk's checksum (shard bytes are raw)."""
    from snapshots.format.serialization import deserialize

    problems = shard_reader.chunk_problems(manifest, data)
    pickled = {f.name for f in manifest.files if f.key is not None or f.rank is not None}
    for name, blob in data.items():
        if name not in pickled:
            continue
        try:
            deserialize(blob, what=f"step {step} file {name}")
        except SnapshotCorruptError as exc:
            problems.append(str(exc))
    return problems


def _manifest_problem(exc: Exception) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"{layout.MANIFEST_NAME} is missing"
    return str(exc)
