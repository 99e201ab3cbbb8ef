"""A process's children, at a cost that grows with its own tree, not with the machine.

psutil's ``Process.children`` reads ``/proc/PID/stat`` of every process on the machine to
build a parent map, on each call. The supervisor asks for its workers' trees on every
monitor pass and its node sentinel on every scan, so each call cost what the whole machine
runs: with 32 agents on one machine that walk was the largest share of an agent's work in
a re-form, and it grew with every agent added, each one's walk reading the others'
processes too. Linux lists each thread's children in ``/proc/PID/task/TID/children``
(``CONFIG_PROC_CHILDREN``, on in the common distributions' kernels): reading those for the
tree's own processes finds the same children. Where the file does not exist (another
kernel, another OS), psutil's walk is used.

The kernel's list, like psutil's map, is a snapshot: a child forked while it is read may be
missing from it, and is found at the next call. A pid seen here is checked to still be a
child of its parent (psutil's ``ppid``) before it is returned, so a pid reused in between is
not taken for one.
"""

from __future__ import annotations

import functools
import os

import psutil


@functools.cache
def _kernel_lists_children() -> bool:
    pid = os.getpid()
    return os.path.exists(f"/proc/{pid}/task/{pid}/children")


def _child_pids(pid: int) -> list[int]:
    """The pids of ``pid``'s children, from every one of its threads' lists (a child is
    listed under the thread that forked it)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone
        return []
    found: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as listing:
                found.extend(int(field) for field in listing.read().split())
        except OSError:  # the thread exited meanwhile
            continue
    return found


def children(pid: int, *, recursive: bool) -> list[psutil.Process]:
    """``psutil.Process(pid).children(recursive=recursive)``, read from the tree only
    (parents before their children). ``psutil.NoSuchProcess`` when ``pid`` is gone."""
    if not _kernel_lists_children():
        return psutil.Process(pid).children(recursive=recursive)  # type: ignore[no-any-return]
    psutil.Process(pid)  # raises NoSuchProcess as psutil's own walk would
    out: list[psutil.Process] = []
    seen = {pid}
    parents = [pid]
    while parents:
        parent = parents.pop(0)
        for child_pid in _child_pids(parent):
            if child_pid in seen:
                continue
            try:
                child = psutil.Process(child_pid)
                if child.ppid() != parent:  # exited and its pid reused since the read
                    continue
            except psutil.Error:
                continue
            seen.add(child_pid)
            out.append(child)
            if recursive:
                parents.append(child_pid)
    return out
