"""The job's secret and what it signs: store values and presence handshakes.

Anyone who can reach the rendezvous store (on one machine: every local user) can read and
write its keys. Every value our processes write there, and every presence handshake, carries
an HMAC-SHA256 tag under the job's secret (``JobKey``), bound to the store key it was written
under (a value cannot be moved to another key) and to the job id. A value whose tag does not
verify is never acted on. Where the secret comes from: ``supervisor/rendezvous/secret.py``.

Tags find forgery, not replay: a value once written by the job may be written again by
anyone who read it (the store holds no secrets). What a replay can do is bounded by what the
value says (an old heartbeat, an old member list): availability, never code or membership.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os

KEY_BYTES = 32
# Store values: MAGIC, the tag's hex, a dot, then the payload. Hex keeps every value text
# (torch's own readers of a few keys decode them as UTF-8).
MAGIC = b"et1."
TAG_HEX = 64  # SHA-256, in hex


@dataclasses.dataclass(frozen=True, repr=False)
class JobKey:
    """A job's secret (never printed: ``repr`` names only its fingerprint)."""

    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("a job secret needs at least 16 bytes")

    @staticmethod
    def generate() -> JobKey:
        return JobKey(os.urandom(KEY_BYTES))

    def __repr__(self) -> str:
        return f"JobKey(fingerprint={self.fingerprint})"

    @property
    def fingerprint(self) -> str:
        """Short, public: tells two keys apart in events without revealing either."""
        return hashlib.sha256(b"elastic-train fingerprint\0" + self.secret).hexdigest()[:12]

    def tag(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 over ``parts``, each length-prefixed (no two splits collide)."""
        mac = hmac.new(self.secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()


def sign_value(key: JobKey, store_key: str, payload: bytes) -> bytes:
    """``payload`` as it is written under ``store_key``: MAGIC + tag + ``.`` + payload."""
    tag = key.tag(b"store", store_key.encode(), payload).hex().encode()
    return MAGIC + tag + b"." + payload


def verify_value(key: JobKey, store_key: str, value: bytes) -> bytes | None:
    """The payload of ``value`` if it was signed under ``store_key`` with ``key``; else None."""
    head = len(MAGIC) + TAG_HEX
    if len(value) < head + 1 or not value.startswith(MAGIC) or value[head : head + 1] != b".":
        return None
    payload = value[head + 1 :]
    expected = key.tag(b"store", store_key.encode(), payload).hex().encode()
    return payload if hmac.compare_digest(expected, value[len(MAGIC) : head]) else None


def unverified_payload(value: bytes) -> bytes | None:
    """The payload of a signed value, without its tag checked: for a reader without the key
    that only compares it with what it already knows (never acts on it otherwise)."""
    head = len(MAGIC) + TAG_HEX
    if len(value) < head + 1 or not value.startswith(MAGIC) or value[head : head + 1] != b".":
        return None
    return value[head + 1 :]


def handshake_tag(key: JobKey, nonce: bytes, member: str) -> bytes:
    """A presence client's answer to the server's ``nonce``: it holds the key, as ``member``."""
    return key.tag(b"presence", nonce, member.encode())
