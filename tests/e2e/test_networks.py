"""elastic-train on real networks: every node in its own network namespace, addressed by IP.

Topology and faults: see tests/e2e/netns.py (a data bridge between nodes, a store bridge to the
store, links pulled at the switch, whole nodes frozen with SIGSTOP). Needs root and iproute2;
skips with the reason elsewhere. The bounds asserted are the README's "Real networks" ones.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.e2e.netns import Network, Node, unavailable_reason
from tests.e2e.workers.harness import (
    FAST_RDZV,
    PLAIN_DDP,
    PROTO,
    Agent,
    env_with,
    spawn_agent,
    wait_for,
)

_WHY_NOT = unavailable_reason()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(_WHY_NOT is not None, reason=f"no network namespaces: {_WHY_NOT}"),
]
STORE_CONF = FAST_RDZV + ",is_host=false"
# keep-alive 1 s x 3 attempts, confirmed on a second check: ~4-6 s to call a peer silent, then
# a 2 s last call and the workers' restart: the bound leaves room for a loaded machine
SHRINK_BOUND_S = 45


@pytest.fixture
def net(agents):
    """The test's namespaces; removed (with whatever still runs inside) even on failure.
    Asks for ``agents`` so that the trees are killed first, then the namespaces go."""
    network = Network()
    try:
        yield network
    finally:
        network.close()


def node_env(worker_env: dict[str, str]) -> dict[str, str]:
    # gloo picks its interface from the hostname, which resolves to 127.0.0.1 here
    return env_with(worker_env, GLOO_SOCKET_IFNAME="eth0")


def start_store(net: Network, tmp: Path, env: dict[str, str]) -> str:
    """``elastic-train store`` in its own namespace; returns its endpoint ADDR:PORT."""
    store = net.add_store()
    ready = tmp / "store.ready"
    cmd = [sys.executable, "-m", "elastic_trainer", "store", "--host", store.addr, "--port",
           "0", "--ready-file", str(ready), "--log-format", "json"]  # fmt: skip
    with open(tmp / "store.log", "wb") as log:
        subprocess.Popen(store.cmd(cmd), env=env, stdout=log, stderr=subprocess.STDOUT)
    return wait_for(lambda: ready.exists() and ready.read_text().strip(), 60, "the store")


def start_node(tmp: Path, node: Node, argv: list[str], env: dict[str, str]) -> Agent:
    return spawn_agent(tmp, node.name, ["--local-addr", node.addr, *argv], env, wrap=node.cmd([]))


def audit_rows(path: Path) -> list[tuple[int, int, int, float]]:
    """(step, rank, world_size, time) rows of proto_worker's audit file."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            rows.append((int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])))
    return rows


def first_step_at(audit: Path, world: int, after: float, above: int = 0) -> float | None:
    """Time of the first step at ``world`` ranks written after ``after`` (epoch seconds),
    counting only steps past ``above`` (a thawed worker first finishes its stale step)."""
    rows = audit_rows(audit)
    return next((t for s, _, w, t in rows if w == world and t > after and s > above), None)


def last_step(audit: Path) -> int:
    return max((s for s, *_ in audit_rows(audit)), default=0)


def elastic_argv(
    tmp: Path, endpoint: str, steps: int, *extra: str, conf: str = STORE_CONF
) -> list[str]:
    audit, snap = tmp / "audit", tmp / "snap"
    return [
        "--rdzv-endpoint", endpoint, "--rdzv-conf", conf, "--min-nodes", "2",
        "--max-nodes", "3", "--snapshot-dir", str(snap), "--snapshot-every", "5", *extra,
        PROTO, "--steps", str(steps), "--step-time", "0.1", "--audit", str(audit),
    ]  # fmt: skip


