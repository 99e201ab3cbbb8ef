"""Sample audit log: which dataset indices every completed step trained, on every rank.

Writers: one JSON-lines file per (rank, restart, attempt), append only, so concurrent writers
never interleave and a killed writer loses at most its unfinished last line.

Reader: steps that a failure rolled back (trained after the restored snapshot, then trained
again by a later attempt) are resolved *newest attempt wins*: the model's final state comes
from the newest attempt, which restored a snapshot made of older attempts' steps.

Command line: ``python -m elastic_trainer.worker.audit DIR --num-samples N`` prints the
per-epoch coverage and exits 1 when a sample was trained twice or missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO

FILE_PREFIX = "audit-"


@dataclass(frozen=True, kw_only=True)
class AuditRecord:
    """One completed step of one rank."""

    epoch: int
    step: int  # global optimizer step number (1-based: the step just completed)
    rank: int
    world_size: int
    restart_count: int
    indices: tuple[int, ...]
    attempt: int = 0  # same on every rank of one attempt, grows from attempt to attempt
    restored_step: int | None = None

    def to_json(self) -> str:
        fields = {**self.__dict__, "indices": list(self.indices)}
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> AuditRecord:
        data = json.loads(line)
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**known, "indices": tuple(data["indices"])})


class AuditLog:
    """Appends this rank's records to its own file in ``directory``."""

    def __init__(self, directory: str, *, rank: int, restart_count: int, attempt: int) -> None:
        os.makedirs(directory, exist_ok=True)
        name = f"{FILE_PREFIX}rank{rank:05d}-restart{restart_count:03d}-{attempt}.jsonl"
        self.path = os.path.join(directory, name)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        # the step's thread and a just-in-time copy's thread both write: whole lines only
        self._lock = threading.Lock()

    def write(self, record: AuditRecord) -> None:
        with self._lock:
            if self._file is None:
                raise ValueError(f"audit log {self.path} is closed")
            # flush, not fsync: the record must survive the process, not the machine
            self._file.write(record.to_json() + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_audit_log(directory: str) -> list[AuditRecord]:
    """Every complete record in ``directory`` (a torn last line of a killed writer is skipped)."""
    records = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(FILE_PREFIX) and name.endswith(".jsonl"):
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                records += [_parse(line) for line in handle if line.endswith("\n")]
    return [r for r in records if r is not None]


def _parse(line: str) -> AuditRecord | None:
    try:
        return AuditRecord.from_json(line)
    except (ValueError, KeyError, TypeError):
        return None


def effective_records(records: Iterable[AuditRecord]) -> list[AuditRecord]:
    """For each step keep only the records of the newest attempt that trained it, each once
    (a rank's just-in-time copy records the step for every rank: ``session``)."""
    by_step: dict[int, list[AuditRecord]] = defaultdict(list)
    for record in dict.fromkeys(records):
        by_step[record.step].append(record)
    kept = []
    for step in sorted(by_step):
        newest = max(r.attempt for r in by_step[step])
        kept += sorted((r for r in by_step[step] if r.attempt == newest), key=lambda r: r.rank)
    return kept


@dataclass(frozen=True, kw_only=True)
class EpochCoverage:
    epoch: int
    trained: int  # distinct indices
    duplicates: tuple[int, ...]
    missing: tuple[int, ...]
    out_of_range: tuple[int, ...]


def coverage(records: Iterable[AuditRecord], num_samples: int) -> dict[int, EpochCoverage]:
    """Per epoch: how the effective records cover ``range(num_samples)``."""
    counts: dict[int, Counter[int]] = defaultdict(Counter)
    for record in effective_records(records):
        counts[record.epoch].update(record.indices)
    return {epoch: _epoch_coverage(epoch, counts[epoch], num_samples) for epoch in sorted(counts)}


def _epoch_coverage(epoch: int, counts: Counter[int], num_samples: int) -> EpochCoverage:
    return EpochCoverage(
        epoch=epoch,
        trained=len(counts),
        duplicates=tuple(sorted(i for i, c in counts.items() if c > 1)),
        missing=tuple(i for i in range(num_samples) if i not in counts),
        out_of_range=tuple(sorted(i for i in counts if not 0 <= i < num_samples)),
    )


def check_exactly_once(
    records: Sequence[AuditRecord],
    num_samples: int,
    *,
    complete_epochs: Iterable[int],
    dropped_per_epoch: int = 0,
) -> list[str]:
    """Problems found (empty = every complete epoch trained each sample exactly once).

    ``dropped_per_epoch`` is the documented drop_last tail (``num_samples % global_batch``):
    that many indices may be missing. Steps must also carry one record per rank.
    """
    problems = _incomplete_steps(effective_records(records))
    report = coverage(records, num_samples)
    for epoch in complete_epochs:
        if epoch not in report:
            problems.append(f"epoch {epoch}: no records")
            continue
        cov = report[epoch]
        if cov.duplicates or cov.out_of_range:
            problems.append(
                f"epoch {epoch}: trained more than once {list(cov.duplicates)[:10]}, "
                f"out of range {list(cov.out_of_range)[:10]}"
            )
        if len(cov.missing) != dropped_per_epoch:
            problems.append(
                f"epoch {epoch}: {len(cov.missing)} samples never trained (expected "
                f"{dropped_per_epoch}): {list(cov.missing)[:10]}"
            )
    for epoch, cov in report.items():
        if epoch not in set(complete_epochs) and cov.duplicates:
            problems.append(f"epoch {epoch}: trained more than once {list(cov.duplicates)[:10]}")
    return problems


def _incomplete_steps(records: list[AuditRecord]) -> list[str]:
    ranks: dict[int, set[int]] = defaultdict(set)
    sizes: dict[int, set[int]] = defaultdict(set)
    for record in records:
        ranks[record.step].add(record.rank)
        sizes[record.step].add(record.world_size)
    return [
        f"step {step}: records from ranks {sorted(ranks[step])} of world sizes "
        f"{sorted(sizes[step])}"
        for step in sorted(ranks)
        if len(sizes[step]) != 1 or ranks[step] != set(range(next(iter(sizes[step]))))
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elastic_trainer.worker.audit",
        description="Check that an audit log trained every sample of each epoch exactly once.",
    )
    parser.add_argument("directory")
    parser.add_argument("--num-samples", type=int, required=True)
    parser.add_argument("--dropped-per-epoch", type=int, default=0)
    parser.add_argument(
        "--last-epoch-complete", action="store_true", help="also require the newest epoch whole"
    )
    args = parser.parse_args(argv)
    records = read_audit_log(args.directory)
    report = coverage(records, args.num_samples)
    last = None if args.last_epoch_complete else max(report, default=None)
    for cov in report.values():
        state = "in progress" if cov.epoch == last else "complete"
        print(
            f"epoch {cov.epoch} ({state}): {cov.trained} trained, {len(cov.duplicates)} "
            f"twice, {len(cov.missing)} missing"
        )
    complete = [e for e in report if e != last]
    problems = check_exactly_once(
        records,
        args.num_samples,
        complete_epochs=complete,
        dropped_per_epoch=args.dropped_per_epoch,
    )
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = [
    "AuditLog",
    "AuditRecord",
    "EpochCoverage",
    "check_exactly_once",
    "coverage",
    "effective_records",
    "read_audit_log",
]
