"""A storage outage never stalls training: periodic saves are skipped, blocking saves keep
their deadline, the clean-up of a failed save runs off the training path without retries.

What this guards against: with storage down, the training loop's save() waiting for the
failing save (minutes), and a failed save's clean-up re-reading and re-listing with a full
retry chain each. Every
training-side call here runs in a watchdog thread: not returning in time is the failure.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from elastic_trainer.worker import snapshotting
from elastic_trainer.worker.snapshotting import SessionSnapshots
from snapshots import RetryPolicy, SnapshotSaveError, SnapshotStore
from snapshots.format import layout
from snapshots.storage import Entry, LocalStorage, Storage

TIMEOUT = 30
PROMPT = 10  # generous: returning at all, not speed, is what these tests check


class Outage:
    """Wraps a storage. ``refuse``: calls fail as a refused connection would. ``hang``:
    calls block until ``release`` is set (a paused endpoint), then time out."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.refuse = False
        self.hang = False
        self.hanging = threading.Event()
        self.release = threading.Event()
        self.calls: list[tuple[str, str]] = []  # (operation, thread name)

    def _gate(self, op: str) -> None:
        self.calls.append((op, threading.current_thread().name))
        if self.hang:
            self.hanging.set()
            if not self.release.wait(TIMEOUT):
                raise AssertionError("never released")
            raise TimeoutError("read timed out (the test's paused endpoint)")
        if self.refuse:
            raise ConnectionRefusedError("connection refused (the test's outage)")

    def check(self, *, create: bool = True) -> None:
        self._gate("check")
        self.inner.check(create=create)

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self._gate("write")
        self.inner.write(path, data, exclusive=exclusive)

    def read(self, path: str) -> bytes:
        self._gate("read")
        return self.inner.read(path)

    def list(self, path: str = "") -> list[Entry]:
        self._gate("list")
        return self.inner.list(path)

    def delete(self, path: str) -> None:
        self._gate("delete")
        self.inner.delete(path)


def _store(root: Path, **kwargs: Any) -> tuple[SnapshotStore, Outage]:
    policy = RetryPolicy(attempts=3, initial_s=0.001, max_s=0.002)
    outage = Outage(LocalStorage(str(root)))
    store = SnapshotStore(str(root), retry=policy, storage=outage, **kwargs)
    return store, outage


