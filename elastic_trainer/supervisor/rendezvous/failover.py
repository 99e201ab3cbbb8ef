"""Store failover: when the agent that hosts the rendezvous store is gone, a survivor hosts it.

The c10d store lives in the process of the agent that hosts it (``handler.create_handler``);
that agent's node is as preemptible as any other. When it goes, the survivors move the store
instead of ending the job:

- **Only on proof.** The store host must be *certainly* gone: its agent's presence connection
  closed without a goodbye (its process died: the store died with it), or it said so itself
  (a preempted store host writes ``leaving_key`` into its store before it stops). A store
  host that merely went silent (frozen, cut off by a partition) may still be serving the
  others: nothing moves, and the nodes that cannot reach it stop as before (``store_lost``).
  So the old store and a new one never serve one job at the same time.
- **One new host, chosen alike everywhere.** Every survivor knows the members of the last
  round and which of them hosted the store (read when the round formed); the new host is the
  first of the members not known gone, in the order of their names (``elect``). Two survivors
  can only disagree while one has not yet seen a death the other has; the one that thinks it
  is first then really is (everyone before it is proven dead), so at most one serves. One
  that waits for a host that died meanwhile sees that death and elects again.
- **Where.** The new host serves on its own presence address (the one every peer already
  reached it at) and the rendezvous port. On one machine (tests, one host with several
  agents) that is the original endpoint, so a node started later finds it there too.
- **What carries over.** The rendezvous state is rebuilt by the survivors joining a fresh
  round on the new store; the store's lineage token (snapshot folder ownership) is carried
  over, so the re-formed group takes its own folder over at once.

``elect`` is pure; ``move_store`` carries the answer out. ``store.moved`` says what happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import Any

from elastic_trainer.contract.endpoint import format_endpoint, split_address
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ElasticTrainError

# Between two attempts to reach the elected host's store while it starts.
RETRY_S = 0.1


@dataclass(frozen=True, kw_only=True)
class Election:
    """``host``: the member that hosts the store from now on (None: no failover, see ``why``)."""

    host: str | None
    why: str


def elect(
    *,
    members: Set[str],
    store_host: str | None,
    gone: Set[str],
    static: bool,
) -> Election:
    """Who hosts the store now that it is unreachable: a pure function of what this node knows.

    ``members``: the last round's members (names); ``store_host``: the member that hosted its
    store (None: a standalone store, or one that was never ours); ``gone``: members certainly
    gone (closed connection, goodbye, a leaving host); ``static``: torchrun's static mode,
    whose node ranks are fixed (rank 0 hosts; nothing moves).
    """
    if static:
        return Election(host=None, why="static node ranks (--node-rank): the store stays on rank 0")
    if store_host is None or store_host not in members:
        return Election(
            host=None, why="the store is not hosted by a member of this job (a standalone store)"
        )
    if store_host not in gone:
        return Election(
            host=None,
            why="its host is silent, not known gone (a partition or a frozen node may "
            "still serve the others: no second store is started)",
        )
    candidates = sorted(set(members) - set(gone))
    if not candidates:
        return Election(host=None, why="no member of the last round is left")
    return Election(host=candidates[0], why="the store host is gone")


class StoreMoveFailed(ElasticTrainError):
    """The elected host's store did not come up within the deadline."""

    exit_code = 1


def not_moved(host: str, why: str) -> StoreMoveFailed:
    """The one line of a node that stops because its store stopped answering and may not
    move (``why``: ``Election.why``)."""
    return StoreMoveFailed(
        f"the rendezvous store on {host} stopped answering and does not move: {why}; "
        "restart the job (it resumes from the last snapshot)"
    )


@dataclass(frozen=True, kw_only=True)
class Moved:
    store: Any  # the connected (or hosted) c10d store
    host: str  # the member hosting it
    endpoint: str  # host:port
    hosted: bool  # this process hosts it


def move_store(
    *,
    me: str,
    members: Set[str],
    addresses: Mapping[str, str],
    store_host: str,
    gone: Callable[[], Set[str]],
    port: int,
    deadline_s: float,
    serve: Callable[[str, int], Any],
    connect: Callable[[str, int], Any | None],
    is_served_by: Callable[[Any, str], bool],
    clock: Callable[[], float] = time.monotonic,
) -> Moved:
    """Elect a host, serve there (``serve``) or connect to it (``connect``: None while not up),
    re-electing whenever a death is seen meanwhile, until ``deadline_s``.

    ``addresses``: member -> its presence address ``host:port`` (only the host part is used);
    ``is_served_by(store, member)``: the store answering there is the one that member hosts
    (not the old one still shutting down on the same address).
    """

    ends = clock() + deadline_s
    while True:
        election = elect(members=members, store_host=store_host, gone=gone(), static=False)
        if election.host is None:
            raise StoreMoveFailed(f"the rendezvous store cannot move: {election.why}")
        if election.host not in addresses:
            raise StoreMoveFailed(
                f"the rendezvous store cannot move: the elected host {election.host} published "
                "no address"
            )
        host, _ = split_address(addresses[election.host])
        endpoint = format_endpoint(host, port)
        if election.host == me:
            try:
                return Moved(store=serve(host, port), host=me, endpoint=endpoint, hosted=True)
            except (OSError, RuntimeError):  # the port still held (the old store, leaving)
                pass
        else:
            store = connect(host, port)
            if store is not None and is_served_by(store, election.host):
                return Moved(store=store, host=election.host, endpoint=endpoint, hosted=False)
        if clock() > ends:
            raise StoreMoveFailed(
                f"the rendezvous store did not come up on the elected host {election.host} "
                f"({endpoint}) within {deadline_s:g}s"
            )
        time.sleep(RETRY_S)


def report(
    *, old_host: str, moved: Moved, why: str, began: float, label: Callable[[str], str] = str
) -> None:
    """``label``: a member's ``--node`` name from its member name (what events name it by)."""
    emit(
        "store.moved",
        level="warning",
        old_host=label(old_host),
        new_host=label(moved.host),
        old_member=old_host,
        new_member=moved.host,
        endpoint=moved.endpoint,
        why=why,
        duration_s=round(time.monotonic() - began, 3),
        hosted_here=moved.hosted,
    )
