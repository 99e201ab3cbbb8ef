"""``elastic-train status --rdzv-endpoint``: a live store, read without joining or writing,
and nothing from it trusted unless signed with the job's secret and of the state's shape."""

from __future__ import annotations

import json
import os
import pickle
import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

from elastic_trainer.contract import auth
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.rendezvous import state_codec
from elastic_trainer.supervisor.rendezvous.handler import handler_on
from elastic_trainer.tools.live_status import describe
from elastic_trainer.tools.status import main

KEY_NAME = torch_compat.rendezvous_key("job-1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def store():
    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    yield server, port


@pytest.fixture
def secret(tmp_path: Path) -> tuple[auth.JobKey, str]:
    """The job's secret in a file, as ``--rdzv-secret-file`` takes it."""
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(16).hex().encode())
    path.chmod(0o600)
    return auth.JobKey(path.read_bytes()), str(path)


def _put(server: TCPStore, value: bytes) -> None:
    """Store ``value`` at the state's key before the status tool reads it: c10d's set has no
    reply, and a 2 MB value was still on its way when the tool's own connection looked."""
    server.set(KEY_NAME, value)
    assert server.check([KEY_NAME])  # answered after the set: it is in the store


def _status(port: int, secret_file: str, *extra: str) -> int:
    argv = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--job-id", "job-1"]
    return main([*argv, "--rdzv-secret-file", secret_file, *extra])


def test_a_formed_round_is_shown_with_its_nodes(store, secret, capsys) -> None:
    server, port = store
    key, path = secret
    handler = handler_on(
        server,
        key,
        "job-1",
        1,
        1,
        "127.0.0.1",
        RendezvousTimeout(last_call=timedelta(seconds=1)),
        keep_alive_interval=5,
        keep_alive_max_attempt=3,
    )
    handler.next_rendezvous()
    try:
        assert _status(port, path, "--json") == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["round"], shown["complete"], shown["closed"]) == (0, True, False)
        (node,) = shown["nodes"]
        assert (node["addr"], node["group_rank"]) == ("127.0.0.1", 0)
        assert node["heartbeat_age_s"] is not None and node["heartbeat_age_s"] >= 0
    finally:
        handler.shutdown()


