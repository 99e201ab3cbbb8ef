"""torchrun's command line, flag for flag: what each one means under elastic-train.

A torchrun user switches by changing one word, so every flag of the installed torch's
``torch.distributed.run`` parser is accepted, in both spellings, with its ``PET_*`` variable
(``tests/unit/supervisor/cli/test_torchrun_flags.py`` compares with ``get_args_parser()``, so a
flag added by a torch release is noticed). Each flag is honoured with torchrun's meaning,
mapped onto ours, or — only where we cannot honour it — refused with one line saying why and
what to use instead; its torchrun default is always accepted. Never "unrecognized".

Static rendezvous (``--node-rank``, ``--master-addr``, ``--master-port``,
``--rdzv-backend static``) is mapped onto a c10d rendezvous with a fixed node count at
``MASTER_ADDR:MASTER_PORT``, hosted by node rank 0: the world does not change size, and the
job keeps our restarts, snapshots, preemption and events. Group ranks are assigned by that
rendezvous (node rank 0 is the store host, not necessarily group rank 0).

This module is pure: it reads a parsed namespace and the environment, never torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic_trainer.contract.config import DEFAULT_SHUTDOWN_TIMEOUT_S, TorchrunOptions
from elastic_trainer.contract.settings import SWITCH, VALUE, Setting
from elastic_trainer.errors import ConfigError

TORCHRUN_MASTER_PORT = 29500  # torchrun's static default port
START_METHODS = ("spawn", "fork", "forkserver")
SIGNALS_WE_HANDLE = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's default set
_STD = re.compile(r"^([0-3]|\d+:[0-3](,\d+:[0-3])*)$")  # torch's Std.from_str syntax
_RANKS = re.compile(r"^\d+(,\d+)*$")


def _flag(
    *names: str,
    takes_value: bool = True,
    help: str = "",
    refused: str | None = None,
    torchrun_default: Any = None,
    shown: str | None = None,
    metavar: str | None = None,
) -> Setting:
    """One torchrun flag, read from its ``PET_*`` variable (never ``ELASTIC_TRAIN_*``); its
    value is kept as text (checked in ``options``). A refused flag's help says why."""
    dest = next(n for n in names if n.startswith("--")).lstrip("-").replace("-", "_")
    return Setting(
        flags=names,
        kind=VALUE if takes_value else SWITCH,
        help=help or f"only torchrun's default is accepted: {refused}",
        refused=refused,
        accepted=torchrun_default,
        default=torchrun_default,
        shown=shown,
        metavar=metavar,
        own_env=False,
        pet=f"PET_{dest.upper()}",
    )


# torchrun's flags that the supervisor's own parser (args.py) does not define already.
FLAGS: tuple[Setting, ...] = (
    _flag(
        "--node-rank",
        "--node_rank",
        metavar="N",
        torchrun_default="0",
        help="torchrun static mode: this node's rank; rank 0 hosts the store",
    ),
    _flag(
        "--master-addr",
        "--master_addr",
        metavar="ADDR",
        torchrun_default="127.0.0.1",
        help="torchrun static mode: the store's address",
    ),
    _flag(
        "--master-port",
        "--master_port",
        metavar="PORT",
        torchrun_default=str(TORCHRUN_MASTER_PORT),
        help="torchrun static mode: the store's port",
    ),
    _flag(
        "--log-dir",
        "--log_dir",
        metavar="DIR",
        shown="a private folder removed at exit",
        help="per-rank log files (torchrun's layout)",
    ),
    _flag(
        "-r",
        "--redirects",
        torchrun_default="0",
        help="redirect worker std streams to --log-dir files (0-3, or LOCAL_RANK:0-3,...)",
    ),
    _flag(
        "-t",
        "--tee",
        torchrun_default="0",
        help="tee worker std streams to --log-dir files and the console (0-3)",
    ),
    _flag(
        "--local-ranks-filter",
        "--local_ranks_filter",
        metavar="RANKS",
        shown="every rank",
        help="console output of these local ranks only",
    ),
    _flag(
        "--log-line-prefix-template",
        "--log_line_prefix_template",
        metavar="TEMPLATE",
        shown="[${role_name}${local_rank}]:",
        help="prefix of tee'd lines",
    ),
    _flag("--role", torchrun_default="trainer", help="worker role name"),
    _flag(
        "--start-method",
        "--start_method",
        metavar="|".join(START_METHODS),
        torchrun_default="spawn",
        help="accepted; workers run the script as processes already",
    ),
    _flag(
        "--run-path",
        "--run_path",
        takes_value=False,
        help="accepted: scripts run this way already",
    ),
    _flag("--no-python", "--no_python", takes_value=False, help="run SCRIPT as an executable"),
    _flag(
        "--shutdown-timeout",
        "--shutdown_timeout",
        metavar="S",
        shown=f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g}",
        help="seconds from SIGTERM to SIGKILL when workers are stopped for a restart",
    ),
    _flag(
        "--signals-to-handle",
        "--signals_to_handle",
        refused="elastic-train handles SIGTERM, SIGINT and SIGUSR1 itself (a stop with a final "
        "snapshot); drop the flag",
        torchrun_default=",".join(SIGNALS_WE_HANDLE),
    ),
    _flag(
        "--event-log-handler",
        "--event_log_handler",
        refused="elastic-train logs its own structured events (docs/events-and-metrics.md), not "
        "torch's event handlers; drop the flag",
        torchrun_default="null",
    ),
    _flag(
        "--logs-specs",
        "--logs_specs",
        refused="custom LogsSpecs plugins are not supported; use --log-dir, --redirects, --tee",
    ),
    _flag(
        "--numa-binding",
        "--numa_binding",
        refused="NUMA binding is not supported yet; bind with numactl inside the worker command",
    ),
    _flag(
        "--virtual-local-rank",
        "--virtual_local_rank",
        takes_value=False,
        refused="virtual local ranks are not supported yet; set CUDA_VISIBLE_DEVICES per worker",
        torchrun_default=False,
    ),
    _flag(
        "--duplicate-stdout-filters",
        "--duplicate_stdout_filters",
        refused="output filters are not supported yet; use --log-dir with --tee",
    ),
    _flag(
        "--duplicate-stderr-filters",
        "--duplicate_stderr_filters",
        refused="output filters are not supported yet; use --log-dir with --tee",
    ),
    _flag(
        "--print-completion",
        "--print_completion",
        refused="shell completion is not provided; use elastic-train --help",
    ),
)
BY_DEST = {f.dest: f for f in FLAGS}


