"""proc_tree finds what psutil's whole-machine walk finds, reading only the tree."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from elastic_trainer import proc_tree

# a child that starts a grandchild, from a second thread (listed under that thread, not the
# main one), prints its pid, and waits for stdin to close
TREE = """
import subprocess, sys, threading
found = []
t = threading.Thread(target=lambda: found.append(subprocess.Popen(
    [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)))
t.start(); t.join()
print(found[0].pid, flush=True)
sys.stdin.read()
found[0].stdin.close(); found[0].wait()
"""


@pytest.fixture
def tree():
    """(child, grandchild) pids of a tree this test process started from a second thread."""
    started: list[subprocess.Popen[str]] = []

    def start() -> None:
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        started.append(subprocess.Popen([sys.executable, "-c", TREE], text=True, **pipes))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    child = started[0]
    grandchild = int(child.stdout.readline())
    yield child.pid, grandchild
    child.stdin.close()
    child.wait(timeout=30)


def _pids(procs: list[psutil.Process]) -> set[int]:
    return {p.pid for p in procs}


LISTS_CHILDREN = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


@pytest.mark.skipif(not LISTS_CHILDREN, reason="no kernel lists here (fallback: next test)")
def test_the_kernel_s_lists_find_the_tree_psutil_finds(tree) -> None:
    child, grandchild = tree
    me = os.getpid()
    assert _pids(proc_tree.children(me, recursive=True)) >= {child, grandchild}
    assert _pids(proc_tree.children(me, recursive=True)) == _pids(
        psutil.Process(me).children(recursive=True)
    )
    assert child in _pids(proc_tree.children(me, recursive=False))
    assert grandchild not in _pids(proc_tree.children(me, recursive=False))
    assert _pids(proc_tree.children(child, recursive=True)) == {grandchild}


def test_without_the_kernel_s_lists_psutil_s_walk_finds_the_same(tree, monkeypatch) -> None:
    child, grandchild = tree
    monkeypatch.setattr(proc_tree, "_kernel_lists_children", lambda: False)
    assert _pids(proc_tree.children(os.getpid(), recursive=True)) >= {child, grandchild}
    assert _pids(proc_tree.children(child, recursive=True)) == {grandchild}


def test_a_pid_no_longer_running_is_no_such_process() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(psutil.NoSuchProcess):
        proc_tree.children(gone.pid, recursive=True)


def test_a_listed_pid_whose_parent_is_another_is_not_taken_for_a_child(monkeypatch) -> None:
    """A child that exited after the list was read, its pid taken by an unrelated process."""
    unrelated = os.getppid()  # alive, and not our child
    monkeypatch.setattr(proc_tree, "_child_pids", lambda pid: [unrelated])
    monkeypatch.setattr(proc_tree, "_kernel_lists_children", lambda: True)
    assert proc_tree.children(os.getpid(), recursive=True) == []
