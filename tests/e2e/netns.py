"""Real (namespaced) networks for e2e tests: every node in its own network namespace.

Topology, all in namespaces this module creates and removes (the root namespace's interfaces and
routes are never touched; addresses come from the benchmarking range 198.18.0.0/24):

    switch namespace: bridge br0 (the data network)   bridge br1 (the store network)
    node i:   eth0 198.18.0.(10+i)/25 on br0          eth1 198.18.0.(140+i)/25 on br1
    store:                                            eth1 198.18.0.129/25 on br1

The store is reachable only through br1, so a node can be cut from the store alone (its br1
port down), from everyone (both ports down), or from one other node alone (a ``drop`` filter
on the two bridge ports, in the switch namespace). Ports go down on the switch side: the node's
own stack sees a pulled cable, not a deleted interface. No ``netem`` on this kernel: a slow
link is not modelled, a silent peer is a frozen process tree (SIGSTOP).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

DATA_PREFIX, STORE_PREFIX = "198.18.0.", "198.18.0."
STORE_ADDR = "198.18.0.129"
_counter = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Why namespaced networks cannot be built here (the tests skip with this reason)."""


def unavailable_reason() -> str | None:
    """None when this process may create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"etprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Node:
    name: str
    ns: str
    addr: str  # data network (eth0): advertised with --local-addr, MASTER_ADDR
    store_addr: str | None  # store network (eth1), None for the store itself
    index: int

    def cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node's namespace (``ip netns exec`` execs: same pid)."""
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Network:
    """One test's namespaces; ``close()`` kills what runs inside them and removes them all."""

    tag: str = field(default_factory=lambda: f"et{os.getpid()}x{next(_counter)}")
    nodes: dict[str, Node] = field(default_factory=dict)
    store: Node | None = None
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.switch = self._namespace("sw")
        for bridge in ("br0", "br1"):
            ip("-n", self.switch, "link", "add", "name", bridge, "type", "bridge")
            ip("-n", self.switch, "link", "set", bridge, "up")

    def _namespace(self, role: str) -> str:
        name = f"{self.tag}-{role}"
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        return name

    def _wire(self, ns: str, dev: str, port: str, bridge: str, cidr: str) -> None:
        """A veth from ``ns`` (``dev``) to the switch (``port`` on ``bridge``)."""
        ip("-n", ns, "link", "add", "name", dev, "type", "veth", "peer", "name", port,
           "netns", self.switch)  # fmt: skip
        ip("-n", self.switch, "link", "set", port, "master", bridge)
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", ns, "addr", "add", cidr, "dev", dev)
        ip("-n", ns, "link", "set", dev, "up")

    def add_node(self, name: str) -> Node:
        i = len(self.nodes)
        ns = self._namespace(name)
        node = Node(name, ns, f"{DATA_PREFIX}{10 + i}", f"{STORE_PREFIX}{140 + i}", i)
        self._wire(ns, "eth0", f"d{i}", "br0", f"{node.addr}/25")
        self._wire(ns, "eth1", f"s{i}", "br1", f"{node.store_addr}/25")
        self.nodes[name] = node
        return node

    def add_store(self) -> Node:
        ns = self._namespace("store")
        self._wire(ns, "eth1", "st", "br1", f"{STORE_ADDR}/25")
        self.store = Node("store", ns, STORE_ADDR, None, -1)
        return self.store

    # --- faults -------------------------------------------------------------------------
    def _ports(self, node: Node, which: str) -> list[str]:
        return {"all": [f"d{node.index}", f"s{node.index}"], "data": [f"d{node.index}"],
                "store": [f"s{node.index}"]}[which]  # fmt: skip

    def cut(self, node: Node, which: str = "all") -> None:
        """Pull ``node``'s cable(s) at the switch: ``all``, ``data`` (peers) or ``store``."""
        for port in self._ports(node, which):
            ip("-n", self.switch, "link", "set", port, "down")

    def heal(self, node: Node, which: str = "all") -> None:
        for port in self._ports(node, which):
            ip("-n", self.switch, "link", "set", port, "up")

    def cut_between(self, a: Node, b: Node) -> None:
        """Cut the data path between ``a`` and ``b`` only: both keep the store and every other
        node. Their bridge ports are made *isolated* (isolated ports forward only to ports
        that are not): silent, like a partition, no reset. One pair at a time."""
        for node in (a, b):
            ip("-n", self.switch, "link", "set", "dev", f"d{node.index}", "type",
               "bridge_slave", "isolated", "on")  # fmt: skip

    def heal_between(self, a: Node, b: Node) -> None:
        for node in (a, b):
            ip("-n", self.switch, "link", "set", "dev", f"d{node.index}", "type",
               "bridge_slave", "isolated", "off")  # fmt: skip

    # --- teardown -----------------------------------------------------------------------
    def pids(self, *, nodes_only: bool = False) -> list[int]:
        """Processes in our namespaces (``nodes_only``: the nodes', not the store's)."""
        found: list[int] = []
        names = [n.ns for n in self.nodes.values()] if nodes_only else self._namespaces
        for ns in names:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            found += [int(p) for p in out.stdout.split()]
        return found

    def close(self) -> None:
        """Kill every process still inside our namespaces (frozen ones too), then remove them.
        Deleting a namespace deletes its veth ends, and so the switch's ports."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)  # reaping is asynchronous: poll until the namespaces are empty
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()
