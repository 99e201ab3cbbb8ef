"""Each private torch piece we rely on is still there with the shape we use (torch_compat)."""

from __future__ import annotations

import inspect
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import torch
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

from elastic_trainer.supervisor import torch_compat
from tests import ROOT


@pytest.mark.parametrize("name", sorted(torch_compat.checks()))
def test_private_piece_still_exists(name: str) -> None:
    assert torch_compat.checks()[name](), f"torch {torch.__version__} changed {name}"


def test_installed_torch_is_in_the_tested_range() -> None:
    """pyproject declares the range we test; a torch outside it must not pass silently."""
    assert torch_compat.untested_torch(torch.__version__) is None, torch.__version__


@pytest.mark.parametrize(
    ("version", "untested"),
    [
        ("2.14.1", False),
        ("2.15.0+cu132", False),
        ("2.15.0a0+git1234", False),
        ("2.11.0+cu130", True),
        ("2.16.0.dev20261101", True),
        ("3.0.0", True),
    ],
)
def test_a_torch_outside_the_tested_range_gets_one_line_with_the_fix(version, untested) -> None:
    line = torch_compat.untested_torch(version)
    assert (line is not None) == untested
    if untested:
        assert f"torch {version} is outside" in line
        assert line.endswith("pip install 'torch>=2.14,<2.16'")


def test_pyproject_pins_the_tested_range() -> None:
    import re
    from pathlib import Path

    pyproject = (Path(ROOT) / "pyproject.toml").read_text()
    (torch_req,) = re.findall(r'"(torch>[^"]*)"', pyproject)  # tomllib needs Python 3.11
    low, high = torch_compat.TESTED_TORCH
    major, minor = map(int, high.split("."))
    assert torch_req.replace(" ", "") == f"torch>={low},<{major}.{minor + 1}"


def test_the_compat_functions_work_on_a_real_handler() -> None:
    """Not only names: drive each accessor against a real handler on an in-memory store."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    store = HashStore()
    handler = DynamicRendezvousHandler.from_backend(
        "job",
        store,
        C10dRendezvousBackend(store, "job"),
        1,
        1,
        timeout=RendezvousTimeout(close=timedelta(seconds=3)),
        keep_alive_interval=2,  # seconds (a float works too)
        keep_alive_max_attempt=4,
    )
    torch_compat.set_last_call_timeout(handler, timedelta(seconds=7))
    assert handler._settings.timeout.last_call == timedelta(seconds=7)
    assert torch_compat.keep_alive(handler) == (2.0, 4)
    assert torch_compat.close_timeout_s(handler) == 3.0
    state = torch_compat.rendezvous_state(handler, sync=True)
    assert state.round == 0 and not state.participants
    assert torch_compat.this_node(handler) is not None
    assert torch_compat.matches_machine_hostname("127.0.0.1")


@pytest.mark.parametrize(("backend", "call"), [("nccl", "_abort_process_group"), ("gloo", None)])
def test_only_nccl_communicators_are_aborted_when_a_peer_is_lost(backend, call) -> None:
    assert torch_compat.abort_call(backend) == call


def test_abort_communicators_calls_the_abort_for_nccl_only() -> None:
    import torch.distributed as dist

    calls: list[str] = []
    assert not torch_compat.abort_communicators("nccl", abort=lambda: calls.append("x"))
    assert calls == []  # no group: nothing to abort
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not torch_compat.abort_communicators(abort=lambda: calls.append("gloo"))
        assert torch_compat.abort_communicators("nccl", abort=lambda: calls.append("nccl"))
        assert calls == ["nccl"] and dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_torchs_abort_clears_the_world_so_a_new_group_can_be_created() -> None:
    """The real private call on a gloo world of one: the registry is cleared (what a process
    that re-forms its group after an abort relies on)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch_compat.abort_world()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()


def test_the_agents_shutdown_grace_is_passed_where_torch_takes_it(monkeypatch) -> None:
    """2.14 and 2.15 take ``shutdown_timeout``; the 2.11 that GPU images carry refuses it
    (TypeError at the agent's start: found by the first GPU run)."""
    from torch.distributed.elastic.agent.server import local_elastic_agent

    assert torch_compat.agent_shutdown_timeout(5) == {"shutdown_timeout": 5}

    class Older:
        def __init__(self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300):
            pass

    monkeypatch.setattr(local_elastic_agent, "LocalElasticAgent", Older)
    assert torch_compat.agent_shutdown_timeout(5) == {}


