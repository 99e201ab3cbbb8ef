"""Validated run configuration for the supervisor: keyword-only, frozen dataclasses.

Every cross-field check lives in ``__post_init__`` and raises ``ConfigError`` with one line
naming the field, the bad value and the fix. ``supervisor/cli/args.py`` builds these from argv
and torchrun's ``PET_*`` environment; nothing here touches the network or the disk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_trainer.contract.endpoint import DEFAULT_PORT, format_endpoint
from elastic_trainer.contract.protocol import WorkerSettings
from elastic_trainer.contract.settings import (
    SWITCH,
    TOGGLE,
    Setting,
    flagged,
    option,
    seconds,
    slowdown_factor,
    text,
)
from elastic_trainer.errors import ConfigError

DEFAULT_MODULE = "elastic_trainer.jobs.default"
# SIGTERM -> SIGKILL when the supervisor stops workers to restart them: short, every second
# of it is downtime (torchrun's --shutdown-timeout sets another)
DEFAULT_SHUTDOWN_TIMEOUT_S = 2.0


def _check(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: {fix}")


def _positive(name: str, value: float) -> None:
    _check(
        isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
        name,
        value,
        "use a number > 0",
    )


def _non_negative(name: str, value: float) -> None:
    _check(
        isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
        name,
        value,
        "use a number >= 0",
    )


@dataclass(frozen=True, kw_only=True)
class RendezvousTuning:
    """Timeouts of torch's dynamic (c10d) rendezvous, tuned for fast recovery.

    The first round is patient (``first_last_call_timeout``) so that nodes started a few
    seconds apart land in one world instead of several (split brain). Later rounds follow a
    failure or a membership change and wait only ``last_call_timeout``. A node counts as
    dead after ``keep_alive_interval * keep_alive_max_attempt`` seconds without heartbeat.
    """

    join_timeout: float = 600.0
    first_last_call_timeout: float = 15.0
    last_call_timeout: float = 2.0
    close_timeout: float = 10.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float = 1.0
    keep_alive_max_attempt: int = 3
    read_timeout: int = 30

    def __post_init__(self) -> None:
        for name in (
            "join_timeout",
            "first_last_call_timeout",
            "last_call_timeout",
            "close_timeout",
            "heartbeat_timeout",
            "keep_alive_interval",
        ):
            _positive(f"--rdzv-conf {name}", getattr(self, name))
        _check(
            isinstance(self.keep_alive_max_attempt, int) and self.keep_alive_max_attempt >= 2,
            "--rdzv-conf keep_alive_max_attempt",
            self.keep_alive_max_attempt,
            "use an integer >= 2 (with 1, one late heartbeat expels a live node)",
        )
        _check(
            isinstance(self.read_timeout, int) and self.read_timeout > 0,
            "--rdzv-conf read_timeout",
            self.read_timeout,
            "use an integer number of seconds > 0",
        )
        _check(
            self.join_timeout > self.first_last_call_timeout,
            "--rdzv-conf join_timeout",
            self.join_timeout,
            f"make it longer than first_last_call_timeout={self.first_last_call_timeout}",
        )

    @property
    def dead_after_s(self) -> float:
        return self.keep_alive_interval * self.keep_alive_max_attempt


@dataclass(frozen=True, kw_only=True)
class RestartTuning:
    """Crash-loop back-off: a group failing again within ``crash_loop_window_s`` of its start
    waits ``backoff_base_s * 2**(n-1)`` (capped at ``backoff_max_s``) before restarting."""

    crash_loop_window_s: float = 30.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        _non_negative("crash_loop_window_s", self.crash_loop_window_s)
        _non_negative("backoff_base_s", self.backoff_base_s)
        _check(
            self.backoff_max_s >= self.backoff_base_s,
            "backoff_max_s",
            self.backoff_max_s,
            f"use a value >= backoff_base_s={self.backoff_base_s}",
        )


@dataclass(frozen=True, kw_only=True)
class TorchrunOptions:
    """torchrun's logging and process flags, honoured as torchrun does (torchrun_flags.py)."""

    log_dir: str | None = None  # None: a private folder removed at exit
    redirects: str = "0"  # torch's Std syntax: 0-3, or LOCAL_RANK:0-3,...
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefix_template: str | None = None
    role: str = "trainer"
    shutdown_timeout: float | None = None  # None: ours (2 s from SIGTERM to SIGKILL on restarts)
    node_rank: int | None = None  # static mode's --node-rank: this node's group rank


