"""``elastic-train status --rdzv-endpoint``: a job's rendezvous as its store holds it now.

Read-only and bounded: a c10d client (``supervisor.endpoint.handshake``: a listener that is
not a store is named within seconds), one existence check and one read of the job's key
(``torch_compat``: never C10dRendezvousBackend, whose constructor writes it), decoded with
an unpickler that only knows the classes a rendezvous state is made of.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from elastic_trainer import torch_compat
from elastic_trainer.errors import ConfigError


def read_state(endpoint: str, job_id: str, timeout_s: float) -> dict[str, Any] | None:
    """The job's rendezvous as plain data, or None when the store has no such job."""
    from elastic_trainer.supervisor.args import parse_endpoint
    from elastic_trainer.supervisor.endpoint import handshake, resolve

    host, port = parse_endpoint(endpoint)
    resolve(host, port)
    try:
        store = handshake(host, port, read_timeout_s=timeout_s)
    except OSError as exc:
        raise ConfigError(f"--rdzv-endpoint={endpoint} is unreachable ({exc})") from exc
    except Exception as exc:  # refused meanwhile (transient): say so, one line
        raise ConfigError(f"--rdzv-endpoint={endpoint}: {exc}") from exc
    key = torch_compat.rendezvous_key(job_id)
    if not store.check([key]):
        return None
    try:
        state = torch_compat.decode_rendezvous_state(store.get(key))
    except ValueError as exc:
        raise ConfigError(
            f"the store at {endpoint} holds no readable state for {job_id}: {exc}"
        ) from None
    return describe(state, now=datetime.now(timezone.utc))


def describe(state: Any, *, now: datetime) -> dict[str, Any]:
    """Pure: a decoded rendezvous state -> what ops want to see."""
    if state is None:
        return {"round": 0, "complete": False, "closed": False, "nodes": [], "waiting": []}
    beats = dict(getattr(state, "last_heartbeats", {}))

    def node(desc: Any) -> dict[str, Any]:
        beat = beats.get(desc)
        age = round((now - beat).total_seconds(), 1) if beat is not None else None
        return {"addr": desc.addr, "pid": desc.pid, "heartbeat_age_s": age}

    members = sorted(state.participants.items(), key=lambda item: item[1])
    return {
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "nodes": [{**node(desc), "group_rank": rank} for desc, rank in members],
        "waiting": [node(desc) for desc in sorted(state.wait_list, key=lambda d: d.addr)],
    }


def print_live_status(endpoint: str, job_id: str, timeout_s: float, *, as_json: bool) -> int:
    state = read_state(endpoint, job_id, timeout_s)
    if state is None:
        raise ConfigError(
            f"the store at {endpoint} has no rendezvous for job {job_id!r}: check --job-id"
        )
    if as_json:
        print(json.dumps({"endpoint": endpoint, "job_id": job_id, **state}, indent=2))
        return 0
    flags = "closed" if state["closed"] else "complete" if state["complete"] else "forming"
    print(f"job:       {job_id} at {endpoint}")
    print(f"round:     {state['round']} ({flags}), {len(state['nodes'])} node(s)")
    for n in state["nodes"]:
        beat = n["heartbeat_age_s"]
        print(f"  rank {n['group_rank']}: {n['addr']} pid {n['pid']}, heartbeat {beat}s ago")
    for n in state["waiting"]:
        print(f"  waiting: {n['addr']} pid {n['pid']}")
    return 0