def three_nodes(net, tmp, worker_env, agents, steps, extra=(), conf=STORE_CONF):
    env = node_env(worker_env)
    endpoint = start_store(net, tmp, env)
    nodes = [net.add_node(name) for name in ("a", "b", "c")]
    for node in nodes:
        agents.append(
            start_node(tmp, node, elastic_argv(tmp, endpoint, steps, *extra, conf=conf), env)
        )
    wait_for(lambda: first_step_at(tmp / "audit", 3, 0), 120, "steps at world size 3")
    return nodes


def event_time(event: dict) -> float:
    """An event's timestamp as seconds since the epoch (comparable with time.time())."""
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def agents_of(nodes: list[Node], agents: list[Agent]) -> list[Agent]:
    by_name = {agent.name: agent for agent in agents}
    return [by_name[node.name] for node in nodes]


def assert_clean_finish(net: Network, audit: Path, steps: int) -> None:
    """Every step was trained (a restart repeats steps, never skips one); no process is left
    in any of the test's namespaces."""
    assert {s for s, *_ in audit_rows(audit)} == set(range(1, steps + 1))
    assert nodes_empty(net)


def nodes_empty(net: Network) -> bool:
    """No process left in any node's namespace (the store serves on until teardown)."""
    return wait_for(lambda: not net.pids(nodes_only=True), 20, "the nodes to empty", step=0.2)


def test_partitioned_node_is_dropped_and_rejoins_when_healed(net, tmp_path, worker_env, agents):
    a, b, c = agents_of(three_nodes(net, tmp_path, worker_env, agents, steps=250), agents)
    cut_at = time.time()
    net.cut(net.nodes["c"])
    shrunk = wait_for(lambda: first_step_at(tmp_path / "audit", 2, cut_at), 60, "world size 2")
    print(f"partition -> first step at world size 2: {shrunk - cut_at:.1f} s")
    assert shrunk - cut_at < SHRINK_BOUND_S
    # The first survivor to miss c's heartbeats reports it silent and re-forms; the other may
    # follow it into the new round before its own check fires. Both report a node lost.
    silent = [e for x in (a, b) for e in x.events("peer.silent")]
    assert silent and all(e["nodes"] == ["c"] for e in silent)  # its --node name
    assert all(e["addresses"] == [f"{net.nodes['c'].addr}:{c.proc.pid}"] for e in silent)
    for survivor in (a, b):
        # The first round may have formed before c was in (c then joined): the cut's change is
        # the first one after it.
        changed = [e for e in survivor.events("membership.changed") if event_time(e) >= cut_at]
        assert changed[0]["reason"] == "node_lost"
    healed_at, done = time.time(), last_step(tmp_path / "audit")
    net.heal(net.nodes["c"])
    assert [x.wait(150) for x in (a, b)] == [0, 0]
    assert c.wait(60) in (0, 1)  # rejoined and finished, or told it is out: never hangs
    grown = first_step_at(tmp_path / "audit", 3, healed_at, above=done)
    print(f"heal -> first step at world size 3: {grown and grown - healed_at}")
    assert_clean_finish(net, tmp_path / "audit", 250)


def test_frozen_node_is_dropped_and_thawed_it_rejoins_or_exits(net, tmp_path, worker_env, agents):
    a, b, c = agents_of(three_nodes(net, tmp_path, worker_env, agents, steps=250), agents)
    frozen_at = time.time()
    c.signal_tree(signal.SIGSTOP)
    shrunk = wait_for(lambda: first_step_at(tmp_path / "audit", 2, frozen_at), 60, "world 2")
    print(f"freeze -> first step at world size 2: {shrunk - frozen_at:.1f} s")
    assert shrunk - frozen_at < SHRINK_BOUND_S
    # dropped by its silence: the first survivor to see it expires it for both (the other may
    # then find the round already changed without calling it silent itself, under load)
    silent = a.events("peer.silent") + b.events("peer.silent")
    assert silent and all(e["nodes"] == ["c"] for e in silent)  # its --node name
    assert all(e["addresses"] == [f"{net.nodes['c'].addr}:{c.proc.pid}"] for e in silent)
    thawed_at, done = time.time(), last_step(tmp_path / "audit")
    c.signal_tree(signal.SIGCONT)
    assert [x.wait(150) for x in (a, b)] == [0, 0]
    assert c.wait(60) in (0, 1)
    grown = first_step_at(tmp_path / "audit", 3, thawed_at, above=done)
    print(f"thaw -> first step at world size 3: {grown and grown - thawed_at}")
    assert_clean_finish(net, tmp_path / "audit", 250)