@dataclass(frozen=True, kw_only=True)
class StaticRendezvous:
    """torchrun's static mode, as the c10d rendezvous it becomes here."""

    host: str
    port: int
    node_rank: int

    @property
    def hosts_store(self) -> bool:
        return self.node_rank == 0


def value(ns: Any, env: Mapping[str, str], dest: str) -> Any:
    """The flag's value, else its PET_* variable (flags win, as in torchrun)."""
    given = getattr(ns, dest, None)
    if given is not None and given is not False:
        return given
    raw = env.get(BY_DEST[dest].env)
    return raw if raw not in (None, "") else None


def given_or_default(ns: Any, env: Mapping[str, str], dest: str) -> Any:
    """``value``, else (none, or empty) the flag's declared default (torchrun's)."""
    found = value(ns, env, dest)
    return found if found not in (None, "") else BY_DEST[dest].default


def refuse_unsupported(ns: Any, env: Mapping[str, str]) -> None:
    """One line for the first flag we cannot honour with the value given."""
    for flag in FLAGS:
        if flag.refused is None:
            continue
        given = value(ns, env, flag.dest)
        if given is None or given is False or _same(given, flag.accepted):
            continue
        raise ConfigError(f"{flag.flag}={given!r} cannot be honoured: {flag.refused}")


def _same(given: Any, default: Any) -> bool:
    if default is None:
        return False
    return str(given).replace(" ", "") == str(default).replace(" ", "")


def options(ns: Any, env: Mapping[str, str]) -> TorchrunOptions:
    """The honoured flags, validated: one line naming the flag for a bad value."""
    redirects = _std("--redirects", given_or_default(ns, env, "redirects"))
    tee = _std("--tee", given_or_default(ns, env, "tee"))
    log_dir = value(ns, env, "log_dir")
    if (redirects != "0" or tee != "0") and not log_dir:
        raise ConfigError(
            "--redirects/--tee write per-rank files: give --log-dir DIR for them (torchrun would "
            "pick a temporary folder you would not find)"
        )
    start = value(ns, env, "start_method")
    if start is not None and start not in START_METHODS:
        raise ConfigError(f"--start-method={start!r} is invalid: use one of {START_METHODS}")
    return TorchrunOptions(
        log_dir=log_dir,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=_ranks(value(ns, env, "local_ranks_filter")),
        log_line_prefix_template=value(ns, env, "log_line_prefix_template"),
        role=given_or_default(ns, env, "role"),
        shutdown_timeout=_seconds(value(ns, env, "shutdown_timeout")),
    )


def static_rendezvous(
    ns: Any, env: Mapping[str, str], *, backend: str | None
) -> StaticRendezvous | None:
    """torchrun's static mode, if the command line asks for it (None: it does not)."""
    flags_given = any(getattr(ns, d, None) is not None for d in ("node_rank", "master_addr"))
    if backend != "static" and not flags_given:
        return None
    host = given_or_default(ns, env, "master_addr")
    port = _int("--master-port", given_or_default(ns, env, "master_port"))
    rank = _int("--node-rank", given_or_default(ns, env, "node_rank"))
    if rank < 0:
        raise ConfigError(f"--node-rank={rank} is invalid: use 0 .. --nnodes - 1")
    return StaticRendezvous(host=host, port=port, node_rank=rank)


def _std(flag: str, text: str) -> str:
    text = str(text).replace(" ", "")
    if not _STD.match(text):
        raise ConfigError(
            f"{flag}={text!r} is invalid: use 0-3 (none, stdout, stderr, both) or "
            "LOCAL_RANK:0-3,... as torchrun"
        )
    return text


def _ranks(text: Any) -> frozenset[int] | None:
    if text is None:
        return None
    text = str(text).replace(" ", "")
    if not _RANKS.match(text):
        raise ConfigError(
            f"--local-ranks-filter={text!r} is invalid: use a comma-separated list of local "
            "ranks, e.g. 0,1"
        )
    return frozenset(int(r) for r in text.split(","))


def _seconds(text: Any) -> float | None:
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigError(f"--shutdown-timeout={text!r} is invalid: use seconds") from None
    if seconds < 0:
        raise ConfigError(f"--shutdown-timeout={text!r} is invalid: use seconds >= 0")
    return seconds


def _int(flag: str, text: Any) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag}={text!r} is invalid: use an integer") from None
