"""The presence handshake's messages (``presence.py``): only an answer made with the job's
key, to this connection's nonce, names a member."""

from __future__ import annotations

import pytest

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor.rendezvous import presence

KEY = JobKey(b"presence test key, fixed: xdist ids")
NONCE = bytes(range(presence.NONCE_BYTES))


def test_a_challenge_is_read_back_and_is_of_its_fixed_length() -> None:
    sent = presence.challenge(NONCE)
    assert len(sent) == presence.CHALLENGE_LEN
    assert presence.read_challenge(sent) == NONCE


@pytest.mark.parametrize(
    "data",
    [b"presence/1\n", presence.challenge(NONCE)[:-1] + b" ", b"presence/2 " + b"zz" * 16 + b"\n"],
)
def test_anything_else_is_not_a_challenge(data) -> None:
    assert presence.read_challenge(data) is None


def test_an_answer_with_the_key_names_its_member() -> None:
    line = presence.hello(KEY, NONCE, "10.0.0.1:42/1")
    assert presence.check_hello(KEY, NONCE, line) == "10.0.0.1:42/1"


def test_an_answer_with_another_key_or_to_another_nonce_names_no_one() -> None:
    assert presence.check_hello(KEY, NONCE, presence.hello(JobKey.generate(), NONCE, "a")) is None
    other_nonce = bytes(presence.NONCE_BYTES)
    assert presence.check_hello(KEY, NONCE, presence.hello(KEY, other_nonce, "a")) is None


def test_a_member_name_cannot_be_swapped_under_a_valid_tag() -> None:
    line = presence.hello(KEY, NONCE, "a")
    assert presence.check_hello(KEY, NONCE, line.replace(b" a ", b" b ")) is None


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"GET / HTTP/1.0\r\n\r\n",
        b"presence/1\n",
        presence.hello(KEY, NONCE, "a")[:-1],  # no end of line yet
        presence.hello(KEY, NONCE, "a") + b"more",
        presence.hello(KEY, NONCE, "a").replace(b"presence/2", b"presence/3"),
        b"presence/2  " + KEY.tag(b"x").hex().encode() + b"\n",  # no member
        b"presence/2 \xff " + KEY.tag(b"x").hex().encode() + b"\n",
        presence.hello(KEY, NONCE, "a" * (presence.MAX_MEMBER + 1)),
    ],
)
def test_a_malformed_or_oversized_answer_names_no_one(line) -> None:
    assert presence.check_hello(KEY, NONCE, line) is None


def test_the_longest_name_fits_an_answer() -> None:
    line = presence.hello(KEY, NONCE, "a" * presence.MAX_MEMBER)
    assert len(line) == presence.MAX_HELLO
    assert presence.check_hello(KEY, NONCE, line) == "a" * presence.MAX_MEMBER
