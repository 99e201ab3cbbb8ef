"""The rendezvous state as it is stored: canonical JSON with a schema, never pickle.

torch's c10d backend stored a pickle, which every reader unpickled: a value planted by anyone
who reached the store ran code in every agent. Here the state is plain data
(``torch_compat.state_to_plain``): a round, flags, a deadline and lists of nodes, each node
``[addr, pid, local_id]``. ``decode`` checks everything about it (size before parsing, types,
ranges, lengths) and raises ``ValueError`` for anything else, so what reaches torch's state
holder was built here from checked fields. The payload is signed by the store wrapper
(``signed_store``); ``fingerprint`` names the job key that wrote it, unsigned, only to tell a
node with another secret apart from damage.
"""

from __future__ import annotations

import json
from typing import Any

FORMAT = 1
# A node entry is ~60 bytes; four lists of 65,536 nodes stay below this.
MAX_STATE_BYTES = 16 * 2**20
MAX_NODES = 65_536
MAX_ADDR_CHARS = 255
MAX_INT = 2**63 - 1


def encode(plain: dict[str, Any] | None, *, fingerprint: str) -> bytes:
    """``plain`` (None: no state yet, written before the first round so the key exists)."""
    body = {"format": FORMAT, "key": fingerprint, **(plain if plain is not None else EMPTY)}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


EMPTY = {"empty": True}


def fingerprint_of(payload: bytes) -> str | None:
    """The key fingerprint a payload names, without trusting anything else in it (a value
    that fails its tag: a node with another secret, or forgery)."""
    if len(payload) > MAX_STATE_BYTES:
        return None
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    value = body.get("key") if isinstance(body, dict) else None
    return value if isinstance(value, str) and value.isalnum() and len(value) <= 64 else None


def decode(payload: bytes) -> dict[str, Any] | None:
    """The plain state in ``payload``; None for no state yet; ValueError for anything else."""
    if len(payload) > MAX_STATE_BYTES:
        raise ValueError(f"a rendezvous state of {len(payload)} bytes (at most {MAX_STATE_BYTES})")
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError("not a rendezvous state of format 1")
    if body.get("empty") is True:
        return None
    return {
        "round": _int(body, "round"),
        "complete": _bool(body, "complete"),
        "deadline": _optional_int(body, "deadline"),
        "closed": _bool(body, "closed"),
        "participants": _nodes(body, "participants", width=4),
        "wait_list": _nodes(body, "wait_list", width=3),
        "redundancy_list": _nodes(body, "redundancy_list", width=3),
        "last_heartbeats": _nodes(body, "last_heartbeats", width=4),
    }


def _in_range(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_INT


def _int(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if not _in_range(value):
        raise ValueError(f"{name}: not an integer in 0..2^63-1")
    return int(value)


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    return None if body.get(name) is None else _int(body, name)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if not isinstance(value, bool):
        raise ValueError(f"{name}: not true or false")
    return value


def _nodes(body: dict[str, Any], name: str, *, width: int) -> list[list[Any]]:
    return checked_nodes(body.get(name), width=width, name=name)


def checked_nodes(entries: Any, *, width: int, name: str = "nodes") -> list[list[Any]]:
    """``entries`` if they are ``[addr, pid, local_id]`` entries (``width`` 4: and a number,
    a rank or a time), no node twice; else ValueError naming ``name``."""
    if type(entries) is not list or len(entries) > MAX_NODES:
        raise ValueError(f"{name}: not a list of at most {MAX_NODES} nodes")
    seen = set()
    for entry in entries:
        # exact types (a bool is no int here), one pass: this runs at every heartbeat
        if type(entry) is not list or len(entry) != width:
            raise ValueError(f"{name}: an entry is not a list of {width}")
        addr, pid, local_id = entry[0], entry[1], entry[2]
        if type(addr) is not str or not 0 < len(addr) <= MAX_ADDR_CHARS or not addr.isprintable():
            raise ValueError(f"{name}: a node address is not printable text of 1..255 chars")
        if not (_in_range(pid) and _in_range(local_id) and (width == 3 or _in_range(entry[3]))):
            raise ValueError(f"{name}: a node's numbers are not integers in range")
        seen.add((addr, pid, local_id))
    if len(seen) != len(entries):
        raise ValueError(f"{name}: a node appears twice")
    return entries
