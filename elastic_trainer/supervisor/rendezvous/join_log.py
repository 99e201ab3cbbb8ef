"""Nodes asking to join an open round, each by one append to the round's log.

torch's join is a compare-and-set of the one rendezvous state: every node adds itself to the
participants and writes the whole state back. When N nodes arrive at once (a job's start: all
its agents within seconds) they are N writers of an O(N) value on one key: each write that
wins makes every other attempt lose, each loser reads the winner's state and tries again, and
every waiter re-reads the state after each win. At 128 agents on one machine the first round
never closed. Here a node that finds a round already open appends one signed line to that
round's log (``store.append``: the store serialises appends, nothing is lost, nobody
retries), and the round's opener (its first participant in node order, or the one that has
been letting nodes in: ``handler``) adds every logged node to the state in one write
(``torch_compat.add_participants``).

A line is ``\\n`` + the node ``[addr, pid, local_id]`` signed under the log's key + ``\\n``:
bytes someone else appended (the store has no authentication) break at most their own line,
and a line that does not verify, or a node entry that is not one, is skipped. A log longer
than a round could hold yields no node (and the opener reads it no more that round); the
nodes in it fall back to torch's own join (``handler``: a node not let in within its
patience adds itself).
"""

from __future__ import annotations

import json
from typing import Any

from elastic_trainer.contract import auth
from elastic_trainer.supervisor.rendezvous import state_codec

# A signed line: the tag and magic (69 bytes), a node entry (an address of up to 255
# characters, two integers) and the newlines; a log holds a few lines per node at most (a
# node appends once per round it waits in).
MAX_LINE_BYTES = len(auth.MAGIC) + auth.TAG_HEX + 1 + state_codec.MAX_ADDR_CHARS + 64
LINES_PER_NODE = 4


def log_key(run_id: str, round_: int) -> str:
    """Where nodes ask to join round ``round_`` of ``run_id``."""
    return f"elastic-train/{run_id}/joins/{round_}"


def line(key: auth.JobKey, store_key: str, node: list[Any]) -> bytes:
    """What node ``[addr, pid, local_id]`` appends to the log at ``store_key``."""
    payload = json.dumps(node, separators=(",", ":")).encode()
    return b"\n" + auth.sign_value(key, store_key, payload) + b"\n"


def max_log_bytes(max_nodes: int) -> int:
    return max_nodes * LINES_PER_NODE * MAX_LINE_BYTES


def parse(
    key: auth.JobKey, store_key: str, raw: bytes, *, max_nodes: int
) -> tuple[list[list[Any]], int]:
    """The nodes logged in ``raw`` (in the order they first appear, each once) and how many
    lines were refused (not signed under ``store_key``, or not a node entry). A log longer
    than ``max_log_bytes`` yields no node and one refusal."""
    if len(raw) > max_log_bytes(max_nodes):
        return [], 1
    nodes: list[list[Any]] = []
    seen: set[tuple[Any, ...]] = set()
    refused = 0
    for text in raw.split(b"\n"):
        if not text:
            continue
        node = _node(auth.verify_value(key, store_key, text))
        if node is None:
            refused += 1
        elif (found := (node[0], node[1], node[2])) not in seen:
            seen.add(found)
            nodes.append(node)
    return nodes, refused


def _node(payload: bytes | None) -> list[Any] | None:
    if payload is None:
        return None
    try:
        entry = json.loads(payload)
        return state_codec.checked_nodes([entry], width=3)[0]
    except (ValueError, RecursionError):
        return None
