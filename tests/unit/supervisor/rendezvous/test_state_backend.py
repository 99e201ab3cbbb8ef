"""The rendezvous state as signed JSON: exact round trips, and a value the job did not write
never reaches torch's state holder (refused, reported, replaced by the last good state)."""

from __future__ import annotations

import base64
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from structlog.testing import capture_logs
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_trainer.contract import auth
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.rendezvous import state_codec
from elastic_trainer.supervisor.rendezvous.signed_store import SignedStore, TamperedValue
from elastic_trainer.supervisor.rendezvous.state_backend import SignedStateBackend

KEY = auth.JobKey.generate()
NAME = torch_compat.rendezvous_key("job")


def _state() -> Any:
    a, b = _NodeDesc("10.0.0.1", 7, 0), _NodeDesc("host-b", 8, 1)
    state = _RendezvousState()
    state.round, state.complete, state.closed = 4, True, False
    state.deadline = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    state.participants = {a: 0, b: 1}
    state.wait_list = {_NodeDesc("c", 9, 0)}
    state.redundancy_list = set()
    state.last_heartbeats = {a: state.deadline - timedelta(microseconds=1), b: state.deadline}
    return state


def test_a_state_round_trips_exactly() -> None:
    plain = torch_compat.state_to_plain(_state())
    again = torch_compat.state_from_plain(
        state_codec.decode(state_codec.encode(plain, fingerprint="k"))
    )
    assert vars(again) == vars(_state())
    assert state_codec.decode(state_codec.encode(None, fingerprint="k")) is None


def test_a_node_named_twice_is_no_state() -> None:
    plain = torch_compat.state_to_plain(_state())
    plain["participants"].append(list(plain["participants"][0]))
    with pytest.raises(ValueError, match="twice"):
        state_codec.decode(state_codec.encode(plain, fingerprint="k"))


def _backend(store: HashStore, key: auth.JobKey = KEY) -> SignedStateBackend:
    return SignedStateBackend(SignedStore(store, key), "job")


def _write(backend: SignedStateBackend, state: Any) -> None:
    stored = backend.get_state()
    token = None if stored is None else stored[1]
    assert backend.set_state(pickle.dumps(state), token)[2]


def test_a_value_the_job_did_not_write_is_replaced_by_the_last_good_state() -> None:
    store = HashStore()
    backend = _backend(store)
    _write(backend, _state())
    planted = base64.b64encode(pickle.dumps(print))  # torch's format: never unpickled
    store.set(NAME, planted)
    with capture_logs() as logs:
        bits, token = backend.get_state()
    assert vars(pickle.loads(bits)) == vars(_state()) and token == planted
    assert [(e["event"], e["reason"]) for e in logs] == [("store.tampered", "bad_tag")]
    _write(backend, pickle.loads(bits))  # the holder's next write replaces the plant
    assert bytes(store.get(NAME)) != planted
    assert vars(_backend(store).peek()) == vars(_state())


def test_a_node_that_never_saw_a_good_state_starts_from_an_empty_one() -> None:
    store = HashStore()
    store.set(NAME, b"garbage planted before the first node")
    backend = _backend(store)
    bits, _ = backend.get_state()
    assert vars(pickle.loads(bits)) == vars(_RendezvousState())


def test_peek_refuses_what_it_cannot_verify() -> None:
    store = HashStore()
    backend = _backend(store)
    _write(backend, _state())
    forged = state_codec.encode(torch_compat.state_to_plain(_state()), fingerprint="x")
    store.set(NAME, auth.sign_value(auth.JobKey.generate(), NAME, forged))
    with pytest.raises(TamperedValue):
        backend.peek()
