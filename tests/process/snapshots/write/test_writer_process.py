"""The writer process (``snapshots.write.writer_process``) and its shared staging memory.

Every test here starts its own child (a Python that imports torch: seconds) with the size
threshold lowered to zero, so a small state goes through it; and stops it afterwards.
Stores opt in with ``storage_options={"writer_process": True}`` (``ON``).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
import torch
from structlog.testing import capture_logs

import snapshots
from snapshots import SnapshotStore
from snapshots.errors import SnapshotSaveError
from snapshots.format.layout import TEMP_PREFIX
from snapshots.format.serialization import Stager, serialize_into
from snapshots.storage import faults
from snapshots.storage.local import LocalStorage
from snapshots.write import shared_staging as _shared_staging
from snapshots.write import writer_process as _writer_process

READY_S = 120.0
ON = {"writer_process": True}


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.BatchNorm1d(300))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 300)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "plain": {"step": 7, "empty": torch.empty(0)}}


@pytest.fixture
def through_process(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_writer_process, "PROCESS_MIN_BYTES", 0)
    faults.inject(None)
    _writer_process.stop()
    yield
    _writer_process.stop()


def _started() -> _writer_process.WriterProcess:
    """The writer process, started and ready (what the first large save does, then waits)."""
    assert _writer_process._process_for_save() is None  # the first call only starts it
    process = _writer_process.current()
    assert process is not None
    assert process.wait_ready(READY_S), process.lost
    return process


def _file_bytes(tmp_path, name: str, value: object, *, writer_process: bool) -> bytes:
    storage = LocalStorage(str(tmp_path), writer_process=writer_process)

    def fill(sink):
        done = _writer_process.try_write(value, sink, "blake3", lambda: None)
        return done if done is not None else serialize_into(value, sink, "blake3")

    storage.write_streamed(name, fill)
    with open(tmp_path / name, "rb") as f:
        return f.read()


def test_the_process_writes_the_same_bytes_as_the_thread(tmp_path, through_process):
    stager = Stager(shared=True)  # its arena holds the blocks: they are freed with it
    staged = stager.capture(_state())
    process = _started()
    before = process._requests
    for key, value in staged.items():
        ours = _file_bytes(tmp_path, f"p-{key}", value, writer_process=True)
        theirs = _file_bytes(tmp_path, f"t-{key}", value, writer_process=False)
        assert ours == theirs
        loaded = torch.load(io.BytesIO(ours), weights_only=True)
        assert loaded.keys() == value.keys()
    assert process._requests == before + len(staged)  # each file went through the child


def test_a_store_saves_through_the_process_and_loads_back(tmp_path, through_process):
    state = _state()
    store = SnapshotStore(str(tmp_path), keep=2, storage_options=ON)
    with capture_logs() as logs:
        store.save(1, state, blocking=False).result()  # starts the process, written here
        process = _writer_process.current()
        assert process is not None and process.wait_ready(READY_S)
        store.save(2, state, blocking=False, overlap_with=state["optimizer"]).result()
    assert process._requests == 3  # step 2's three entries
    assert [e["pid"] for e in logs if e["event"] == "snapshot.writer_process_started"] == [
        process.pid
    ]
    loaded = store.load(2)
    for name, tensor in state["model"].state_dict().items():
        torch.testing.assert_close(loaded.state["model"][name], tensor)
    assert store.verify(2).step == 2
    store.close()


def test_a_child_killed_mid_save_leaves_the_save_to_the_thread(tmp_path, through_process):
    state = _state()
    store = SnapshotStore(str(tmp_path), keep=2, storage_options=ON)
    process = _started()
    os.kill(process.pid, signal.SIGSTOP)  # it takes the request and never answers
    sent = threading.Event()
    original = process._send

    def send_then_signal(*args, **kwargs):
        original(*args, **kwargs)
        sent.set()

    process._send = send_then_signal
    with capture_logs() as logs:
        handle = store.save(1, state, blocking=False)
        assert sent.wait(READY_S)
        os.kill(process.pid, signal.SIGKILL)
        info = handle.result()
        store.save(2, state, blocking=False).result()  # later saves: on the thread
    lost = [e for e in logs if e["event"] == "snapshot.writer_process_lost"]
    assert len(lost) == 1 and lost[0]["pid"] == process.pid and lost[0]["fallback"] == "thread"
    assert info.step == 1 and store.verify(1).step == 1 and store.verify(2).step == 2
    assert process._requests == 1
    assert not [f for f in os.listdir(tmp_path / "step-000000000001") if f.startswith(TEMP_PREFIX)]
    store.close()


def test_a_deadline_passing_mid_save_stops_the_child(tmp_path, through_process):
    state = _state()
    store = SnapshotStore(str(tmp_path), keep=2, storage_options=ON)
    process = _started()
    os.kill(process.pid, signal.SIGSTOP)
    with capture_logs() as logs:
        with pytest.raises(SnapshotSaveError, match="deadline"):
            store.save(1, state, blocking=True, deadline_s=1.0)
        assert process._proc.wait(timeout=30) == -signal.SIGKILL  # stopped, not left running
        assert store.save(2, state, blocking=True).step == 2  # the thread takes over
    lost = [e["error"] for e in logs if e["event"] == "snapshot.writer_process_lost"]
    assert lost == ["stopped: the save was cancelled while it wrote"]
    store.close()


def test_by_default_and_for_small_saves_the_thread_writes(tmp_path, through_process, monkeypatch):
    state = _state()
    default = SnapshotStore(str(tmp_path / "default"))
    default.save(1, state, blocking=True)
    assert _writer_process.current() is None  # opt-in
    staged = default._capturer.stager.capture({"w": torch.ones(1 << 16)})["w"]
    assert _shared_staging.locate(staged) is None  # and staging stays on private pages
    monkeypatch.setattr(_writer_process, "PROCESS_MIN_BYTES", 1 << 40)
    SnapshotStore(str(tmp_path / "on"), storage_options=ON).save(1, state, blocking=True)
    assert _writer_process.current() is None  # under the size threshold
    with pytest.raises(Exception, match="writer_process"):
        SnapshotStore(str(tmp_path / "bad"), storage_options={"writer_process": "yes"})


def test_a_process_that_cannot_start_leaves_saves_on_the_thread(tmp_path, through_process,
                                                                 monkeypatch):  # fmt: skip
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    store = SnapshotStore(str(tmp_path / "s"), storage_options=ON)
    with capture_logs() as logs:
        for step in (1, 2):
            assert store.save(step, _state(), blocking=True).step == step
    lost = [e for e in logs if e["event"] == "snapshot.writer_process_lost"]
    assert len(lost) == 1 and lost[0]["pid"] is None  # tried once, not at every save
    assert "did not start: FileNotFoundError" in lost[0]["error"]
    assert store.verify(2).step == 2


def test_an_armed_kill_point_keeps_the_save_in_the_training_process(tmp_path, through_process,
                                                                     monkeypatch):  # fmt: skip
    faults.inject(faults.KillAt("after_manifest", 1000))  # armed, never reached
    try:
        SnapshotStore(str(tmp_path), storage_options=ON).save(1, _state(), blocking=True)
    finally:
        faults.inject(None)
    assert _writer_process.current() is None


def test_the_child_exits_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        from snapshots import SnapshotStore
        from snapshots.write import writer_process as _writer_process
        _writer_process.PROCESS_MIN_BYTES = 0
        store = SnapshotStore({str(tmp_path)!r}, storage_options={{"writer_process": True}})
        store.save(1, {{"w": torch.ones(1000)}}, blocking=True)
        assert _writer_process.current().wait_ready(120)
        print(_writer_process.current().pid, file=sys.stderr, flush=True)
        sys.stdin.read()  # killed here
    """)
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    child = psutil.Process(int(parent.stderr.readline()))
    assert child.ppid() == parent.pid
    parent.kill()  # this process only: not its group, not the child
    parent.wait()
    child.wait(timeout=30)  # raises if it outlives its parent


