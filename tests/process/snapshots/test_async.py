"""Asynchronous saves: what is captured, one in flight, errors surfacing, flush at exit."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import RetryPolicy, SnapshotSaveError, SnapshotStore, StorageError
from snapshots.format import layout
from snapshots.storage import Entry, LocalStorage, Storage

TIMEOUT = 30


class Gated:
    """Wraps a storage: writes wait for ``gate``; ``fail`` makes them raise."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.failures: list[Exception] = []

    def check(self, *, create: bool = True) -> None:
        self.inner.check(create=create)

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self.entered.set()
        if not self.gate.wait(TIMEOUT):
            raise AssertionError("gate never opened")
        if self.failures:
            raise self.failures.pop(0)
        self.inner.write(path, data, exclusive=exclusive)

    def read(self, path: str) -> bytes:
        return self.inner.read(path)

    def list(self, path: str = "") -> list[Entry]:
        return self.inner.list(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)


def _gated_store(root: Path, **kwargs: object) -> tuple[SnapshotStore, Gated]:
    gated = Gated(LocalStorage(str(root)))
    store = SnapshotStore(
        str(root),
        retry=RetryPolicy(attempts=3, initial_s=0.001, max_s=0.002),
        storage=gated,
        **kwargs,  # type: ignore[arg-type]
    )
    return store, gated


def test_captures_the_state_at_the_call_not_after(tmp_path: Path) -> None:
    store, gated = _gated_store(tmp_path)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    gated.gate.clear()
    handle = store.save(1, {"model": model, "optimizer": opt})
    assert gated.entered.wait(TIMEOUT) and not handle.done()  # the write is still pending
    with torch.no_grad():  # training goes on and mutates every tensor in place
        for p in model.parameters():
            p.add_(1.0)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    gated.gate.set()
    handle.result(timeout=TIMEOUT)
    loaded = store.load(1)
    for key, value in expected.items():
        assert torch.equal(loaded.state["model"][key], value)
    assert torch.equal(loaded.state["optimizer"]["state"][0]["momentum_buffer"], expected_momentum)
    store.close()


def test_skip_policy_skips_while_a_save_is_in_flight(tmp_path: Path) -> None:
    store, gated = _gated_store(tmp_path, when_busy="skip")
    gated.gate.clear()
    first = store.save(1, {"x": torch.ones(3)})
    assert gated.entered.wait(TIMEOUT)
    with capture_logs() as logs:
        second = store.save(2, {"x": torch.zeros(3)})
    assert second.skipped and second.result() is None
    assert [(e["event"], e["step"]) for e in logs] == [("snapshot.skipped", 2)]
    gated.gate.set()
    assert first.result(timeout=TIMEOUT).step == 1  # type: ignore[union-attr]
    assert [i.step for i in store.list()] == [1]
    store.close()


def test_wait_policy_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    store, gated = _gated_store(tmp_path)
    gated.gate.clear()
    first = store.save(1, {"x": torch.ones(3)})
    assert gated.entered.wait(TIMEOUT)
    opener = threading.Thread(target=gated.gate.set)
    opener.start()
    second = store.save(2, {"x": torch.zeros(3)})
    assert first.done()  # save() returned only once the first save had finished
    assert second.result(timeout=TIMEOUT).step == 2  # type: ignore[union-attr]
    opener.join()
    store.close()


def test_a_failed_save_surfaces_later_and_leaves_no_commit(tmp_path: Path) -> None:
    store, gated = _gated_store(tmp_path)
    gated.failures.append(PermissionError("denied by the test"))
    with capture_logs() as logs:
        failed = store.save(1, {"x": torch.ones(3)})
        with pytest.raises(SnapshotSaveError, match="denied by the test"):
            failed.result(timeout=TIMEOUT)
    assert [e["step"] for e in logs if e["event"] == "snapshot.failed"] == [1]
    assert store.latest() is None
    assert not (tmp_path / layout.step_dir(1)).exists() or not any(
        (tmp_path / layout.step_dir(1)).iterdir()
    )

    # Not reported through its handle: the next save() starts, then raises it once.
    gated.failures.append(PermissionError("second failure"))
    store.save(2, {"x": torch.ones(3)})
    with pytest.raises(SnapshotSaveError) as info:
        store.save(3, {"x": torch.full((3,), 3.0)})
    assert "second failure" in str(info.value) and info.value.handle is not None
    assert info.value.handle.result(timeout=TIMEOUT).step == 3
    assert store.wait().step == 3  # type: ignore[union-attr]  # no error left to report
    assert store.wait() is None
    assert [i.step for i in store.list()] == [3]
    store.close()