def test_the_agents_shutdown_gets_its_timeout_where_torch_takes_one() -> None:
    calls: list[dict] = []

    class Agent:
        def _shutdown(self, death_sig=None, timeout=30):
            calls.append({"timeout": timeout})

    class OlderAgent:
        def _shutdown(self, death_sig=None):
            calls.append({})

    torch_compat.shut_down(Agent(), timeout_s=2)
    torch_compat.shut_down(OlderAgent(), timeout_s=2)
    assert calls == [{"timeout": 2}, {}]
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters


class _Holder:
    def __init__(self, state: Any) -> None:
        self.state = state


def _executor_ending_a_round(
    waiting: int, *, min_nodes: int = 1, max_nodes: int = 4
) -> tuple[Any, Any]:
    """An op executor whose node is the last member of a complete round, ``waiting`` nodes
    on the wait list, its removal torch's own (``_admitting_waiters`` wraps it)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings,
        RendezvousTimeout,
        _RendezvousState,
    )

    me = _NodeDesc("h", 1, 0)
    timeout = RendezvousTimeout(last_call=timedelta(seconds=2))
    settings = RendezvousSettings("job", min_nodes, max_nodes, timeout, timedelta(seconds=1), 3)
    state = _RendezvousState()
    state.complete, state.participants = True, {me: 0}
    state.last_heartbeats[me] = datetime.now(timezone.utc)
    state.wait_list = {_NodeDesc("h", 2 + i, 0) for i in range(waiting)}
    executor = torch_compat._DistributedRendezvousOpExecutor(me, _Holder(state), settings)
    executor._state = state
    return executor, state


@pytest.mark.parametrize("waiting", [1, 3])
def test_the_round_opened_by_the_last_node_out_takes_in_its_waiters(waiting) -> None:
    executor, state = _executor_ending_a_round(waiting)
    waiters = set(state.wait_list)
    torch_compat._admitting_waiters(executor, lambda: True)()
    assert (state.round, state.complete) == (1, False)
    assert set(state.participants) == waiters and not state.wait_list
    assert state.deadline is not None  # the last call runs from now (min_nodes 1)


def test_waiters_that_would_fill_the_round_are_left_to_join_themselves() -> None:
    """No place would be left for the node that opened the round (it joins next): torch's
    own race decides then, as before."""
    executor, state = _executor_ending_a_round(4)
    torch_compat._admitting_waiters(executor, lambda: True)()
    assert (state.round, state.participants, len(state.wait_list)) == (1, {}, 4)


def test_waiters_below_the_minimum_join_without_a_last_call() -> None:
    executor, state = _executor_ending_a_round(1, min_nodes=3)
    torch_compat._admitting_waiters(executor, lambda: True)()
    assert len(state.participants) == 1 and state.deadline is None


def test_a_node_leaving_a_round_for_the_next_waits_for_it_in_the_same_write() -> None:
    executor, state = _executor_ending_a_round(0)
    other = _NodeDesc("h", 9, 0)
    state.participants[other] = 1  # still running: the round goes on
    torch_compat._admitting_waiters(executor, lambda: True)()
    assert (state.round, set(state.participants)) == (0, {other})
    assert state.wait_list == {executor._node}


def test_a_node_leaving_for_good_is_not_put_on_the_wait_list() -> None:
    executor, state = _executor_ending_a_round(0)
    state.participants[_NodeDesc("h", 9, 0)] = 1
    torch_compat._admitting_waiters(executor, lambda: False)()
    assert not state.wait_list


def test_rendezvous_event_names_come_from_the_frame_not_inspect_stack(monkeypatch) -> None:
    """torch names each rendezvous event it records after its caller, through
    ``inspect.stack()`` (source lines read for every frame, twice: 0.34 s a call at 128 agents
    on 2 cores). Once a join hook is installed the name comes from the caller's frame: the
    same name as torch's, and ``inspect.stack`` is never called."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    # undone after the test: torch's own again (or what an earlier test installed)
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)

    def _record() -> str:  # as torch's _record calls it: the name of its caller
        return dynamic_rendezvous.get_method_name()

    def _add_to_participants() -> str:
        return _record()

    before = _add_to_participants()
    torch_compat._install_cheap_method_name()

    def no_stack(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("inspect.stack() called")

    monkeypatch.setattr(inspect, "stack", no_stack)
    assert _add_to_participants() == before == "_add_to_participants"
    assert dynamic_rendezvous.get_method_name(depth=10_000) == "no_method_name"
    installed = dynamic_rendezvous.get_method_name
    torch_compat._install_cheap_method_name()  # once: not wrapped again
    assert dynamic_rendezvous.get_method_name is installed