@dataclass(frozen=True, kw_only=True)
class Entrypoint:
    """What each worker runs: a script, a module, or (neither) the built-in job.

    ``no_python`` (torchrun's ``--no-python``): SCRIPT is an executable, run as it is."""

    script: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()
    no_python: bool = False

    def __post_init__(self) -> None:
        _check(
            not (self.script and self.module),
            "SCRIPT",
            self.script,
            f"give either a SCRIPT or -m {self.module}, not both",
        )
        _check(
            not self.no_python or bool(self.script),
            "--no-python",
            self.no_python,
            "give the executable to run as SCRIPT",
        )

    @property
    def effective_module(self) -> str | None:
        if self.script:
            return None
        return self.module or DEFAULT_MODULE

    def argv(self) -> tuple[str, ...]:
        """Arguments after ``python -u``: ``SCRIPT args`` or ``-m MODULE args``."""
        if self.script:
            return (self.script, *self.args)
        return ("-m", self.effective_module or DEFAULT_MODULE, *self.args)

    def name(self) -> str:
        return self.script or f"-m {self.effective_module}"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one ``elastic-train`` supervisor needs, validated."""

    min_nodes: int = option(
        1, "--min-nodes", parse=int, metavar="N", help="fewest nodes the job runs with"
    )
    max_nodes: int = option(
        1, "--max-nodes", parse=int, metavar="N", shown="--min-nodes", help="most nodes admitted"
    )
    nproc_per_node: int = option(
        1,
        "--nproc-per-node",
        "--nproc_per_node",
        pet="PET_NPROC_PER_NODE",
        metavar="N|auto",
        help="workers per node (auto: the allocation's GPUs, else its CPUs)",
    )
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = DEFAULT_PORT
    is_host: bool | None = None  # None: host the store when the endpoint is this machine
    # the address this node advertises for the rendezvous and, as rank 0, for MASTER_ADDR
    # (None: torch's default, the FQDN, which some pods cannot resolve)
    local_addr: str | None = option(
        None,
        "--local-addr",
        "--local_addr",
        pet="PET_LOCAL_ADDR",
        metavar="ADDR",
        shown="the FQDN",
        help="the address this node advertises to its peers",
    )
    job_id: str = option(
        "elastic-train",
        "--job-id",
        "--rdzv-id",
        "--rdzv_id",
        pet="PET_RDZV_ID",
        metavar="ID",
        help="id shared by all nodes of a job",
    )
    # the job's secret, the same on every node (None: the snapshot folder's, else one kept
    # privately for this user on this machine: supervisor/rendezvous/secret.py)
    rdzv_secret_file: str | None = option(
        None,
        "--rdzv-secret-file",
        metavar="PATH",
        shown="made in the snapshot folder, else kept privately for this user on this machine",
        help="file holding the job's secret, the same on every node",
    )
    # a snapshot folder whose finished.json says the job finished: run it again from its end
    # (off: exit 0 at once, nothing run; supervisor/finished.py)
    resume_finished: bool = option(
        False,
        "--resume-finished",
        kind=TOGGLE,
        help="run a job whose snapshot folder says it finished again, from its end (off: exit "
        "0 at once)",
    )
    rdzv: RendezvousTuning = field(default_factory=RendezvousTuning)
    restart: RestartTuning = field(default_factory=RestartTuning)
    max_restarts: int = option(
        3,
        "--max-restarts",
        "--max_restarts",
        parse=int,
        pet="PET_MAX_RESTARTS",
        metavar="N",
        help="failures tolerated (membership changes and preemptions are free)",
    )
    monitor_interval: float = option(
        0.2,
        "--monitor-interval",
        "--monitor_interval",
        parse=float,
        pet="PET_MONITOR_INTERVAL",
        metavar="S",
        help="seconds between worker checks",
    )
    hang_timeout: float = option(  # 0 disables the watchdog
        300.0,
        "--hang-timeout",
        parse=float,
        metavar="S",
        help="seconds without progress on any rank = hang (0 = off)",
    )
    # the workers' settings an operator chose (snapshots, logs, timeouts; WorkerSettings
    # declares each once); worker_settings() adds what the supervisor sets at each start
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    node: str = option(
        "localhost",
        "--node",
        metavar="NAME",
        shown="the hostname",
        help="this node's name in events",
    )
    entrypoint: Entrypoint = field(default_factory=Entrypoint)
    torchrun: TorchrunOptions = field(default_factory=TorchrunOptions)
    exit_barrier_timeout: float = 60.0
    resources_interval: float = 30.0
    control_root: str | None = None  # None: the system temp dir
    # Prometheus /metrics and /health (supervisor/metrics_server.py); None: not served
    metrics_port: int | None = option(
        None,
        "--metrics-port",
        parse=int,
        metavar="PORT",
        shown="off",
        help="serve Prometheus /metrics and /health on this port",
    )
    metrics_host: str = option(  # loopback unless the operator opens it up
        "127.0.0.1", "--metrics-host", metavar="ADDR", help="address the metrics server binds"
    )
    # workers forked from a pool that has imported torch (supervisor/warm/)
    warm_workers: bool = option(
        True,
        "--warm-workers",
        kind=TOGGLE,
        help="fork workers from a per-node pool that has imported torch",
    )
    # in-memory copies of the workers' state (worker.memory); off: storage snapshots only
    memory_tier: bool = option(
        True,
        "--memory-tier",
        kind=TOGGLE,
        help="keep state copies in node memory, so a failure costs at most one step",
    )
    # this node leaves the group while its rank straggles, when that pays (core/eviction.py)
    evict_stragglers: float | None = option(
        None,
        "--evict-stragglers",
        parse=slowdown_factor,
        metavar="SLOWDOWN",
        shown="off",
        help="leave the group while this node's rank is SLOWDOWN times slower than the "
        "others (e.g. 1.3) and leaving gains more than the re-forms cost",
    )
    evict_cooldown: float = option(
        300.0,
        "--evict-cooldown",
        parse=seconds(zero=True),
        metavar="S",
        help="seconds a node left out as a straggler waits before it joins again (once more, "
        "up to 3 in all, while its own CPU probe is still that slow)",
    )

    def __post_init__(self) -> None:
        self._check_nodes()
        self._check_times()
        self._check_metrics()
        _check(bool(self.job_id), "--job-id", self.job_id, "use a non-empty id shared by all nodes")
        _check(bool(self.rdzv_host), "--rdzv-endpoint", self.rdzv_host, "use HOST[:PORT]")
        _check(
            self.local_addr is None or bool(self.local_addr.strip()),
            "--local-addr",
            self.local_addr,
            "use this node's IP address or a name its peers resolve",
        )
        _check(
            isinstance(self.rdzv_port, int) and 0 < self.rdzv_port < 65536,
            "--rdzv-endpoint port",
            self.rdzv_port,
            "use a TCP port in 1..65535",
        )

    def _check_nodes(self) -> None:
        _check(
            isinstance(self.min_nodes, int) and self.min_nodes >= 1,
            "--min-nodes",
            self.min_nodes,
            "use an integer >= 1",
        )
        _check(
            isinstance(self.max_nodes, int) and self.max_nodes >= self.min_nodes,
            "--max-nodes",
            self.max_nodes,
            f"use an integer >= --min-nodes={self.min_nodes}",
        )
        _check(
            isinstance(self.nproc_per_node, int) and self.nproc_per_node >= 1,
            "--nproc-per-node",
            self.nproc_per_node,
            "use an integer >= 1 or 'auto'",
        )
        _check(
            isinstance(self.max_restarts, int) and self.max_restarts >= 0,
            "--max-restarts",
            self.max_restarts,
            "use an integer >= 0",
        )

    def _check_times(self) -> None:
        _positive("--monitor-interval", self.monitor_interval)
        _non_negative("--evict-cooldown", self.evict_cooldown)
        evict = self.evict_stragglers
        number = isinstance(evict, (int, float)) and math.isfinite(evict)
        _check(
            evict is None or (number and evict > 1),
            "--evict-stragglers",
            evict,
            "use a slowdown factor > 1, e.g. 1.3 (leave it out to never leave the group)",
        )
        _non_negative("--hang-timeout", self.hang_timeout)
        _positive("exit_barrier_timeout", self.exit_barrier_timeout)
        _positive("resources_interval", self.resources_interval)
        _check(
            self.hang_timeout == 0 or self.hang_timeout > self.monitor_interval,
            "--hang-timeout",
            self.hang_timeout,
            f"use 0 (off) or more than --monitor-interval={self.monitor_interval}",
        )

    def _check_metrics(self) -> None:
        _check(
            self.metrics_port is None
            or (isinstance(self.metrics_port, int) and 0 < self.metrics_port < 65536),
            "--metrics-port",
            self.metrics_port,
            "use a TCP port in 1..65535 (leave it out to serve no metrics)",
        )
        _check(
            bool(self.metrics_host.strip()),
            "--metrics-host",
            self.metrics_host,
            "use an address of this machine, e.g. 127.0.0.1 or 0.0.0.0",
        )

    def worker_settings(
        self, control_dir: str, memory_dir: str | None = None, *, mtbf_s: float | None = None
    ) -> WorkerSettings:
        """What every worker of this node is told (through its environment): the operator's
        settings, and ``memory_dir``: this supervisor's in-memory tier folder
        (``worker.memory.tier``); ``mtbf_s``: the job's mean time between failures observed
        so far (``--snapshot-every auto``)."""
        return dataclasses.replace(
            self.worker,
            job_id=self.job_id,
            node=self.node,
            control_dir=control_dir,
            memory_dir=memory_dir,
            mtbf_s=mtbf_s,
            log_format="console" if self.worker.log_format == "console" else "json",
        )

    @property
    def rdzv_endpoint(self) -> str:
        """HOST:PORT as --rdzv-endpoint takes it back: an IPv6 literal in brackets."""
        return format_endpoint(self.rdzv_host, self.rdzv_port)

    def summary(self) -> Mapping[str, Any]:
        """Fields of the ``supervisor.started`` event."""
        return {
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "nproc_per_node": self.nproc_per_node,
            "rdzv_endpoint": self.rdzv_endpoint,
            "entrypoint": self.entrypoint.name(),
            "max_restarts": self.max_restarts,
            "hang_timeout": self.hang_timeout,
            "grace_period": self.worker.grace_period_s,
            "snapshot_dir": self.worker.snapshot_dir,
            "warm_workers": self.warm_workers,
        }


# --- elastic-train's flags that are no single RunConfig field (supervisor/cli/args.py
# resolves each); the others are declared on RunConfig's and WorkerSettings' fields
NNODES = Setting(
    flags=("--nnodes",),
    pet="PET_NNODES",
    metavar="N|MIN:MAX",
    shown="--min-nodes:--max-nodes",
    help="torchrun's spelling of the node range; must agree with --min-nodes/--max-nodes",
)
RDZV_ENDPOINT = Setting(
    flags=("--rdzv-endpoint", "--rdzv_endpoint"),
    pet="PET_RDZV_ENDPOINT",
    metavar="HOST[:PORT]",
    shown=f"127.0.0.1:{DEFAULT_PORT}",
    help="the c10d store, hosted by this node when HOST is this machine (else "
    "PET_MASTER_ADDR:PET_MASTER_PORT)",
)
RDZV_BACKEND = Setting(
    flags=("--rdzv-backend", "--rdzv_backend"),
    pet="PET_RDZV_BACKEND",
    default="c10d",
    metavar="c10d|static",
    help="c10d, or static: torchrun's static rendezvous, run as a c10d one of fixed size",
)
RDZV_CONF = Setting(
    flags=("--rdzv-conf", "--rdzv_conf"),
    pet="PET_RDZV_CONF",
    metavar="k=v,...",
    shown="the recovery defaults below",
    help="rendezvous tuning; is_host=false joins an elastic-train store",
)
STANDALONE = Setting(
    flags=("--standalone",),
    kind=SWITCH,
    pet="PET_STANDALONE",
    help="one node, local store on a free port (an independent job)",
)
MODULE = Setting(
    flags=("-m", "--module"),
    own_env=False,
    parse=text,
    metavar="MODULE",
    shown=f"the built-in job, {DEFAULT_MODULE}",
    help="run a Python module instead of a script",
)
FLAG_ONLY = (NNODES, RDZV_ENDPOINT, RDZV_BACKEND, RDZV_CONF, STANDALONE)


def supervisor_flags() -> tuple[Setting, ...]:
    """Every flag of ``elastic-train`` itself, in ``--help``'s order (torchrun's others are
    ``supervisor/cli/torchrun_flags.py``'s)."""
    return (
        *flagged(RunConfig).values(),
        *FLAG_ONLY,
        *flagged(WorkerSettings).values(),
        MODULE,
    )