def _promptly(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a watchdog thread; fail (instead of hanging) if it does not return."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PROMPT)
    assert not thread.is_alive(), "the training-side call blocked on a storage outage"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _x(value: float) -> dict[str, torch.Tensor]:
    return {"x": torch.full((4,), value)}


def _hang_after_one_refusal(outage: Outage) -> None:
    """The next call is refused (storage is down), the retries after it hang."""
    original = outage._gate

    def gate(op: str) -> None:
        outage._gate = original  # type: ignore[method-assign]
        outage.hang = True
        outage.calls.append((op, threading.current_thread().name))
        raise ConnectionRefusedError("refused (the test's outage)")

    outage._gate = gate  # type: ignore[method-assign]


def test_periodic_save_skips_while_the_save_in_flight_is_retrying(tmp_path: Path) -> None:
    store, outage = _store(tmp_path)  # when_busy="wait": before, this waited for the outage
    _hang_after_one_refusal(outage)
    first = store.save(1, _x(1))
    assert outage.hanging.wait(TIMEOUT) and store.storage.health.down
    with capture_logs() as logs:
        second = _promptly(lambda: store.save(2, _x(2)))
    assert second.skipped and "storage is down" in (second.skipped_reason or "")
    assert [(e["event"], e["step"]) for e in logs] == [("snapshot.skipped", 2)]
    assert "refused" in logs[0]["reason"]
    outage.hang = False
    outage.release.set()
    assert first.result(timeout=TIMEOUT).step == 1  # type: ignore[union-attr]  # retried, committed
    store.close()


def test_after_a_failed_save_periodic_saves_skip_until_storage_answers(tmp_path: Path) -> None:
    store, outage = _store(tmp_path)
    outage.refuse = True
    with pytest.raises(SnapshotSaveError):
        store.save(1, _x(1)).result(timeout=TIMEOUT)
    with capture_logs() as logs:
        skipped = _promptly(lambda: store.save(2, _x(2)))
    assert skipped.skipped and [e["event"] for e in logs] == ["snapshot.skipped"]
    store._writer._probe.result(timeout=TIMEOUT)  # type: ignore[union-attr]  # refused too
    assert store.storage.health.down
    outage.refuse = False  # storage is back: the probe started by the next skip notices
    assert _promptly(lambda: store.save(3, _x(3))).skipped
    store._writer._probe.result(timeout=TIMEOUT)  # type: ignore[union-attr]
    assert not store.storage.health.down
    saved = store.save(4, _x(4))
    assert saved.result(timeout=TIMEOUT).step == 4  # type: ignore[union-attr]
    assert [i.step for i in store.list()] == [4]
    store.close()


def test_a_blocking_save_gives_up_at_its_deadline_and_never_commits(tmp_path: Path) -> None:
    store, outage = _store(tmp_path, async_save=False)
    outage.hang = True
    with pytest.raises(SnapshotSaveError, match=r"deadline_s=0\.2 s"):
        _promptly(lambda: store.save(7, _x(7), deadline_s=0.2))
    assert outage.hanging.is_set()
    outage.hang = False
    outage.release.set()
    store.close()
    assert store.latest() is None  # cancelled: it stopped before its manifest
    assert store._writer.pending is None or store._writer.pending.done()


def test_wait_inside_a_deadline_block_gives_up_on_a_hung_save(tmp_path: Path) -> None:
    store, outage = _store(tmp_path)
    outage.hang = True
    store.save(1, _x(1))
    assert outage.hanging.wait(TIMEOUT)
    with pytest.raises(SnapshotSaveError, match="deadline"), store.deadline(0.1):
        _promptly(store.wait)
    outage.hang = False
    outage.release.set()
    store.close()
    assert store.latest() is None


def test_a_failed_saves_clean_up_is_off_the_training_path_and_single_attempt(
    tmp_path: Path,
) -> None:
    store, outage = _store(tmp_path, async_save=False)
    store.save(1, _x(1))
    outage.refuse = True
    with pytest.raises(SnapshotSaveError):
        _promptly(lambda: store.save(2, _x(2)))
    outage.refuse = False
    store.close()  # joins the clean-up thread
    chores = [op for op, thread in outage.calls if thread.startswith("snapshot-chores")]
    assert chores == ["read", "list"]  # one attempt each (manifest, then listing), no retries
    assert [i.step for i in store.list()] == [1]


def test_session_snapshots_skip_while_storage_is_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outage = Outage(LocalStorage(str(tmp_path)))
    policy = RetryPolicy(attempts=3, initial_s=0.001, max_s=0.002)
    # SessionSnapshots builds its own store: hand it the outage through the constructor
    seams = functools.partial(SnapshotStore, storage=outage, retry=policy)
    monkeypatch.setattr(snapshotting, "SnapshotStore", seams)
    snaps = SessionSnapshots(str(tmp_path), keep=3)
    _hang_after_one_refusal(outage)
    snaps.save(1, _x(1), epoch=0, blocking=False)
    assert outage.hanging.wait(TIMEOUT)
    with capture_logs() as logs:
        _promptly(lambda: snaps.save(2, _x(2), epoch=0, blocking=False))
    assert [(e["event"], e["step"]) for e in logs] == [("snapshot.skipped", 2)]
    outage.hang = False
    outage.release.set()
    snaps.close()
    assert [i.step for i in snaps.store.list()] == [1]
    assert layout.step_dir(2) not in {p.name for p in tmp_path.iterdir()}
