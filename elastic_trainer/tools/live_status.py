"""``elastic-train status --rdzv-endpoint``: a job's rendezvous as its store holds it now.

Read-only and bounded: a c10d client (``supervisor.rendezvous.endpoint.handshake``: a listener
that is not a store is named within seconds), one existence check and one read of the job's key
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
    from elastic_trainer.supervisor.cli.args import parse_endpoint
    from elastic_trainer.supervisor.rendezvous.endpoint import handshake, resolve

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
    check_state_shape(state, endpoint=endpoint)
    return describe(state, now=datetime.now(timezone.utc))


def _type(value: Any) -> str:
    return type(value).__name__


def _node_problem(where: str, node: Any) -> str | None:
    addr, pid = getattr(node, "addr", None), getattr(node, "pid", None)
    if not isinstance(addr, str) or not _is_int(pid):
        return f"{where} is {_type(node)}, expected a node (addr, pid)"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _participants_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"participants is {_type(value)}, expected a dict"
    for node, rank in value.items():
        if problem := _node_problem("a participant", node):
            return problem
        if not _is_int(rank):
            return f"the rank of {node.addr!r} is {_type(rank)}, expected an int"
    return None


def _wait_list_problem(value: Any) -> str | None:
    if not isinstance(value, (set, frozenset)):
        return f"wait_list is {_type(value)}, expected a set"
    for node in value:
        if problem := _node_problem("a waiting node", node):
            return problem
    return None


def _heartbeats_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"last_heartbeats is {_type(value)}, expected a dict"
    for node, beat in value.items():
        if problem := _node_problem("a heartbeat's node", node):
            return problem
        if not isinstance(beat, datetime):
            return f"the heartbeat of {node.addr!r} is {_type(beat)}, expected a datetime"
    return None


def _flags_problem(state: Any) -> str | None:
    if not _is_int(state.round):
        return f"round is {_type(state.round)}, expected an int"
    for name in ("complete", "closed"):
        if not isinstance(getattr(state, name), bool):
            return f"{name} is {_type(getattr(state, name))}, expected a bool"
    return None


_FIELDS = ("round", "complete", "closed", "participants", "wait_list", "last_heartbeats")


def state_shape_problem(state: Any) -> str | None:
    """Pure: what in a decoded state ``describe`` could not use, or None. The decoder only
    bounds the classes; a foreign or future writer can still put any of them anywhere."""
    if state is None:
        return None
    missing = [name for name in _FIELDS if not hasattr(state, name)]
    if missing:
        return f"the state is {_type(state)} without {', '.join(missing)}"
    return (
        _flags_problem(state)
        or _participants_problem(state.participants)
        or _wait_list_problem(state.wait_list)
        or _heartbeats_problem(state.last_heartbeats)
    )


def check_state_shape(state: Any, *, endpoint: str) -> None:
    """Raise the one-line bad-input error for a state ``describe`` could not use."""
    if problem := state_shape_problem(state):
        raise ConfigError(
            f"the rendezvous state at {endpoint} is not one this version understands: "
            f"{problem}; is the endpoint another job's store?"
        )


def describe(state: Any, *, now: datetime) -> dict[str, Any]:
    """Pure: a decoded rendezvous state -> what ops want to see."""
    if state is None:
        return {"round": 0, "complete": False, "closed": False, "nodes": [], "waiting": []}
    beats = dict(state.last_heartbeats)

    def node(desc: Any) -> dict[str, Any]:
        beat = beats.get(desc)
        if beat is not None and beat.tzinfo is None:  # older torch wrote utcnow(): naive UTC
            beat = beat.replace(tzinfo=timezone.utc)
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