def test_node_cut_from_the_store_only(net, tmp_path, worker_env, agents):
    """The others drop it (its heartbeats stop) and go on at world size 2; the cut node must
    notice (store.unreachable) and exit within the bound, not hang."""
    a, b, c = agents_of(three_nodes(net, tmp_path, worker_env, agents, steps=200), agents)
    cut_at = time.time()
    net.cut(net.nodes["c"], "store")
    shrunk = wait_for(lambda: first_step_at(tmp_path / "audit", 2, cut_at), 60, "world 2")
    assert shrunk - cut_at < SHRINK_BOUND_S
    assert [x.wait(150) for x in (a, b)] == [0, 0]
    # regression: it hung in a store read for good (still running at 200 s) until the store
    # connection got a silence limit (endpoint.STORE_SILENCE_LIMIT_S)
    assert c.wait(max(5.0, 90 - (time.time() - cut_at))) != 0
    assert c.events("store.unreachable")


def test_two_nodes_cut_from_each_other_only(net, tmp_path, worker_env, agents):
    """Both keep beating to the store, so nobody is dropped: each attempt fails by the
    collective timeout and restarts at world size 3; once restarts are spent every node
    exits with a failed job.finished, within the bound; no step skipped up to the last."""
    extra = ("--collective-timeout", "10", "--max-restarts", "1")
    conf = STORE_CONF.replace("join_timeout=90", "join_timeout=30")
    nodes = three_nodes(net, tmp_path, worker_env, agents, steps=2000, extra=extra, conf=conf)
    trio = agents_of(nodes, agents)
    cut_at = time.time()
    net.cut_between(net.nodes["a"], net.nodes["b"])
    codes = [x.wait(180) for x in trio]
    took = time.time() - cut_at
    print(f"a<->b cut -> every node exited ({codes}) after {took:.1f} s")
    assert codes == [1, 1, 1] and took < 2 * (10 + 15) + 30 + 30
    for x in trio:
        assert x.events("job.finished")[-1]["status"] in ("failed", "rendezvous_timeout")
        assert x.events("worker.failed")
    trained = last_step(tmp_path / "audit")
    assert {s for s, *_ in audit_rows(tmp_path / "audit")} == set(range(1, trained + 1))
    assert nodes_empty(net)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no `unshare` (util-linux)")
def test_node_whose_hostname_does_not_resolve_works_with_local_addr(
    net, tmp_path, worker_env, agents
):
    # no GLOO_SOCKET_IFNAME here: with --local-addr the supervisor picks that address's
    # interface for gloo (workerenv.point_gloo_at); the name would give gloo nothing
    env = env_with(worker_env)
    endpoint = start_store(net, tmp_path, env)
    argv = elastic_argv(tmp_path, endpoint, 30)
    argv[argv.index("--max-nodes") + 1] = "2"
    a, b = net.add_node("a"), net.add_node("b")
    agents.append(start_node(tmp_path, a, argv, env))
    nameless = ["unshare", "--uts", "sh", "-c", 'hostname nope.invalid && exec "$@"', "sh"]
    agents.append(spawn_agent(tmp_path, "b", ["--local-addr", b.addr, *argv], env,
                              wrap=b.cmd(nameless)))  # fmt: skip
    assert [x.wait(150) for x in agents] == [0, 0], agents[1].stderr_file.read_text()[-2000:]
    assert {w for _, _, w, _ in audit_rows(tmp_path / "audit")} == {2}
    assert_clean_finish(net, tmp_path / "audit", 30)