def test_the_child_shows_its_role_in_ps(through_process, monkeypatch):
    monkeypatch.setenv("RANK", "5")  # the training process's rank, which the child inherits
    process = _started()
    with open(f"/proc/{process.pid}/cmdline", "rb") as f:
        assert f.read().rstrip(b"\0") == b"elastic-train snapshot writer (rank 5)"
    assert psutil.Process(process.pid).name() == "et-writer 5"


def test_shared_staging_places_and_alignment():
    arena = _shared_staging.SharedArena()
    big = arena.tensor(torch.Size([1 << 16]), torch.float32)
    small = arena.tensor(torch.Size([3]), torch.int64)
    assert big.data_ptr() % 4096 == 0 and small.data_ptr() % 64 == 0
    assert _shared_staging.locate(big) is not None and _shared_staging.locate(small) is not None
    assert _shared_staging.locate(big[1:]) is None  # not from its buffer's start
    assert _shared_staging.locate(torch.ones(10)) is None  # private memory
    block = _shared_staging.locate(big).block
    assert block in _shared_staging.live_blocks()
    del arena
    assert block not in _shared_staging.live_blocks()  # freed with its arena
    big.add_(1)  # ... while the tensors carved from it stay usable


def test_staging_moves_to_a_new_arena_once_replaced_buffers_outweigh_live_ones():
    stager = Stager(shared=True)
    first = stager.capture({"w": torch.ones(1 << 16)})["w"]
    block = _shared_staging.locate(first).block
    stager.capture({"w": torch.ones(2 << 16)})  # replaced: 256 KiB stranded < 512 KiB live
    assert _shared_staging.locate(stager.capture({"w": torch.ones(2 << 16)})["w"]).block == block
    stager.capture({"w": torch.ones(1 << 10)})  # 768 KiB stranded > 4 KiB live: a new arena
    again = stager.capture({"w": torch.ones(1 << 10)})["w"]
    assert _shared_staging.locate(again).block != block


def test_the_child_imports_the_package_from_where_this_process_found_it():
    root = _writer_process._PACKAGES_ROOT
    assert os.path.samefile(os.path.join(root, "snapshots", "__init__.py"), snapshots.__file__)
