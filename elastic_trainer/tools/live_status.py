"""``elastic-train status --rdzv-endpoint``: a job's rendezvous as its store holds it now.

Read-only and bounded: a c10d client (``supervisor.rendezvous.endpoint.handshake``: a listener
that is not a store is named within seconds), one existence check and one read of the job's
key and of each node's heartbeat key. A value is used only when it is signed with the job's
secret (``contract.auth``; found as the supervisor finds it, never made here) and the state
passes its schema
(``state_codec.decode``: sizes, depth, types, ranges, printable addresses). Anything else is
one line, never a traceback, and nothing from the store reaches the terminal unchecked.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

from elastic_trainer.contract import auth
from elastic_trainer.contract.endpoint import parse_endpoint, resolve
from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor import torch_compat

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def read_state(
    endpoint: str, job_id: str, timeout_s: float, key: auth.JobKey
) -> dict[str, Any] | None:
    """The job's rendezvous as plain data, or None when the store has no such job."""
    from elastic_trainer.supervisor.rendezvous import state_codec
    from elastic_trainer.supervisor.rendezvous.endpoint import handshake

    host, port = parse_endpoint(endpoint)
    resolve(host, port)
    try:
        store = handshake(host, port, read_timeout_s=timeout_s)
    except OSError as exc:
        raise ConfigError(f"--rdzv-endpoint={endpoint} is unreachable ({exc})") from exc
    except Exception as exc:  # refused meanwhile (transient): say so, one line
        raise ConfigError(f"--rdzv-endpoint={endpoint}: {exc}") from exc
    name = torch_compat.rendezvous_key(job_id)
    if not store.check([name]):
        return None
    payload = auth.verify_value(key, name, bytes(store.get(name)))
    if payload is None:
        raise ConfigError(
            f"the rendezvous state of {job_id!r} at {endpoint} is not signed with the job's "
            f"secret (key {key.fingerprint}): pass the job's --rdzv-secret-file or "
            "--snapshot-dir; otherwise someone else wrote it"
        )
    try:
        plain = state_codec.decode(payload)
    except ValueError as exc:
        raise ConfigError(
            f"the store at {endpoint} holds no readable state for {job_id!r}: {exc}"
        ) from None
    if plain is not None:
        plain = _with_beats(store, job_id, key, plain)
    return describe(plain, now=datetime.now(timezone.utc))


def _with_beats(store: Any, job_id: str, key: auth.JobKey, plain: dict[str, Any]) -> dict[str, Any]:
    """``plain`` with each node's own heartbeat key (``state_backend.beat``: a node's beats
    are not in the state), where one is signed with the job's secret."""
    from elastic_trainer.supervisor.rendezvous.state_backend import beat_key, parse_beat, with_beats

    beats = []
    for entry in plain["last_heartbeats"]:
        name = beat_key(job_id, entry)
        found = store.check([name]) and auth.verify_value(key, name, bytes(store.get(name)))
        beats.append(parse_beat(found or None))
    return with_beats(plain, beats)


def describe(plain: dict[str, Any] | None, *, now: datetime) -> dict[str, Any]:
    """Pure: a checked plain state (``state_codec.decode``) -> what ops want to see."""
    if plain is None:
        return {"round": 0, "complete": False, "closed": False, "nodes": [], "waiting": []}
    beats = {(e[0], e[1], e[2]): e[3] for e in plain["last_heartbeats"]}

    def node(entry: list[Any]) -> dict[str, Any]:
        micros = beats.get((entry[0], entry[1], entry[2]))
        beat = None if micros is None else _EPOCH + timedelta(microseconds=micros)
        age = round((now - beat).total_seconds(), 1) if beat is not None else None
        return {"addr": entry[0], "pid": entry[1], "heartbeat_age_s": age}

    members = sorted(plain["participants"], key=lambda e: (e[3], e[0], e[1], e[2]))
    return {
        "round": plain["round"],
        "complete": plain["complete"],
        "closed": plain["closed"],
        "nodes": [{**node(e), "group_rank": e[3]} for e in members],
        "waiting": [node(e) for e in sorted(plain["wait_list"])],
    }


def print_live_status(
    endpoint: str, job_id: str, timeout_s: float, *, key: auth.JobKey, as_json: bool
) -> int:
    state = read_state(endpoint, job_id, timeout_s, key)
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
