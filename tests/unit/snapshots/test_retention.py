"""Pure retention rules, including properties over random histories."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapshots.format import layout
from snapshots.retention import (
    may_hold_strays,
    orphans_to_clean,
    steps_to_prune,
    strays_to_sweep,
)


def test_keeps_newest_k() -> None:
    assert steps_to_prune([10, 20, 30, 40], newest_verified=40, keep=2) == [10, 20]


def test_keeps_every_mth_step_forever() -> None:
    assert steps_to_prune(
        [100, 150, 200, 250, 300], newest_verified=300, keep=1, keep_every=100
    ) == [150, 250]


def test_nothing_is_deleted_without_a_verified_snapshot() -> None:
    assert steps_to_prune([1, 2, 3, 4], newest_verified=None, keep=1) == []


def test_newest_verified_survives_even_when_newer_unverified_ones_fill_keep() -> None:
    # 30 and 40 are committed but failed verification; 20 is the newest good one.
    assert steps_to_prune([10, 20, 30, 40], newest_verified=20, keep=2) == [10]


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_must_be_positive(keep: int) -> None:
    with pytest.raises(ValueError, match="keep"):
        steps_to_prune([1], newest_verified=1, keep=keep)


@given(
    committed=st.sets(st.integers(0, 200), min_size=1, max_size=30),
    keep=st.integers(1, 5),
    keep_every=st.one_of(st.none(), st.integers(1, 50)),
    data=st.data(),
)
def test_retention_invariants(
    committed: set[int], keep: int, keep_every: int | None, data: st.DataObject
) -> None:
    verified = data.draw(st.sampled_from(sorted(committed)))
    doomed = set(
        steps_to_prune(committed, newest_verified=verified, keep=keep, keep_every=keep_every)
    )
    assert doomed <= committed
    assert verified not in doomed
    assert all(s < verified for s in doomed)  # only older than a verified one
    newest = sorted(committed, reverse=True)[:keep]
    assert not doomed & set(newest)
    if keep_every:
        assert all(s % keep_every for s in doomed)
    # everything older than the verified one, outside the kept sets, goes
    survivors = committed - doomed
    assert len([s for s in survivors if s < verified]) <= keep + (
        len([s for s in committed if keep_every and s % keep_every == 0])
    )


def test_orphans_are_older_than_the_newest_commit_and_not_in_flight() -> None:
    assert orphans_to_clean([5, 15, 25, 35], newest_committed=30, in_flight={15}) == [5, 25]
    assert orphans_to_clean([5], newest_committed=None, in_flight=set()) == []


def test_token_is_read_only_from_names_this_package_writes() -> None:
    assert layout.token_of(layout.entry_file_name(2, "model.x/y", "a1b2c3d4")) == "a1b2c3d4"
    assert layout.token_of(layout.rank_file_name(7, "0badf00d")) == "0badf00d"
    others = (layout.MANIFEST_NAME, "NOTES.txt", "x.ABCDEF12.pt", ".tmp-000-w.a1b2c3d4.pt-1-ff")
    for other in others:
        assert layout.token_of(other) is None


def test_one_token_and_no_temp_file_means_no_strays() -> None:
    one = [layout.MANIFEST_NAME, "000-w.a1b2c3d4.pt", "rank-00000.a1b2c3d4.pt", "NOTES.txt"]
    assert not may_hold_strays(one)
    assert may_hold_strays([*one, "000-w.0badf00d.pt"])
    assert may_hold_strays([*one, layout.temp_name("001-b.a1b2c3d4.pt", 42)])


def test_strays_are_unlisted_files_of_ours_older_than_the_grace() -> None:
    temp = layout.temp_name("001-b.0badf00d.pt", 42)
    files = [
        (layout.MANIFEST_NAME, 0.0),
        ("000-w.a1b2c3d4.pt", 0.0),  # listed: the snapshot itself
        ("000-w.0badf00d.pt", 0.0),  # a loser's data file, old
        (temp, None),  # mtime unknown: cannot be young on purpose, sweep
        ("001-b.0badf00d.pt", 95.0),  # young
        ("NOTES.txt", 0.0),  # not ours
    ]
    listed = {"000-w.a1b2c3d4.pt"}
    swept = strays_to_sweep(files, listed=listed, now=100.0, grace_s=10.0)
    assert swept == sorted(["000-w.0badf00d.pt", temp])
    assert strays_to_sweep(files, listed=listed, now=100.0, grace_s=0.0) == sorted(
        ["000-w.0badf00d.pt", "001-b.0badf00d.pt", temp]
    )
