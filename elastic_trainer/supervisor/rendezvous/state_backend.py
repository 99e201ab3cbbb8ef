"""torch's dynamic rendezvous on a signed JSON state (``RendezvousBackend``, torch's public
seam for where a rendezvous keeps its state).

torch's state holder hands a backend a pickle of its state and unpickles whatever the backend
returns. This backend never stores that pickle: it turns the state into plain data, stores
it as signed JSON (``state_codec``, ``auth``) under torch's key, and on every read verifies
the tag, checks the schema and builds the state anew from the checked fields; only that state,
made here, is pickled back for the holder.

A value that does not verify is never used (``store.tampered``). A member that has read a
good state before puts it back (the next write compare-and-sets against the bad value, so it
replaces it); a node that never saw one starts from an empty state, unless the value is a
state signed with another secret (same schema, another key fingerprint): that is a node of
this job given a different secret, and ``ForeignSecret`` says so instead of fighting over
the key.

Heartbeats are not written into the state: each node sets its own signed key (``beat``) and
every read of the state takes the newer of the state's time and the key's for each node
(``with_beats``), so torch's expiry sees them as before. In torch's state every heartbeat
rewrote the whole state (O(N) bytes) by compare-and-set on one key that every node wrote twice
a second: the store's work grew with N², and under load the writes collided until live nodes
missed their expiry and were dropped. Now the state changes only when the membership does.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import pickle
import random
import time
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic_trainer.contract import auth
from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.rendezvous import state_codec
from elastic_trainer.supervisor.rendezvous.signed_store import SignedStore, TamperedValue


class ForeignSecret(ConfigError):
    """The job's rendezvous state is signed with another secret than this node's."""


class SignedStateBackend(RendezvousBackend):
    """The rendezvous state of ``run_id`` in ``store``, signed with the store's job key."""

    def __init__(self, store: SignedStore, run_id: str) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store = store
        self._key = torch_compat.rendezvous_key(run_id)
        self._run_id = run_id
        self._version_key = f"{self._key}/version"
        self._empty = store.sign(self._key, state_codec.encode(None, fingerprint=self._fp))
        self._last_good: bytes | None = None  # the last verified state, pickled for the holder
        self._last_raw = b""  # ... and the stored value it came from: read again, not decoded
        self._last_plain: dict[str, Any] | None = None  # ... and that value decoded
        # the heartbeat keys as last read with a state (key -> time) and when: a state read
        # again within beats_reuse_s takes them, not another N-key read. A reused time is
        # older than the key's, never newer, so a node can only look staler by that much.
        self.beats_reuse_s = 0.0  # handler_on: a quarter of the keep-alive interval
        self._beats_read: dict[str, int | None] = {}
        self._beats_read_at = -math.inf
        # another node's entry younger than this needs no read of its key: a live node
        # beats once per this (half a keep-alive interval), so its key's time could be no
        # fresher than such an entry by more than a tick, and torch's expiry (several
        # intervals, counted on a state its holder may keep a second before acting) keeps
        # the same margin as with the key's time. A round just opened stamps its members:
        # those reading it at once read no key. This node's own entry takes the time of its
        # last beat, known here (torch rewrites the whole state for its own node's beat one
        # interval after the time it finds there).
        self.beats_fresh_s = 0.0  # handler_on: half the keep-alive interval
        self._own_beats: dict[tuple[Any, ...], int] = {}  # [addr, pid, local_id] -> time
        # the last state pickled for the holder: (the stored value's plain data, the times
        # merged into it, the pickle), returned again while both are the same
        self._built: tuple[dict[str, Any], list[Any], bytes] | None = None
        # as torch's backend: the key exists from now on (a write without a token expects it)
        self._call("compare_set", self._key, "", self._empty)

    @property
    def name(self) -> str:
        return "elastic-train"

    def get_state(self) -> tuple[bytes, Any] | None:
        # compare-and-set against "absent": the value, or the empty state written now. A
        # plain get would block until the key exists (deleted by someone, or not made yet).
        raw = self._call("compare_set", self._key, "", self._empty)
        return self._state_of(raw)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        # the holder's own pickle of its own state, made in this process a moment ago
        plain = torch_compat.state_to_plain(pickle.loads(state))
        value = self._store.sign(self._key, state_codec.encode(plain, fingerprint=self._fp))
        expected = token if isinstance(token, bytes) else self._empty
        raw = bytes(self._call("compare_set", self._key, expected, value))
        if raw == value:  # ours is stored: it is the holder's own state, nothing to decode
            self._last_good, self._last_raw, self._last_plain = state, raw, plain
            mark = f"{plain['round']}.{int(plain['complete'])}.{_digest(raw)}"
            self._store.set(self._version_key, mark)
            return state, raw, True
        found = self._state_of(raw)
        self._back_off()
        if found is None:
            return None
        bits, new_token = found
        return bits, new_token, False

    def _back_off(self) -> None:
        """After a write lost to another node's: a random pause before the holder retries,
        spread over more time the more nodes there are. Without it every loser retried at
        once against the same others (N nodes writing at one moment: O(N²) attempts, each
        a read and a write of the whole state, which at 32 nodes on one machine took
        seconds of CPU)."""
        nodes = len(self._last_plain["last_heartbeats"]) if self._last_plain else 1
        time.sleep(random.uniform(0.0, min(MAX_BACKOFF_S, BACKOFF_S_PER_NODE * nodes)))

    def version(self) -> str | None:
        """A mark of the state's last write (a digest its writer sets, signed): a node that
        waits for a change reads this, not the whole state. None when there is none yet or
        it is not ours: the caller reads the state then. Not a c10d counter (``add``): the
        store's server drops the connection of whoever adds to a value that is not a
        number, so anyone who can reach the store could have cut every waiting node off."""
        if not self._call("check", [self._version_key]):
            return None
        try:
            return self._store.get(self._version_key).decode("ascii", errors="replace")
        except TamperedValue:
            return None

    def unchanged(self) -> bool:
        """Is the stored state still the value this backend last read or wrote? Two small
        reads (the version mark names the digest of the value its writer stored), not the
        whole state. False when unsure (none read yet, no mark, a mark not ours). A mark is
        set just after its state, so a write may show here a moment late; a writer that died
        between the two leaves a change shown only by the next write or a full read."""
        if self._last_plain is None or not self._last_raw:
            return False
        mark = self.version()
        return mark is not None and mark.rpartition(".")[2] == _digest(self._last_raw)

    @staticmethod
    def round_of(version: str) -> tuple[int, bool] | None:
        """The round and completion a ``version`` mark names (``round.complete.digest``):
        a waiter that waits only for the round to move on or close reads these, not the
        state, at each write (another node let in); None for a mark that names none."""
        round_, complete, _ = [*version.split("."), "", ""][:3]
        if not round_.isdigit() or len(round_) > 19 or complete not in ("0", "1"):
            return None
        return int(round_), complete == "1"

    def beat(self, node: Any, at_us: int) -> None:
        """``node``'s heartbeat at ``at_us`` (microseconds since the epoch): its own key."""
        entry = node_entry(node)
        self._store.set(beat_key(self._run_id, entry), str(at_us))
        self._own_beats[tuple(entry)] = at_us

    def beats(self, nodes: list[Any]) -> dict[Any, int | None]:
        """Each of ``nodes``' own heartbeat time (µs since the epoch; None: no key, or a bad
        one), whether or not it is in the state."""
        keys = [beat_key(self._run_id, node_entry(n)) for n in nodes]
        return dict(zip(nodes, self._read_beats(keys), strict=True))

    def _with_beats(self, plain: dict[str, Any]) -> dict[str, Any]:
        """``plain`` with this node's last beat, and the other nodes' own heartbeat keys
        where the state's time is older than ``beats_fresh_s``, merged in."""
        entries = plain["last_heartbeats"]
        every = [self._own_beats.get(tuple(e[:3])) for e in entries]  # None: the entry's own
        now_us = time.time_ns() // 1000
        due = [
            i
            for i in due_beats(entries, now_us=now_us, fresh_us=self._fresh_us)
            if every[i] is None
        ]
        if due:
            keys = [beat_key(self._run_id, entries[i]) for i in due]
            reused = self._beats_read
            if time.monotonic() - self._beats_read_at < self.beats_reuse_s and reused.keys() >= set(
                keys
            ):
                beats = [reused[k] for k in keys]
            else:
                beats = self._read_beats(keys)
                self._beats_read, self._beats_read_at = (
                    dict(zip(keys, beats, strict=True)),
                    time.monotonic(),
                )
            for i, beat in zip(due, beats, strict=True):
                every[i] = beat
        return with_beats(plain, every)

    @property
    def _fresh_us(self) -> int:
        return int(self.beats_fresh_s * 1_000_000)

    def _read_beats(self, keys: list[str]) -> list[int | None]:
        """The heartbeats at ``keys``: two store operations when every key exists (a get of
        a missing key would wait for it), else a check and a get per key."""
        if not self._call("check", keys):  # one not beaten yet (just joined, a new store)
            return [self._beat(k) if self._call("check", [k]) else None for k in keys]
        values = self._call("multi_get", keys)
        return [self._verified_beat(k, v) for k, v in zip(keys, values, strict=True)]

    def _beat(self, key: str) -> int | None:
        return self._verified_beat(key, self._call("get", key))

    def _verified_beat(self, key: str, raw: bytes) -> int | None:
        payload = auth.verify_value(self._store.key, key, bytes(raw))
        if payload is None:
            self._store.log.refused(key, "bad_tag")
        return parse_beat(payload)

    def peek(self) -> Any:
        """The stored state as torch's class (None: none yet), verified, without touching the
        holder; raises ``TamperedValue`` or ``ValueError`` for a value that is not one."""
        payload = self._store.get(self._key)
        plain = state_codec.decode(payload)
        return None if plain is None else torch_compat.state_from_plain(plain)

    @property
    def _fp(self) -> str:
        return self._store.key.fingerprint

    def _state_of(self, raw: bytes) -> tuple[bytes, Any] | None:
        """(pickled state for the holder, token = the raw value) or None for no state yet."""
        raw = bytes(raw)
        if raw == self._last_raw and self._last_plain is not None:  # unchanged: not decoded
            return self._fresh(self._last_plain), raw
        payload = auth.verify_value(self._store.key, self._key, raw)
        if payload is not None:
            try:
                plain = state_codec.decode(payload)
            except ValueError:
                plain, payload = None, None  # signed by us but not a state: a bug, not trust
                self._store.log.refused(self._key, "malformed")
            else:
                if plain is None:
                    return None
                self._last_plain, self._last_raw = plain, raw
                return self._fresh(plain), raw
        else:
            self._refuse(raw)
            self._put_back(raw)
        # not usable: the last good state (or an empty one) with the bad value as the token,
        # so the holder's next write replaces it; with the nodes' heartbeats as they are now
        # (they live in their own keys): a plant must not make every member look silent
        if self._last_plain is not None:
            return self._fresh(self._last_plain), raw
        return self._last_good or pickle.dumps(torch_compat.state_from_plain(_EMPTY_PLAIN)), raw

    def _fresh(self, plain: dict[str, Any]) -> bytes:
        """``plain`` with the nodes' own heartbeats, pickled for the holder (and kept as the
        last good state). A state read again unchanged, with the same times merged in, is
        not built and pickled again."""
        merged = self._with_beats(plain)
        beats = merged["last_heartbeats"]
        if self._built is not None and self._built[0] is plain and self._built[1] == beats:
            self._last_good = self._built[2]
            return self._last_good
        self._last_good = pickle.dumps(torch_compat.state_from_plain(merged))
        self._built = (plain, beats, self._last_good)
        return self._last_good

    def _put_back(self, planted: bytes) -> None:
        """The last good value in place of one the job did not write, if that is still there
        (compare-and-set): the holder writes only when the membership changes, and a node
        that joins meanwhile must not find the plant."""
        if self._last_raw is not None:
            with contextlib.suppress(RendezvousConnectionError):
                self._call("compare_set", self._key, planted, self._last_raw)

    def _refuse(self, raw: bytes) -> None:
        body = raw.partition(b".")[2].partition(b".")[2] if raw.startswith(auth.MAGIC) else b""
        theirs = state_codec.fingerprint_of(body) if body else None
        if theirs is not None and theirs != self._fp and self._last_good is None:
            self._store.log.refused(self._key, "foreign_key")
            raise ForeignSecret(
                f"the job's rendezvous state is signed with another secret (key {theirs}; this "
                f"node's: {self._fp}): give every node the same --rdzv-secret-file "
                "(docs/security.md)"
            )
        self._store.log.refused(self._key, "bad_tag")

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store.raw, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(
                "The connection to the C10d store has failed. See inner exception for details."
            ) from exc


