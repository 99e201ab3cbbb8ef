"""Audit log: writer files, torn lines, rollback resolution and coverage checks."""

from __future__ import annotations

import os

from elastic_trainer.worker.audit import (
    AuditLog,
    AuditRecord,
    check_exactly_once,
    coverage,
    effective_records,
    main,
    read_audit_log,
)


def _rec(step, rank, indices, *, attempt=1, world=2, epoch=0):
    return AuditRecord(
        epoch=epoch,
        step=step,
        rank=rank,
        world_size=world,
        restart_count=0,
        indices=tuple(indices),
        attempt=attempt,
    )


def _write(directory, records, *, restart=0):
    logs = {}
    for record in records:
        key = (record.rank, record.attempt)
        if key not in logs:
            logs[key] = AuditLog(
                str(directory), rank=record.rank, restart_count=restart, attempt=record.attempt
            )
        logs[key].write(record)
    for log in logs.values():
        log.close()


def test_one_file_per_rank_and_attempt_round_trips(tmp_path):
    records = [_rec(1, 0, [3, 1]), _rec(1, 1, [0, 2]), _rec(2, 0, [5], attempt=2, world=1)]
    _write(tmp_path, records)
    assert len(os.listdir(tmp_path)) == 3
    assert sorted(read_audit_log(str(tmp_path)), key=lambda r: (r.step, r.rank)) == records


def test_torn_last_line_of_a_killed_writer_is_ignored(tmp_path):
    _write(tmp_path, [_rec(1, 0, [1]), _rec(2, 0, [2])])
    (path,) = tmp_path.iterdir()
    with open(path, "a") as handle:
        handle.write('{"epoch": 0, "step": 3, "ra')
    assert [r.step for r in read_audit_log(str(tmp_path))] == [1, 2]


def test_newest_attempt_wins_for_rolled_back_steps():
    first = [_rec(s, r, [10 * s + r], attempt=1) for s in (1, 2, 3) for r in (0, 1)]
    # attempt 2 restored step 1 and trained steps 2 and 3 again, with other samples
    second = [_rec(s, 0, [100 + s], attempt=2, world=1) for s in (2, 3)]
    kept = effective_records(first + second)
    assert [(r.step, r.attempt) for r in kept] == [(1, 1), (1, 1), (2, 2), (3, 2)]


def test_a_step_recorded_for_every_rank_by_one_and_by_itself_counts_once():
    # rank 0's just-in-time copy recorded step 1 for ranks 0 and 1; rank 1 recorded it too
    records = [_rec(1, 0, [0, 1]), _rec(1, 1, [2, 3]), _rec(1, 1, [2, 3])]
    assert check_exactly_once(records, 4, complete_epochs=[0]) == []
    assert len(effective_records(records)) == 2


def test_exactly_once_passes_and_detects_duplicates_and_gaps():
    good = [_rec(1, 0, [0, 2]), _rec(1, 1, [1, 3])]
    assert check_exactly_once(good, 4, complete_epochs=[0]) == []
    dup = [_rec(1, 0, [0, 2]), _rec(1, 1, [0, 3])]
    problems = check_exactly_once(dup, 4, complete_epochs=[0])
    assert any("more than once [0]" in p for p in problems)
    assert any("1 samples never trained" in p and "[1]" in p for p in problems)
    assert (
        check_exactly_once([*dup[:1], _rec(1, 1, [3])], 4, complete_epochs=[0], dropped_per_epoch=1)
        == []
    )


def test_a_step_with_a_missing_rank_is_reported():
    problems = check_exactly_once([_rec(1, 0, [0, 1])], 2, complete_epochs=[0])
    assert problems == ["step 1: records from ranks [0] of world sizes [2]"]


def test_duplicates_in_an_unfinished_epoch_are_reported():
    records = [_rec(1, 0, [0]), _rec(1, 1, [1]), _rec(2, 0, [0], epoch=1), _rec(2, 1, [0], epoch=1)]
    problems = check_exactly_once(records, 4, complete_epochs=[])
    assert problems == ["epoch 1: trained more than once [0]"]
    assert coverage(records, 4)[1].duplicates == (0,)


def test_command_line_exit_code(tmp_path, capsys):
    _write(
        tmp_path,
        [_rec(1, 0, [0]), _rec(1, 1, [1]), _rec(2, 0, [0], epoch=1), _rec(2, 1, [1], epoch=1)],
    )
    assert main([str(tmp_path), "--num-samples", "2", "--last-epoch-complete"]) == 0
    assert "epoch 1 (complete): 2 trained, 0 twice, 0 missing" in capsys.readouterr().out
    assert main([str(tmp_path), "--num-samples", "3"]) == 1
