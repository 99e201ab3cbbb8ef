"""``elastic-train status --rdzv-endpoint``: a live store, read without joining or writing."""

from __future__ import annotations

import json
import pickle
import socket
from base64 import b64encode
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousState,
)

from elastic_trainer import torch_compat
from elastic_trainer.tools.live_status import describe, state_shape_problem
from elastic_trainer.tools.status import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def store():
    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    yield server, port


def test_a_formed_round_is_shown_with_its_nodes(store, capsys) -> None:
    server, port = store
    handler = DynamicRendezvousHandler.from_backend(
        "job-1",
        server,
        C10dRendezvousBackend(server, "job-1"),
        1,
        1,
        local_addr="127.0.0.1",
        timeout=RendezvousTimeout(last_call=timedelta(seconds=1)),
    )
    handler.next_rendezvous()
    try:
        argv = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--job-id", "job-1", "--json"]
        assert main(argv) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["round"], shown["complete"], shown["closed"]) == (
            0,
            True,
            False,
        )  # first round
        (node,) = shown["nodes"]
        assert (node["addr"], node["group_rank"]) == ("127.0.0.1", 0)
        assert node["heartbeat_age_s"] is not None and node["heartbeat_age_s"] >= 0
    finally:
        handler.shutdown()


def test_an_unknown_job_is_one_line_and_writes_nothing(store, capsys) -> None:
    server, port = store
    assert main(["--rdzv-endpoint", f"127.0.0.1:{port}", "--job-id", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elastic-train: error: ") and "no rendezvous for job 'nope'" in err
    assert not server.check([torch_compat.rendezvous_key("nope")])  # read-only: no key made


def test_a_refused_endpoint_is_one_line(capsys) -> None:
    assert main(["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--timeout", "1"]) == 2
    assert capsys.readouterr().err.startswith("elastic-train: error: ")


def test_the_state_decoder_loads_nothing_but_a_rendezvous_state() -> None:
    evil = b64encode(pickle.dumps(print))  # any other global is refused, never called
    with pytest.raises(ValueError, match="not part of a rendezvous state"):
        torch_compat.decode_rendezvous_state(evil)
    assert torch_compat.decode_rendezvous_state(torch_compat.RENDEZVOUS_EMPTY) is None


def test_run_or_endpoint_not_both(tmp_path, capsys) -> None:
    assert main([]) == 2
    assert "give a RUN" in capsys.readouterr().err


_NODE = _NodeDesc("10.0.0.1", 4242, 0)


def _state(**fields: Any) -> _RendezvousState:
    """A formed one-node round as torch stores it, with ``fields`` put over it."""
    state = _RendezvousState()
    state.complete = True
    state.participants = {_NODE: 0}
    state.last_heartbeats = {_NODE: datetime.now(timezone.utc)}
    for name, value in fields.items():
        setattr(state, name, value)
    return state


def _show(server: TCPStore, port: int, state: Any) -> int:
    # what C10dRendezvousBackend writes: the base64 of the pickled state under the job's key
    server.set(torch_compat.rendezvous_key("job-1"), b64encode(pickle.dumps(state)))
    return main(["--rdzv-endpoint", f"127.0.0.1:{port}", "--job-id", "job-1", "--json"])


def test_a_well_formed_stored_state_is_shown(store, capsys) -> None:
    server, port = store
    assert _show(server, port, _state()) == 0
    (node,) = json.loads(capsys.readouterr().out)["nodes"]
    assert (node["addr"], node["pid"], node["group_rank"]) == ("10.0.0.1", 4242, 0)


@pytest.mark.parametrize(
    ("state", "named"),
    [
        (_state(last_heartbeats=5), "last_heartbeats is int, expected a dict"),
        (_state(participants={_NODE}), "participants is set, expected a dict"),
        (_state(participants=[[_NODE, 0]]), "participants is list, expected a dict"),
        (_state(wait_list=[["10.0.0.2", 7]]), "wait_list is list, expected a set"),
        (
            _state(last_heartbeats={_NODE: "2024-01-01T00:00:00"}),
            "the heartbeat of '10.0.0.1' is str, expected a datetime",
        ),
        ({"round": 1}, "the state is dict without round, complete, closed"),
    ],
    ids=[
        "int-heartbeats",
        "set-participants",
        "nested-list-participants",
        "nested-list-wait-list",
        "str-heartbeat",
        "not-a-state",
    ],
)
def test_a_state_of_another_shape_is_one_line_exit_2(store, capsys, state, named) -> None:
    server, port = store
    assert _show(server, port, state) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("elastic-train: error: ")
    assert f"the rendezvous state at 127.0.0.1:{port} is not one this version understands" in err
    assert named in err and "another job's store?" in err


def test_a_naive_heartbeat_is_read_as_utc() -> None:
    now = datetime(2024, 1, 1, 0, 0, 10, tzinfo=timezone.utc)
    naive = datetime(2024, 1, 1, 0, 0, 0)  # as an older torch's utcnow() wrote it
    shown = describe(_state(last_heartbeats={_NODE: naive}), now=now)
    assert state_shape_problem(_state(last_heartbeats={_NODE: naive})) is None
    assert shown["nodes"][0]["heartbeat_age_s"] == 10.0