def _digest(raw: bytes) -> str:
    """What a version mark says of the stored value it marks."""
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


_EMPTY_PLAIN: dict[str, Any] = {
    "round": 0,
    "complete": False,
    "deadline": None,
    "closed": False,
    "participants": [],
    "wait_list": [],
    "redundancy_list": [],
    "last_heartbeats": [],
}


# After a lost write: a pause drawn from [0, min(MAX_BACKOFF_S, BACKOFF_S_PER_NODE x nodes in
# the state)]. 2 ms is about what one attempt costs an agent on a loaded machine (encode,
# sign, send and read back the state; decode the one that won), so N colliding writers are
# spread over about N attempts' time.
BACKOFF_S_PER_NODE = 0.002
MAX_BACKOFF_S = 0.25

MAX_BEAT_CHARS = 20  # digits of microseconds since the epoch (2^63 has 19)


def beat_key(run_id: str, node: Sequence[Any]) -> str:
    """Where node ``[addr, pid, local_id, ...]`` of ``run_id`` keeps its heartbeat."""
    return f"elastic-train/{run_id}/heartbeat/{node[0]}/{node[1]}/{node[2]}"


def node_entry(node: Any) -> list[Any]:
    return [node.addr, node.pid, node.local_id]


def parse_beat(payload: bytes | None) -> int | None:
    """A heartbeat key's time (microseconds since the epoch); None for none or a bad one."""
    if payload is None or not 0 < len(payload) <= MAX_BEAT_CHARS or not payload.isdigit():
        return None
    value = int(payload)
    return value if value <= state_codec.MAX_INT else None


EXPIRED = 0  # a heartbeat at the epoch: the node was expired on purpose (known dead)


def due_beats(entries: list[list[Any]], *, now_us: int, fresh_us: int) -> list[int]:
    """The indexes of ``entries`` (``[addr, pid, local_id, time]``) whose time is at least
    ``fresh_us`` old at ``now_us``: those whose node's own key is read. An entry expired on
    purpose (``EXPIRED``) stays so, and is not read."""
    return [i for i, e in enumerate(entries) if e[3] != EXPIRED and now_us - e[3] >= fresh_us]


def with_beats(plain: dict[str, Any], beats: list[int | None]) -> dict[str, Any]:
    """``plain`` with each ``last_heartbeats`` entry at the newer of its own time and the
    node's key's (``beats``, in the entries' order; None: no key, or a bad one). An entry
    at the epoch stays there: a node known dead is expired so (``torch_compat.expire_nodes``),
    while its key still holds its last beat."""
    merged = [
        [*e[:3], e[3] if b is None or b <= e[3] or e[3] == EXPIRED else b]
        for e, b in zip(plain["last_heartbeats"], beats, strict=True)
    ]
    return {**plain, "last_heartbeats": merged}
