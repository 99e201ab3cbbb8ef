"""What ``Supervisor._run_agent`` makes of an error the agent raises: only the errors that
mean the store is gone end the run as ``store_lost``; any other error is what it is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs
from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_trainer.contract import protocol
from elastic_trainer.supervisor import agent as agent_mod
from elastic_trainer.supervisor import run
from elastic_trainer.supervisor.cli import args
from elastic_trainer.supervisor.processes import workerenv
from elastic_trainer.supervisor.rendezvous import handler, static_host


def _supervisor(monkeypatch, tmp_path, raised: BaseException) -> run.Supervisor:
    """A supervisor whose store and agent are stand-ins; the agent raises ``raised``."""

    class RaisingAgent:
        def __init__(self, **kwargs: object) -> None:
            self.ledger = SimpleNamespace(goodput_estimated=False)

        def supervise(self) -> agent_mod.AgentOutcome:
            raise raised

    monkeypatch.setattr(run, "hosts_store", lambda cfg: True)
    monkeypatch.setattr(handler, "create_handler", lambda *a, **kw: SimpleNamespace(store=None))
    monkeypatch.setattr(static_host, "start_probe", lambda *a, **kw: None)
    monkeypatch.setattr(workerenv, "make_control_root", lambda cfg: str(tmp_path / "control"))
    monkeypatch.setattr(workerenv, "logs_specs", lambda *a, **kw: None)
    monkeypatch.setattr(workerenv, "remove_stale_memory_dirs", lambda cfg: None)
    monkeypatch.setattr(workerenv, "remove_memory_dir", lambda cfg: None)
    monkeypatch.setattr(agent_mod, "ElasticTrainAgent", RaisingAgent)
    script = tmp_path / "train.py"
    script.write_text("")
    return run.Supervisor(args.parse(["--job-id", "job", str(script)]))


def _stop() -> SimpleNamespace:
    return SimpleNamespace(requested=False, interruptible=False)


@pytest.mark.parametrize(
    "lost",
    [
        DistNetworkError("Broken pipe"),
        DistStoreError("wait timeout after 30000ms"),
        RendezvousConnectionError("The connection to the C10d store has failed."),
    ],
    ids=type,
)
def test_a_store_error_ends_the_run_as_store_lost(monkeypatch, tmp_path, lost) -> None:
    supervisor = _supervisor(monkeypatch, tmp_path, lost)
    with capture_logs() as logs:
        outcome = supervisor._run_agent(_stop())
    assert (outcome.status, outcome.exit_code) == ("store_lost", protocol.SUPERVISOR_EXIT_FAILED)
    (unreachable,) = [e for e in logs if e["event"] == "store.unreachable"]
    assert unreachable["error"] == str(lost)


def test_an_unrelated_runtime_error_is_not_reported_as_a_lost_store(monkeypatch, tmp_path) -> None:
    supervisor = _supervisor(monkeypatch, tmp_path, RuntimeError("a bug of ours"))
    with capture_logs() as logs, pytest.raises(RuntimeError, match="a bug of ours"):
        supervisor._run_agent(_stop())
    assert [e for e in logs if e["event"] == "store.unreachable"] == []