def test_wait_and_close_raise_an_unreported_failure_once(tmp_path: Path) -> None:
    store, gated = _gated_store(tmp_path)
    gated.failures.append(PermissionError("nope"))
    store.save(1, {"x": torch.ones(3)})
    with pytest.raises(SnapshotSaveError, match="nope"):
        store.wait()
    assert store.wait() is None
    store.close()


def test_transient_errors_are_retried_and_the_save_commits(tmp_path: Path) -> None:
    store, gated = _gated_store(tmp_path, async_save=False)
    gated.failures.extend([ConnectionResetError("blip"), TimeoutError("slow")])
    info = store.save(4, {"x": torch.ones(3)}).result()
    assert info is not None and store.latest().step == 4  # type: ignore[union-attr]


def test_synchronous_failure_raises_in_the_caller(tmp_path: Path) -> None:
    store, gated = _gated_store(tmp_path, async_save=False)
    gated.failures.extend([ConnectionResetError()] * 5)
    with pytest.raises(SnapshotSaveError) as info:
        store.save(1, {"x": torch.ones(3)})
    assert isinstance(info.value.__cause__, StorageError)
    assert store.latest() is None


def test_unreachable_storage_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match=r"cannot use snapshot storage .*file/snaps.*check"):
        SnapshotStore(str(blocker / "snaps"))


def test_closed_store_refuses_saves(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    store.save(1, {"x": torch.ones(1)})
    store.close()
    assert store.latest().step == 1  # type: ignore[union-attr]  # close flushed it
    with pytest.raises(Exception, match="closed"):
        store.save(2, {"x": torch.ones(1)})


EXITING = """
import torch
from snapshots import SnapshotStore
store = SnapshotStore({root!r}, async_save=True)
store.save(9, {{"w": torch.arange(200_000)}})
# no wait(), no close(): interpreter exit must flush the save in flight
"""


def test_interpreter_exit_flushes_the_save_in_flight(tmp_path: Path, worker_env: dict) -> None:
    root = str(tmp_path / "snaps")
    proc = subprocess.run(
        [sys.executable, "-c", EXITING.format(root=root)],
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = SnapshotStore(root).load()
    assert loaded.info.step == 9 and torch.equal(loaded.state["w"], torch.arange(200_000))


def test_overlapped_capture_holds_the_optimizer_step_until_copied(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    entered, release = threading.Event(), threading.Event()
    hook, copy = store._capturer.before_optimizer_step, store._capturer.stager.copy_deferred

    def hook_spy(*args: object) -> None:
        entered.set()
        hook(*args)

    def slow_copy() -> None:
        assert release.wait(TIMEOUT)
        copy()

    store._capturer.before_optimizer_step = hook_spy  # type: ignore[method-assign]
    store._capturer.stager.copy_deferred = slow_copy  # type: ignore[method-assign]
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()

    handle = store.save(1, {"model": model, "optimizer": opt}, overlap_with=opt)
    model(torch.randn(4, 6)).square().sum().backward()  # changes BatchNorm buffers and grads
    stepper = threading.Thread(target=opt.step)
    stepper.start()
    assert entered.wait(TIMEOUT)
    assert stepper.is_alive()  # optimizer.step() is held while parameters are being copied
    release.set()
    stepper.join(TIMEOUT)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    handle.result(timeout=TIMEOUT)
    loaded = store.load(1)
    for key, value in expected.items():
        assert torch.equal(loaded.state["model"][key], value), key
    assert torch.equal(loaded.state["optimizer"]["state"][0]["momentum_buffer"], momentum)
    assert not torch.equal(model[0].weight, expected["0.weight"])
    store.close()


def test_a_failure_that_finished_before_the_next_save_is_still_raised_once(
    tmp_path: Path,
) -> None:
    """Regression: when the failed save had already finished by the next save() (not still
    in flight), its error was dropped instead of being raised once."""
    store, gated = _gated_store(tmp_path)
    gated.failures.append(PermissionError("finished failing"))
    failed = store.save(1, {"x": torch.ones(3)})
    with contextlib.suppress(Exception):
        failed._future.exception(timeout=TIMEOUT)  # done, without touching the store
    assert failed.done()
    with pytest.raises(SnapshotSaveError, match="finished failing"):
        store.save(2, {"x": torch.ones(3)})
    assert store.wait().step == 2  # type: ignore[union-attr]
    store.close()
