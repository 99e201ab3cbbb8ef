"""Crash consistency: a writer SIGKILLed at any point of a save never leaves a bad latest().

The kill point is injected deterministically (``faults.KillAt(point, n)``), no sleeps.
Writers are forked (cheap: torch is already imported) for many seeds; one case goes through
a freshly exec'd interpreter to prove nothing depends on the fork.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore
from snapshots.format import layout
from snapshots.storage import faults

POINTS = faults.SAVE_POINTS

SAVES = 4
FILES_PER_SAVE = 3


def _state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(32, 8, generator=gen), "b": torch.randn(8, generator=gen)},
        "optimizer": {"state": {0: {"m": torch.randn(32, 8, generator=gen)}}, "lr": 0.1},
        "step": step,
    }


def _assert_state_equal(got: dict, step: int) -> None:
    want = _state(step)
    assert torch.equal(got["model"]["w"], want["model"]["w"])  # type: ignore[index]
    assert torch.equal(got["model"]["b"], want["model"]["b"])  # type: ignore[index]
    assert torch.equal(got["optimizer"]["state"][0]["m"], want["optimizer"]["state"][0]["m"])  # type: ignore[index]
    assert got["step"] == step


def _save_all(root: str, mode: str, report: int) -> None:
    """Save steps 1..SAVES; a step is reported once committed. ``mode``: blocking, async
    (the writer thread), overlapped (async, optimizer state copied on the writer thread)."""
    store = SnapshotStore(root, async_save=mode != "blocking", keep=2)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, SAVES + 1):
        state = _state(step)
        if mode == "overlapped":
            model(torch.randn(2, 8)).sum().backward()
            handle = store.save(step, {**state, "net": model, "opt": opt}, overlap_with=opt)
            opt.step()  # waits for the overlapped copy
        else:
            handle = store.save(step, state)
        handle.result()
        os.write(report, f"{step}\n".encode())


def _fork_writer(root: str, spec: str, mode: str = "blocking") -> tuple[int, bool]:
    """Run the writer in a forked child; return (last step it reported saved, was killed)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(read_fd)
            faults.inject(faults.KillAt.parse(spec))
            _save_all(root, mode, write_fd)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        reported = [int(line) for line in pipe.read().split()]
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return (reported[-1] if reported else 0), killed


def _check_after_crash(root: str, last_saved: int, point: str) -> None:
    store = SnapshotStore(root, async_save=False, keep=2)
    latest = store.latest()
    # The killed save commits only if it died after its manifest landed.
    allowed = {last_saved, last_saved + 1} if point == "after_manifest" else {last_saved}
    if latest is None:
        assert 0 in allowed
    else:
        assert latest.step in allowed
        _assert_state_equal(store.load().state, latest.step)
    # A new generation carries on, and its housekeeping removes the crashed partial write.
    store.save(SAVES + 10, _state(SAVES + 10))
    for folder in Path(root).iterdir():
        assert (folder / layout.MANIFEST_NAME).exists(), f"orphan left: {folder.name}"
        assert not [p for p in folder.iterdir() if layout.is_temp_name(p.name)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("seed", range(40))
def test_sigkill_at_any_point_keeps_latest_whole(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    point = POINTS[seed % len(POINTS)]  # every point, several times
    per_save = FILES_PER_SAVE if point == "mid_file" else 1
    nth = rng.randint(1, SAVES * per_save)
    last_saved, killed = _fork_writer(str(tmp_path), f"{point}:{nth}")
    assert killed, "the kill point was never reached: the test would prove nothing"
    _check_after_crash(str(tmp_path), last_saved, point)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("mode", ["async", "overlapped"])
@pytest.mark.parametrize("seed", range(len(POINTS)))
def test_sigkill_during_background_saves_keeps_latest_whole(
    tmp_path: Path, seed: int, mode: str
) -> None:
    """The kill lands on the writer thread, while the training thread goes on."""
    rng = random.Random(seed)
    point = POINTS[seed % len(POINTS)]
    per_save = (FILES_PER_SAVE + (mode == "overlapped") * 2) if point == "mid_file" else 1
    nth = rng.randint(1, SAVES * per_save)
    last_saved, killed = _fork_writer(str(tmp_path), f"{point}:{nth}", mode)
    assert killed, "the kill point was never reached: the test would prove nothing"
    _check_after_crash(str(tmp_path), last_saved, point)


WRITER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_crash import _state
from snapshots import SnapshotStore
from snapshots.storage import faults
faults.inject(faults.KillAt("mid_manifest", 2))
store = SnapshotStore({root!r}, async_save=False)
for step in (1, 2):
    store.save(step, _state(step))
    print("SAVED", step, flush=True)
"""


def test_sigkill_of_a_separate_interpreter_mid_manifest(tmp_path: Path, worker_env: dict) -> None:
    root = str(tmp_path / "snaps")
    env = dict(worker_env)
    code = WRITER.format(tests=str(Path(__file__).parent), root=root)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    saved = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("SAVED")]
    assert saved == ["1"]
    _check_after_crash(root, 1, "mid_manifest")