def test_torchrun_static_command_line_by_ip(net, tmp_path, worker_env, agents):
    """torchrun --nnodes 2 --node-rank R --master-addr NODE0 --master-port P, unchanged, across
    two namespaces: the unmodified DDP script fails once on rank 1, both restart and finish.
    Node rank 0 has the *higher* address, so torch's rendezvous numbers the other node 0: the
    workers' store must still be where global rank 0 runs (node rank 0), on another host."""
    out, port = tmp_path / "env.json", "29611"
    low, high = net.add_node("n0"), net.add_node("n1")
    for rank, node in enumerate((high, low)):
        argv = ["--local-addr", node.addr,
                "--nnodes", "2", "--node-rank", str(rank), "--master-addr", high.addr,
                "--master-port", port, "--max-restarts", "2", PLAIN_DDP, str(out)]  # fmt: skip
        agents.append(spawn_agent(tmp_path, node.name, argv, node_env(worker_env),
                                  wrap=node.cmd([])))  # fmt: skip
    assert [x.wait(200) for x in agents] == [0, 0], agents[1].stderr_file.read_text()[-2000:]
    seen = json.loads(out.read_text())
    assert (seen["WORLD_SIZE"], seen["MASTER_ADDR"]) == ("2", high.addr)
    assert sum(len(x.events("worker.failed")) for x in agents) >= 1
    assert nodes_empty(net)


@pytest.mark.parametrize("first_up", ["master", "other"])
def test_two_nodes_given_node_rank_0_on_separate_hosts_exit_2_naming_it(
    net, tmp_path, worker_env, agents, first_up
):
    """Both declare node rank 0, each on its own host: no port collides, so each hosted a
    store of its own and both waited alone until the join timeout (torchrun hangs the same
    way). The one whose --master-addr is elsewhere finds the other's store there, whichever
    started first: both exit 2 with one line naming the conflict, before any worker."""
    port = "29613"
    master, other = net.add_node("n0"), net.add_node("n1")
    order = (master, other) if first_up == "master" else (other, master)
    for node in order:
        argv = ["--local-addr", node.addr,
                "--nnodes", "2", "--node-rank", "0", "--master-addr", master.addr,
                "--master-port", port, PLAIN_DDP, str(tmp_path / "env.json")]  # fmt: skip
        agent = spawn_agent(tmp_path, node.name, argv, node_env(worker_env), wrap=node.cmd([]))
        agents.append(agent)
        wait_for(lambda a=agent: a.events("supervisor.started"), 60, f"{node.name} to start")
    codes = [x.wait(120) for x in agents]  # it was a hang: a generous bound
    assert codes == [2, 2], agents[-1].stderr_file.read_text()[-2000:]
    for agent in agents:
        (finished,) = agent.events("job.finished")
        assert finished["error"].startswith("--node-rank=0 is given to 2 nodes (n1, ")
        assert master.addr in finished["error"] and not agent.events("workers.started")
    assert nodes_empty(net)