def test_an_unknown_job_is_one_line_and_writes_nothing(store, secret, capsys) -> None:
    server, port = store
    argv = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--job-id", "nope"]
    assert main([*argv, "--rdzv-secret-file", secret[1]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elastic-train: error: ") and "no rendezvous for job 'nope'" in err
    assert not server.check([torch_compat.rendezvous_key("nope")])  # read-only: no key made


def test_a_refused_endpoint_is_one_line(secret, capsys) -> None:
    assert _status(_free_port(), secret[1], "--timeout", "1") == 2
    assert capsys.readouterr().err.startswith("elastic-train: error: ")


def test_run_or_endpoint_not_both(tmp_path, capsys) -> None:
    assert main([]) == 2
    assert "give a RUN" in capsys.readouterr().err


class _RunsCode:
    """What an attacker plants: a pickle whose loading runs a command."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.path}",))


def _one_line_error(capsys) -> str:  # type: ignore[no-untyped-def]
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("elastic-train: error: ")
    assert "\x1b" not in captured.out + captured.err and "\x07" not in captured.out + captured.err
    return captured.err


def test_a_planted_pickle_runs_nothing_and_is_one_line(store, secret, tmp_path, capsys) -> None:
    """torch's c10d backend stored a pickle that every reader unpickled: this value ran
    ``touch`` in whoever read it."""
    server, port = store
    ran = tmp_path / "ran"
    _put(server, pickle.dumps(_RunsCode(ran)))
    assert _status(port, secret[1]) == 2
    assert "not signed with the job's secret" in _one_line_error(capsys)
    assert not ran.exists()


def test_a_state_signed_with_another_secret_is_refused(store, secret, capsys) -> None:
    server, port = store
    forged = state_codec.encode(None, fingerprint="x")
    _put(server, auth.sign_value(auth.JobKey.generate(), KEY_NAME, forged))
    assert _status(port, secret[1]) == 2
    assert f"(key {secret[0].fingerprint})" in _one_line_error(capsys)


def _plain(**fields: object) -> dict[str, object]:
    """A formed one-node round, with ``fields`` put over it."""
    beat = (datetime.now(timezone.utc) - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(
        microseconds=1
    )
    base: dict[str, object] = {
        "round": 3,
        "complete": True,
        "deadline": None,
        "closed": False,
        "participants": [["10.0.0.1", 4242, 0, 0]],
        "wait_list": [],
        "redundancy_list": [],
        "last_heartbeats": [["10.0.0.1", 4242, 0, beat]],
    }
    return {**base, **fields}


def _sign(key: auth.JobKey, payload: bytes) -> bytes:
    return auth.sign_value(key, KEY_NAME, payload)


def test_a_well_formed_signed_state_is_shown(store, secret, capsys) -> None:
    server, port = store
    key, path = secret
    _put(server, _sign(key, state_codec.encode(_plain(), fingerprint=key.fingerprint)))
    assert _status(port, path, "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    (node,) = shown["nodes"]
    assert (shown["round"], node["addr"], node["pid"], node["group_rank"]) == (
        3,
        "10.0.0.1",
        4242,
        0,
    )


DEEP = b'{"format":1,"round":' + b"[" * 10**6 + b"]" * 10**6 + b"}"
ESCAPE = "\x1b]0;pwned\x07"  # a terminal-title escape


def _encoded(**fields: object) -> bytes:
    return state_codec.encode(_plain(**fields), fingerprint="k")


SHAPES = {
    "deep": (DEEP, "not JSON"),  # a segfault before (exit 139)
    "5000-digits": (b'{"format":1,"round":' + b"9" * 5000 + b"}", "not JSON"),  # a traceback
    "huge-int": (_encoded(round=10**30), "round"),
    "str-round": (_encoded(round="3"), "round"),
    "escape-addr": (_encoded(participants=[[ESCAPE, 1, 0, 0]]), "printable"),
    "dict-participants": (_encoded(participants={"a": 0}), "participants"),
    "short-node": (_encoded(wait_list=[["a", 1]]), "wait_list"),
    "not-a-state": (b"[]", "format 1"),
}


@pytest.mark.parametrize(("payload", "named"), list(SHAPES.values()), ids=list(SHAPES))
def test_a_signed_value_of_another_shape_is_one_line(store, secret, capsys, payload, named) -> None:
    """Even signed (a bug or another version of ours), only the state's schema gets through."""
    server, port = store
    key, path = secret
    _put(server, _sign(key, payload))
    assert _status(port, path) == 2
    assert named in _one_line_error(capsys)


def test_describe_orders_nodes_by_rank_and_ages_heartbeats() -> None:
    now = datetime(2024, 1, 1, 0, 0, 10, tzinfo=timezone.utc)
    ten_s_before = (now - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(
        microseconds=1
    ) - 10_000_000
    plain = state_codec.decode(
        state_codec.encode(
            _plain(
                participants=[["b", 2, 0, 1], ["a", 1, 0, 0]],
                last_heartbeats=[["a", 1, 0, ten_s_before]],
            ),
            fingerprint="k",
        )
    )
    shown = describe(plain, now=now)
    assert [(n["addr"], n["group_rank"], n["heartbeat_age_s"]) for n in shown["nodes"]] == [
        ("a", 0, 10.0),
        ("b", 1, None),
    ]


def test_another_users_crafted_values_never_reach_the_terminal(store, secret, capsys) -> None:
    """As ``nobody``, through the store's port: a 10^6-deep value, a huge integer and a
    terminal escape under the job's key; ``status`` says one line each, exit 2."""
    from tests import c10d_wire
    from tests.local_users import as_user, other_user

    _, port = store
    user = other_user()
    made_there = (  # built by the attacker's own Python (too long for a command line)
        "b'{\"format\":1,\"round\":' + b'[' * 10**6 + b']' * 10**6 + b'}'",
        "b'{\"round\": ' + b'9' * 5000 + b'}'",
        f"{ESCAPE.encode()!r} * 50",
    )
    for value in made_there:
        attack = f"{c10d_wire.source()}\nClient('127.0.0.1', {port}).set({KEY_NAME!r}, {value})"
        done = as_user(user, attack)
        assert done.returncode == 0, done.stderr
        assert _status(port, secret[1]) == 2
        assert "not signed with the job's secret" in _one_line_error(capsys)
