"""A node whose workers succeeded waits for the round's other members to finish, except for
members that are gone.

torch's exit barrier (``SimpleElasticAgent._exit_barrier``) counts arrivals up to the
round's size. A member that left on purpose (preempted: its goodbye heard on its presence
connection) or died never arrives, so every node that had finished waited the barrier's
whole timeout (60 s by default) and then logged torch's traceback at error level, for a job
whose workers all succeeded. Here each member that finishes sets its own signed key
(``finished_key``), and a node waits until every member of the round has one or is gone
(``still_running``), up to the timeout.

One node reads the members' keys: the first member in name order not gone (``collector``);
once all are there it sets one more key (``all_finished_key``), which every other node
waits on. Every node reading every member's key moved N key names a poll per node, N² in
all, at the moment every node of a job ends; now a poll is one key, and one node's N.

Why wait at all: the node that hosts the rendezvous store must not take it away while the
others still end their own workers (they read the store until then).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Set
from typing import Any

from elastic_trainer.contract.events import emit

POLL_S = 0.05  # between two reads of the members' keys (a goodbye or a close wakes at once)


def finished_key(run_id: str, round_: int, member: str) -> str:
    """Where ``member`` says its workers of round ``round_`` succeeded."""
    return f"elastic-train/{run_id}/finished/{round_}/{member}"


def all_finished_key(run_id: str, round_: int) -> str:
    """Where the collector says every member of round ``round_`` finished or is gone."""
    return f"elastic-train/{run_id}/finished/{round_}"


def still_running(members: Set[str], finished: Set[str], gone: Set[str]) -> set[str]:
    """The members the barrier still waits for: neither finished nor gone."""
    return set(members) - set(finished) - set(gone)


def collector(members: Set[str], gone: Set[str]) -> str | None:
    """The member that reads every member's key: the first in name order not gone. One still
    running collects once it finishes (until then nobody could end the wait anyway); one
    that dies or leaves hands it on to the next."""
    return min(set(members) - set(gone), default=None)


def wait_for_peers(
    *,
    store: Any,
    run_id: str,
    round_: int,
    me: str,
    members: Mapping[str, str],
    gone: Callable[[], Set[str]],
    wait: Callable[[float], bool],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> set[str]:
    """Say this node finished, then wait until every other member of ``members`` (member
    name -> its label for events) has too or is ``gone()``; ``wait(s)`` sleeps up to ``s``
    and says whether this node was told to stop meanwhile (then it waits no longer). The
    members not known to have finished when it stopped waiting (none: all done; the keys
    are read together, so before all are there none is known).

    A store that fails meanwhile ends the wait: its host ended (it hosts nothing more to
    wait for) or died (the others find that out themselves)."""
    started = clock()
    finished = {me}
    try:
        store.set(finished_key(run_id, round_, me), "1")
        waiting = still_running(members.keys(), finished, gone())
        if waiting:
            emit("exit_barrier.waiting", nodes=_labels(waiting, members), timeout_s=timeout_s)
        while waiting:
            if collector(members.keys(), gone()) == me:
                finished |= _finished(store, run_id, round_, waiting)
                waiting -= finished
                if not waiting:
                    store.set(all_finished_key(run_id, round_), "1")
                    break
            elif _all_finished(store, run_id, round_):
                waiting = set()
                break
            if clock() - started >= timeout_s:
                waiting -= _each_finished(store, run_id, round_, waiting)  # whom to name
                emit(
                    "exit_barrier.timed_out",
                    level="warning",
                    nodes=_labels(waiting, members),
                    waited_s=round(clock() - started, 3),
                    consequence="this node ends now; those nodes' workers may still be "
                    "running, and lose the rendezvous store if this node hosted it",
                )
                break
            if wait(POLL_S):
                break
            waiting = still_running(members.keys(), finished, gone())
    except Exception:  # the store is gone: see above
        return still_running(members.keys(), finished, gone())
    return waiting


def _finished(store: Any, run_id: str, round_: int, members: Set[str]) -> set[str]:
    """Those of ``members`` whose signed key says they finished (one forged hides itself):
    one check of all their keys, and one read once all are there. Until then none is read
    alone: at the end of a job every node waits for every other, and a check per key and
    poll was N² store round trips a poll."""
    keys = {m: finished_key(run_id, round_, m) for m in sorted(members)}
    values = store.get_each_if_all(list(keys.values()))
    if values is None:
        return set()
    return {m for m, v in zip(keys, values, strict=True) if v == b"1"}


def _all_finished(store: Any, run_id: str, round_: int) -> bool:
    """Has the collector said every member finished (signed: a forged key is no answer)?"""
    values = store.get_each_if_all([all_finished_key(run_id, round_)])
    return values is not None and values[0] == b"1"


def _each_finished(store: Any, run_id: str, round_: int, members: Set[str]) -> set[str]:
    """``_finished`` one key at a time: those that finished while others did not."""
    return {m for m in members if _finished(store, run_id, round_, {m})}


def _labels(names: Set[str], members: Mapping[str, str]) -> list[str]:
    return sorted(members.get(n, n) for n in names)