def test_store_host_cut_off_goes_on_alone_and_the_others_stop(net, tmp_path, worker_env, agents):
    """Node a hosts the store itself (no standalone store) and is cut off from b and c. No
    reset reaches anyone: a is silent to them, not gone, so its store may still be serving
    (it is: a goes on alone). b and c must not start a second store for the job (store
    failover moves the store only on proof that its host is gone); they stop with one line
    that says why, and only a writes the snapshot folder from then on."""
    env = node_env(worker_env)
    a, b, c = (net.add_node(name) for name in ("a", "b", "c"))
    port = 29411
    argv = [
        "--rdzv-endpoint", f"{a.addr}:{port}", "--min-nodes", "1", "--max-nodes", "3",
        "--snapshot-dir", str(tmp_path / "snap"), "--snapshot-every", "5",
        PROTO, "--steps", "300", "--step-time", "0.1", "--audit", str(tmp_path / "audit"),
    ]  # fmt: skip
    trio = []
    for node in (a, b, c):  # no is_host: a knows the endpoint is its interface's address
        trio.append(start_node(tmp_path, node, ["--rdzv-conf", FAST_RDZV, *argv], env))
        agents.append(trio[-1])
    wait_for(lambda: first_step_at(tmp_path / "audit", 3, 0), 120, "steps at world size 3")
    cut_at = time.time()
    net.cut(a)
    alone = wait_for(lambda: first_step_at(tmp_path / "audit", 1, cut_at), 90, "a alone")
    print(f"store host cut off -> a trains alone after {alone - cut_at:.1f} s")
    for other in trio[1:]:
        assert other.wait(120) == 1
        finished = other.events("job.finished")[-1]
        assert finished["status"] == "store_lost"
        assert "not known gone" in finished["error"], finished
        assert other.events("store.moved") == []
    assert trio[0].wait(150) == 0
    assert trio[0].events("store.moved") == []
    assert_clean_finish(net, tmp_path / "audit", 300)


def test_after_a_failover_a_restarted_store_host_joins_the_moved_store(
    net, tmp_path, worker_env, agents
):
    """Three machines; a hosts the store (is_host=true), b and c join it. a's whole node is
    SIGKILLed: b (the first survivor by address) hosts the store on its own address and
    records it in the snapshot folder. a is started again exactly as before, with the job's
    original endpoint, its own address: it must not host a second store there; it reads the
    record, joins the moved store on b, and the group grows back to three."""
    env = node_env(worker_env)
    a, b, c = (net.add_node(name) for name in ("a", "b", "c"))
    port, snap, audit = 29412, tmp_path / "snap", tmp_path / "audit"

    def argv(host: bool) -> list[str]:
        conf = FAST_RDZV + (",is_host=true" if host else ",is_host=false")
        return [
            "--local-addr", "", "--rdzv-endpoint", f"{a.addr}:{port}", "--rdzv-conf", conf,
            "--min-nodes", "1", "--max-nodes", "3", "--snapshot-dir", str(snap),
            "--snapshot-every", "5", PROTO, "--steps", "500", "--step-time", "0.1",
            "--audit", str(audit),
        ]  # fmt: skip

    def start(node: Node, name: str, host: bool) -> Agent:
        args = argv(host)
        args[1] = node.addr
        agent = spawn_agent(tmp_path, name, args, env, wrap=node.cmd([]))
        agents.append(agent)
        return agent

    first = start(a, "a", True)
    wait_for(lambda: (tmp_path / "a.jsonl").exists(), 60, "a to start")
    second, third = start(b, "b", False), start(c, "c", False)
    wait_for(lambda: first_step_at(audit, 3, 0), 120, "steps at world size 3")
    first.kill_tree()
    killed_at = time.time()
    moved = second.wait_event("store.moved", 60)
    assert moved["hosted_here"] and moved["endpoint"] == f"{b.addr}:{port}"
    assert third.wait_event("store.moved", 60)["endpoint"] == f"{b.addr}:{port}"
    wait_for(lambda: first_step_at(audit, 2, killed_at), 90, "steps at world size 2")
    recorded = json.loads((snap / "rendezvous-store.json").read_text())
    assert recorded["endpoint"] == f"{b.addr}:{port}" and recorded["job_id"] == "e2e"

    again_at = time.time()
    again = start(a, "a2", True)
    found = again.wait_event("store.found", 60)
    assert found == {**found, "endpoint": f"{b.addr}:{port}",
                     "configured_endpoint": f"{a.addr}:{port}"}  # fmt: skip
    assert wait_for(lambda: first_step_at(audit, 3, again_at), 120, "world size 3 again")
    assert again.events("store.exposed") == []  # it hosts no store of its own
    assert [x.wait(200) for x in (second, third, again)] == [0, 0, 0]
    assert_clean_finish(net, audit, 500)
