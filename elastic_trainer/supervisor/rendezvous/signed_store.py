"""The rendezvous store as our processes use it: every value signed, every read verified.

The c10d store has no authentication; on one machine every local user reaches its loopback
port. ``SignedStore`` wraps the connected store (a ``torch.distributed.Store`` subclass, so
torch's own code -- the agent's rank assignment, ``MASTER_ADDR``/``MASTER_PORT``, the exit
barrier -- goes through it too): ``set`` and ``compare_set`` write ``auth.sign_value``, ``get``
returns the payload only when its tag verifies under this job's key and the key it was read
from. A value that does not verify raises ``TamperedValue`` and is reported once per streak
(``store.tampered``); it is never acted on. Counters (``add``) stay plain integers: c10d adds
on the server, and a forged count can only make a barrier pass early or late.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic_trainer.contract import auth
from elastic_trainer.contract.events import emit

# One store.tampered event per key per this many seconds (a flood of forged values must
# not become a flood of lines); ``count`` says how many were refused meanwhile.
REPORT_EVERY_S = 10.0


class TamperedValue(RuntimeError):
    """A store value that is not signed with this job's key: never acted on. A RuntimeError,
    as c10d's own store errors are, so torch's callers treat it as store trouble."""


class TamperLog:
    """Counts refused values and reports them, rate-limited, one event per key and period."""

    def __init__(self, *, every_s: float = REPORT_EVERY_S) -> None:
        self._every_s = every_s
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self.total = 0

    def refused(self, key: str, reason: str) -> None:
        with self._lock:
            self.total += 1
            self._pending[key] = self._pending.get(key, 0) + 1
            now = time.monotonic()
            if now - self._last.get(key, -self._every_s) < self._every_s:
                return
            count = self._pending.pop(key)
            self._last[key] = now
        emit(
            "store.tampered",
            level="warning",
            key=printable_key(key),
            reason=reason,
            count=count,
            consequence="value ignored; whoever can reach the store port is writing to it",
        )


def printable_key(key: str, limit: int = 200) -> str:
    text = "".join(c if c.isprintable() else "?" for c in key[:limit])
    return text + ("..." if len(key) > limit else "")


class SignedStore(dist.Store):
    """``inner`` with every value signed under ``key``; ``raw`` is the unwrapped store."""

    def __init__(self, inner: Any, key: auth.JobKey, log: TamperLog | None = None) -> None:
        super().__init__()
        self.raw = inner
        self.key = key
        self.log = log if log is not None else TamperLog()

    def sign(self, store_key: str, payload: str | bytes) -> bytes:
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        return auth.sign_value(self.key, store_key, data)

    def verified(self, store_key: str, value: bytes) -> bytes:
        payload = auth.verify_value(self.key, store_key, bytes(value))
        if payload is None:
            self.log.refused(store_key, "bad_tag")
            raise TamperedValue(f"store key {printable_key(store_key)!r}: not signed by this job")
        return payload

    # ---- c10d Store ----------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, self.sign(key, value))

    def get(self, key: str) -> bytes:
        return self.verified(key, self.raw.get(key))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """c10d's compare-and-set on payloads: ``expected`` "" means "absent"."""
        signed_expected = self.sign(key, expected) if expected else b""
        found = self.raw.compare_set(key, signed_expected, self.sign(key, desired))
        return self.verified(key, found)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's payload in one round trip; ``TamperedValue`` if any does not verify."""
        return [self.verified(k, v) for k, v in zip(keys, self.raw.multi_get(keys), strict=True)]

    def get_each(self, keys: list[str]) -> list[bytes | None]:
        """``multi_get``, with None in place of a value that does not verify (refused and
        reported as ``get`` does): one forged value hides only its own key."""
        found: list[bytes | None] = []
        for key, value in zip(keys, self.raw.multi_get(keys), strict=True):
            try:
                found.append(self.verified(key, value))
            except TamperedValue:
                found.append(None)
        return found

    def get_each_if_all(self, keys: list[str]) -> list[bytes | None] | None:
        """``get_each`` once every key exists (one check, one read); None while any is
        missing (a get of a missing key would wait for it)."""
        return self.get_each(keys) if self.check(keys) else None

    def add(self, key: str, amount: int) -> int:
        return int(self.raw.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.raw.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.raw.wait(keys)
        else:
            self.raw.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.raw.delete_key(key))

    def num_keys(self) -> int:
        return int(self.raw.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.raw.set_timeout(timeout)


def signed(store: Any, key: auth.JobKey, log: TamperLog | None = None) -> Any:
    """``store`` signed under ``key`` (as it is, if it already is; None stays None)."""
    if store is None or isinstance(store, SignedStore):
        return store
    return SignedStore(store, key, log)
