"""``elastic-train status --rdzv-endpoint``: a live store, read without joining or writing."""

from __future__ import annotations

import json
import pickle
import socket
from base64 import b64encode
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic_trainer import torch_compat
from elastic_trainer.status import main


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
