"""Where the job's rendezvous store is after a failover: a record in the snapshot folder.

A failed-over store serves on its new host's own address (``failover.py``). Nodes started
later are given the job's original ``--rdzv-endpoint``; on separate machines nothing answers
there any more, or worse, a node restarted on the old store host's machine would host a fresh
store of its own there: a second job writing the same snapshot folder. The new host therefore
writes ``rendezvous-store.json`` (the job, the endpoint, the store's lineage token) into the
snapshot folder, which every node of the job already shares and trusts; an agent starting
with that folder reads it first and joins the store it names -- only if a store answers there
with that lineage (a stale record, from a job that ended, is ignored). Without a snapshot
folder nothing is recorded and a later node needs the new endpoint (``store.moved`` names it).

JSON only, bounded in size, never unpickled, and signed with the job's secret
(``contract.auth``): a record that does not verify, or names an endpoint where something
other than a c10d store answers, is ignored with ``store.record_ignored`` and the node uses
its configured endpoint.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.contract.endpoint import split_address
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ConfigError, first_line

RECORD_NAME = "rendezvous-store.json"
MAX_RECORD_BYTES = 4096


@dataclass(frozen=True, kw_only=True)
class StoreRecord:
    job_id: str
    endpoint: str  # host:port ([v6]:port)
    lineage: str


def _tag(key: JobKey, body: dict[str, Any]) -> str:
    return key.tag(b"store-record", json.dumps(body, sort_keys=True).encode()).hex()


def encode(record: StoreRecord, key: JobKey) -> bytes:
    body = {"format": 1, "job_id": record.job_id, "endpoint": record.endpoint,
            "lineage": record.lineage}  # fmt: skip
    return json.dumps({**body, "tag": _tag(key, body)}, sort_keys=True).encode()


def decode(data: bytes, key: JobKey) -> StoreRecord | None:
    """The record, or None when it is not one of this job's (damage, or not signed with its
    secret: no reason to stop a node, only not to follow it)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("tag"), str):
        return None
    tag = body.pop("tag")
    if not hmac.compare_digest(tag.encode(), _tag(key, body).encode()):
        return None
    fields = [body.get(k) for k in ("job_id", "endpoint", "lineage")]
    if not all(isinstance(f, str) and f for f in fields):
        return None
    job_id, endpoint, lineage = fields
    return StoreRecord(job_id=job_id, endpoint=endpoint, lineage=lineage)


def write(snapshot_dir: str | None, record: StoreRecord, key: JobKey) -> None:
    """Best effort: a folder that cannot take it costs only a later node's way in."""
    if not snapshot_dir:
        return
    from snapshots.storage import open_storage

    try:
        open_storage(snapshot_dir).write(RECORD_NAME, encode(record, key))
    except Exception as exc:
        emit(
            "store.record_failed",
            level="warning",
            error=first_line(str(exc)) or type(exc).__name__,
            consequence="a node started later needs --rdzv-endpoint " + record.endpoint,
        )


def read(snapshot_dir: str | None, job_id: str, key: JobKey) -> StoreRecord | None:
    """This job's record in the folder, if any (one that does not verify: ignored, said)."""
    if not snapshot_dir:
        return None
    from snapshots.storage import open_storage

    try:
        data = open_storage(snapshot_dir).read(RECORD_NAME, limit=MAX_RECORD_BYTES)
    except Exception:  # no record, or storage down: the endpoint as given
        return None
    record = decode(data, key)
    if record is None:
        _ignored("not_signed", "the record is damaged or not signed with the job's secret")
        return None
    return record if record.job_id == job_id else None


def _ignored(reason: str, why: str, endpoint: str | None = None) -> None:
    emit(
        "store.record_ignored",
        level="warning",
        reason=reason,
        endpoint=endpoint,
        why=why,
        consequence="this node uses its --rdzv-endpoint",
    )


def lineage_of(store: Any, job_id: str) -> str | None:
    from elastic_trainer.supervisor.rendezvous.handler import lineage_key

    key = lineage_key(job_id)
    with contextlib.suppress(Exception):
        return store.get(key).decode() if store.check([key]) else None
    return None


def find(
    snapshot_dir: str | None,
    job_id: str,
    *,
    key: JobKey,
    configured: str,
    connect: Any,
) -> tuple[Any, str] | None:
    """(the connected store, its endpoint) when the folder records that this job's store moved
    away from ``configured`` and it answers there with the recorded lineage; None otherwise.
    ``connect(host, port)``: a connected store, or None when nothing answers."""

    record = read(snapshot_dir, job_id, key)
    if record is None or record.endpoint == configured:
        return None
    try:
        host, port = split_address(record.endpoint)
    except ValueError:
        _ignored("malformed", "its endpoint is not HOST:PORT")
        return None
    try:
        store = connect(host, port)
    except ConfigError as exc:  # something else answers there: not a reason to stop
        _ignored("not_a_store", first_line(str(exc)), record.endpoint)
        return None
    if store is None or lineage_of(store, job_id) != record.lineage:
        return None  # the job that wrote it ended: the usual case, nothing to say
    return store, record.endpoint
