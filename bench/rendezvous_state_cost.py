"""The price of a signed JSON rendezvous state, per heartbeat and per round, against torch's.

Every heartbeat and every step of a round is a sync of the state holder: read the state from
the store (and, when it changed, write it back with compare-and-set). torch's c10d backend
stores a base64 pickle; ours (``supervisor/rendezvous/state_backend.py``) signed, schema-
checked JSON. Both arms run in one process against one real loopback ``TCPStore``, with a
state of N members, interleaved:

- ``read``: a sync that finds the state as this node last saw it;
- ``read, changed``: a sync after another node wrote its heartbeat (the usual read: every
  member writes one each half keep-alive interval);
- ``heartbeat``: read, change this node's heartbeat time, compare-and-set;
- ``round``: a whole one-node round (``next_rendezvous`` on a fresh handler), the per-round
  cost at N = 1 (the ops a round runs, not the waits around it).

    python bench/rendezvous_state_cost.py [--members 2,16,64,256] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.rendezvous.signed_store import SignedStore
from elastic_trainer.supervisor.rendezvous.state_backend import SignedStateBackend


def state_of(members: int) -> _RendezvousState:
    state = _RendezvousState()
    state.complete = True
    now = datetime.now(timezone.utc)
    for i in range(members):
        node = _NodeDesc(f"10.0.{i // 256}.{i % 256}", 10_000 + i, 0)
        state.participants[node] = i
        state.last_heartbeats[node] = now
    return state


def settings(run_id: str) -> RendezvousSettings:
    return RendezvousSettings(run_id, 1, 4096, RendezvousTimeout(), timedelta(seconds=5), 3)


def backends(store: TCPStore, run: str) -> dict[str, Callable[[], Any]]:
    """Arm -> a maker of one node's backend (every node of an arm: one run, one key)."""
    key = JobKey.generate()
    return {
        "torch (pickle)": lambda: C10dRendezvousBackend(store, f"{run}-t"),
        "elastic-train (signed JSON)": lambda: SignedStateBackend(
            SignedStore(store, key), f"{run}-e"
        ),
    }


MODES = {
    "read": "a sync that finds the state as it last saw it",
    "read, changed": "a sync after another node wrote its heartbeat",
    "heartbeat": "read, this node's heartbeat time changed, compare-and-set",
}


def per_sync_us(make: Callable[[], Any], members: int, repeats: int, *, mode: str) -> float:
    holder, peer = (
        _BackendRendezvousStateHolder(make(), settings("bench"), cache_duration=0) for _ in range(2)
    )
    holder.state.__dict__.update(state_of(members).__dict__)
    holder.mark_dirty()
    holder.sync()
    peer.sync()
    node, other = list(holder.state.participants)[:2] if members > 1 else [None, None]
    times = []
    for _ in range(repeats):
        if mode == "read, changed":  # untimed: another node's heartbeat
            peer.sync()
            peer.state.last_heartbeats[other] = datetime.now(timezone.utc)
            peer.mark_dirty()
            peer.sync()
        began = time.perf_counter()
        holder.sync()
        if mode == "heartbeat":
            holder.state.last_heartbeats[node] = datetime.now(timezone.utc)
            holder.mark_dirty()
            holder.sync()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def per_round_ms(store: TCPStore, name: str, repeats: int) -> float:
    times = []
    for i in range(repeats):
        run_id = f"round-{name[:5]}-{i}"
        backend = backends(store, run_id)[name]()
        handler = DynamicRendezvousHandler.from_backend(
            run_id, store, backend, 1, 1, "127.0.0.1",
            RendezvousTimeout(last_call=timedelta(seconds=0.01)),
        )  # fmt: skip
        with torch_compat.no_join_jitter():  # torch's random 0-0.3 s sleep: not a cost of ours
            began = time.perf_counter()
            handler.next_rendezvous()
            times.append(time.perf_counter() - began)
        handler.shutdown()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="2,16,64,256")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    print("| members | sync | torch (pickle) µs | elastic-train (signed JSON) µs | ratio |")
    print("|---|---|---|---|---|")
    for members in [int(m) for m in args.members.split(",")]:
        for i, mode in enumerate(MODES):
            arms = backends(store, f"m{members}-{i}")
            us = [per_sync_us(make, members, args.repeats, mode=mode) for make in arms.values()]
            row(members, mode, *us)
    repeats = max(5, args.repeats // 10)
    rounds = [per_round_ms(store, name, repeats) * 1e3 for name in backends(store, "r")]
    row(1, "a whole round", *rounds)


def row(members: int, kind: str, torch_us: float, ours_us: float) -> None:
    print(f"| {members} | {kind} | {torch_us:.0f} | {ours_us:.0f} | {ours_us / torch_us:.2f}x |")


if __name__ == "__main__":
    main()
