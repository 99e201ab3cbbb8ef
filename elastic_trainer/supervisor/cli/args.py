"""argv + torchrun's ``PET_*`` environment -> a validated ``RunConfig``.

Precedence: a flag beats its ``PET_*`` variable, which beats our default. Every problem
raises ``ConfigError`` (one line, exit 2) before any process starts.

The command line is split by hand at the first positional word (SCRIPT) or at ``-m MODULE``:
everything after it belongs to the training script, so its own flags never collide with ours.
Without a SCRIPT, arguments after ``--`` go to the built-in job; a ``--`` right after SCRIPT
or ``-m MODULE`` is the same separator and is not passed on (the job's own parser would read
every flag after it as a positional word).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from elastic_trainer.cliparse import UNKNOWN_OPTION, OneLineParser
from elastic_trainer.contract import protocol, settings
from elastic_trainer.contract.config import (
    DEFAULT_MODULE,
    NNODES,
    RDZV_BACKEND,
    RDZV_CONF,
    RDZV_ENDPOINT,
    Entrypoint,
    RendezvousTuning,
    RunConfig,
    supervisor_flags,
)
from elastic_trainer.contract.endpoint import DEFAULT_PORT, parse_endpoint
from elastic_trainer.contract.protocol import WorkerSettings
from elastic_trainer.contract.settings import Setting, flagged, lookup
from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor.cli import torchrun_flags
from elastic_trainer.supervisor.cli.allocation import detect_local_workers

PROG = "elastic-train"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
# --rdzv-conf keys passed to torch's c10d backend as they are (ours are RendezvousTuning's).
_BACKEND_KEYS = {"is_host", "store_type"}


_RUN = flagged(RunConfig)  # RunConfig's fields an operator sets with a flag
# ... resolved with other flags in ``parse``; the rest are taken as they are
_RESOLVED_WITH_OTHERS = {"min_nodes", "max_nodes", "nproc_per_node", "local_addr", "job_id", "node"}
SUBCOMMANDS_HELP = """sub-commands (each has --help):
  elastic-train snapshots list|show|verify|export|prune URL   inspect and manage snapshots
  elastic-train report RUN                          what happened in a run, as a PNG
  elastic-train status RUN | --rdzv-endpoint H:P    is it running, where, at what step
  elastic-train store --host ADDR --port N          a standalone rendezvous store

elastic-train's own options also read ELASTIC_TRAIN_<NAME> (e.g. ELASTIC_TRAIN_SNAPSHOT_DIR), and
torchrun's read PET_<NAME>: a flag wins over its ELASTIC_TRAIN_* variable, which wins over
torchrun's PET_* and the default (docs/command-line.md lists each flag's variables)."""


def build_parser() -> argparse.ArgumentParser:
    from elastic_trainer import __version__

    p = OneLineParser(
        prog=PROG,
        usage=f"{PROG} [options] [SCRIPT | -m MODULE] [args...]",
        description="Fault-tolerant elastic training supervisor (a better torchrun).",
        epilog=SUBCOMMANDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    settings.add_flags(p, supervisor_flags())  # declared once: contract/config.py, protocol.py
    settings.add_flags(p, torchrun_flags.FLAGS)  # the rest of torchrun's command line
    return p


@dataclass(frozen=True, kw_only=True)
class SplitArgv:
    options: list[str]
    script: str | None
    module: str | None
    rest: list[str]


def _takes_value(parser: argparse.ArgumentParser) -> set[str]:
    return {
        opt
        for action in parser._actions  # argparse exposes no public list of options
        for opt in action.option_strings
        if action.nargs != 0
    }


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> SplitArgv:
    """Separate our options from SCRIPT / -m MODULE and the script's own arguments."""
    valued = _takes_value(parser)
    args = list(argv)
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            return SplitArgv(options=args[:i], script=None, module=None, rest=args[i + 1 :])
        if tok in ("-m", "--module"):
            if i + 1 >= len(args):
                raise ConfigError(f"{PROG}: -m needs a MODULE name")
            return SplitArgv(
                options=args[:i], script=None, module=args[i + 1], rest=_job_args(args[i + 2 :])
            )
        if tok.startswith("--module="):
            return SplitArgv(
                options=args[:i], script=None, module=tok[9:], rest=_job_args(args[i + 1 :])
            )
        if not tok.startswith("-") or tok == "-":
            return SplitArgv(
                options=args[:i], script=tok, module=None, rest=_job_args(args[i + 1 :])
            )
        i += 2 if tok in valued else 1
    return SplitArgv(options=args, script=None, module=None, rest=[])


def _job_args(rest: list[str]) -> list[str]:
    return rest[1:] if rest[:1] == ["--"] else rest


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """``k=v,k=v`` -> dict. Empty items are ignored; a malformed item is an error."""
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--rdzv-conf item {item!r} is invalid: use key=value,key=value")
        conf[key.strip()] = value.strip()
    return conf


def parse_nnodes(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise ConfigError(f"--nnodes={text!r} is invalid: use N or MIN:MAX") from None
    return low, high


def _parse_bool(name: str, value: str) -> bool:
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is invalid: use true or false")


def _number(name: str, value: str, kind: type) -> Any:
    try:
        return kind(value)
    except ValueError:
        wanted = "an integer" if kind is int else "a number"
        raise ConfigError(f"--rdzv-conf {name}={value!r} is invalid: use {wanted}") from None


def tuning_from_conf(conf: Mapping[str, str]) -> tuple[RendezvousTuning, bool | None]:
    """Our rendezvous defaults overridden by ``--rdzv-conf``; unknown keys are errors."""
    kinds = {f.name: (int if f.type in ("int", int) else float) for f in fields(RendezvousTuning)}
    values: dict[str, Any] = {}
    is_host: bool | None = None
    for key, raw in conf.items():
        if key == "is_host":
            is_host = _parse_bool(f"--rdzv-conf {key}", raw)
        elif key == "store_type":
            if raw.strip().lower() != "tcp":
                raise ConfigError(f"--rdzv-conf store_type={raw!r} is invalid: only tcp works")
        elif key in kinds:
            values[key] = _number(key, raw, kinds[key])
        else:
            known = ", ".join(sorted([*kinds, *_BACKEND_KEYS]))
            raise ConfigError(f"--rdzv-conf key {key!r} is unknown: use one of {known}")
    return RendezvousTuning(**values), is_host


def _as_int(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is invalid: use an integer") from None


def resolve_nodes(ns: argparse.Namespace, env: Mapping[str, str]) -> tuple[int, int]:
    """--min-nodes/--max-nodes and --nnodes must agree; PET_NNODES only fills gaps."""
    if ns.nnodes is not None:
        lo, hi = parse_nnodes(ns.nnodes)
        for flag, given, implied in (
            ("--min-nodes", ns.min_nodes, lo),
            ("--max-nodes", ns.max_nodes, hi),
        ):
            if given is not None and given != implied:
                raise ConfigError(
                    f"{flag}={given} contradicts --nnodes={ns.nnodes}: "
                    "give one spelling, or make them agree"
                )
        return lo, hi
    if ns.min_nodes is None and ns.max_nodes is None and env.get(NNODES.pet or ""):
        return parse_nnodes(env[NNODES.pet or ""])
    low = ns.min_nodes if ns.min_nodes is not None else _RUN["min_nodes"].default
    high = ns.max_nodes if ns.max_nodes is not None else max(low, 1)
    return low, high


def resolve_nproc(value: Any, env: Mapping[str, str] | None = None) -> int:
    """N, or auto|cpu|gpu counted from this node's allocation (supervisor/cli/allocation.py)."""
    if value is None:
        return int(_RUN["nproc_per_node"].default)
    text = str(value).strip()
    if text in ("auto", "cpu", "gpu"):
        return detect_local_workers(text, env)
    return _as_int("--nproc-per-node", text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_endpoint(ns: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, int]:
    if ns.standalone or env.get("PET_STANDALONE", "").lower() in _TRUE:
        return "127.0.0.1", _free_port()
    text = lookup(ns, env, RDZV_ENDPOINT)
    if not text and env.get("PET_MASTER_ADDR"):
        # Kubeflow's non-elastic PyTorchJob: the master pod hosts the store.
        text = f"{env['PET_MASTER_ADDR']}:{env.get('PET_MASTER_PORT', DEFAULT_PORT)}"
    return parse_endpoint(text) if text else ("127.0.0.1", DEFAULT_PORT)


def _check_standalone(ns: argparse.Namespace, lo: int, hi: int) -> None:
    """--standalone is one node on a private store: node counts other than 1 contradict it."""
    given = [f for f in ("min_nodes", "max_nodes", "nnodes") if getattr(ns, f) is not None]
    if given and (lo, hi) != (1, 1):
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ConfigError(
            f"--standalone runs exactly one node but {flags} asks for {lo}..{hi}: drop "
            "--standalone to run several nodes, or drop the node counts"
        )
    if ns.rdzv_endpoint is not None:
        raise ConfigError(
            "--standalone picks its own local store: drop --rdzv-endpoint, or drop --standalone"
        )


def _check_backend(ns: argparse.Namespace, env: Mapping[str, str]) -> str:
    backend = (lookup(ns, env, RDZV_BACKEND) or RDZV_BACKEND.default).strip().lower()
    if backend not in ("c10d", "static"):
        raise ConfigError(
            f"--rdzv-backend={backend!r} is not supported: use c10d (the default), or static "
            "(torchrun's, run as a fixed-size c10d rendezvous)"
        )
    return backend


def _static_rendezvous(
    ns: argparse.Namespace, env: Mapping[str, str], backend: str, nodes: tuple[int, int]
) -> torchrun_flags.StaticRendezvous | None:
    static = torchrun_flags.static_rendezvous(ns, env, backend=backend)
    if static is None:
        return None
    if ns.standalone:
        raise ConfigError(
            "--standalone picks its own local store: drop --node-rank/--master-addr/--master-port"
        )
    if nodes[0] != nodes[1]:
        raise ConfigError(
            f"torchrun's static rendezvous (--node-rank/--master-addr) has a fixed size but "
            f"--nnodes is {nodes[0]}:{nodes[1]}: give one number, or use --rdzv-endpoint for an "
            "elastic job"
        )
    if static.node_rank >= nodes[1]:
        raise ConfigError(f"--node-rank={static.node_rank} is invalid: use 0 .. {nodes[1] - 1}")
    return static


def _static_addr(static: torchrun_flags.StaticRendezvous | None) -> str | None:
    """Node rank 0 of torchrun's static mode is --master-addr by definition: advertise it
    (workers' MASTER_ADDR, as torchrun) rather than a hostname that may not resolve to it."""
    return static.host if static is not None and static.hosts_store else None


def env_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """Our options' ELASTIC_TRAIN_<NAME> variables, as parser defaults: argparse converts
    them like command-line values, and a flag still wins."""
    return settings.env_defaults(supervisor_flags(), env)


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> RunConfig:
    """The whole command line and environment -> RunConfig, or ConfigError."""
    env = os.environ if env is None else env
    parser = build_parser()
    parser.set_defaults(**env_defaults(env))
    split = split_argv(argv, parser)
    try:
        ns = parser.parse_args(split.options)
    except ConfigError as exc:
        raise _with_job_flag_hint(exc, split) from None
    torchrun_flags.refuse_unsupported(ns, env)
    backend = _check_backend(ns, env)
    lo, hi = resolve_nodes(ns, env)
    static = _static_rendezvous(ns, env, backend, (lo, hi))
    host, port = resolve_endpoint(ns, env)
    if static is not None and not lookup(ns, env, RDZV_ENDPOINT):
        host, port = static.host, static.port  # torchrun: MASTER_ADDR:MASTER_PORT
    if ns.standalone:
        _check_standalone(ns, lo, hi)
        lo, hi = 1, 1
    tuning, is_host = tuning_from_conf(parse_rdzv_conf(lookup(ns, env, RDZV_CONF)))
    if static is not None and is_host is None:
        is_host = static.hosts_store  # torchrun: node rank 0 hosts the store
    return with_run_folder(
        RunConfig(
            min_nodes=lo,
            max_nodes=hi,
            nproc_per_node=resolve_nproc(lookup(ns, env, _RUN["nproc_per_node"]), env),
            rdzv_host=host,
            rdzv_port=port,
            is_host=is_host,
            local_addr=lookup(ns, env, _RUN["local_addr"]) or _static_addr(static),
            job_id=lookup(ns, env, _RUN["job_id"]) or _RUN["job_id"].default,
            rdzv=tuning,
            **_given_fields(ns, env),
            node=ns.node or env.get(protocol.ENV_NODE) or socket.gethostname(),
            entrypoint=Entrypoint(
                script=split.script,
                module=split.module or ns.module,
                args=tuple(split.rest),
                no_python=bool(torchrun_flags.value(ns, env, "no_python")),
            ),
            torchrun=dataclasses.replace(
                torchrun_flags.options(ns, env),
                node_rank=static.node_rank if static is not None else None,
            ),
        )
    )


def _with_job_flag_hint(exc: ConfigError, split: SplitArgv) -> ConfigError:
    """``elastic-train --epochs 2``: the built-in job's (or a script's) flags go after ``--``.
    An option close to one of ours was a typo: the suggestion alone says it."""
    text = str(exc)
    if "unrecognized arguments" not in text and (
        UNKNOWN_OPTION not in text or "did you mean" in text
    ):
        return exc
    return ConfigError(
        f"{exc}; the training job's own flags go after `--` (elastic-train [options] -- "
        "--epochs 2) or after SCRIPT"
    )


def runs_builtin_job(cfg: RunConfig) -> bool:
    return cfg.entrypoint.script is None and cfg.entrypoint.effective_module == DEFAULT_MODULE


def with_run_folder(cfg: RunConfig, cwd: str | None = None) -> RunConfig:
    """The built-in job without --snapshot-dir keeps its run in ``runs/<job-id>/``: snapshots,
    exported models, and (without --log-file) one event log per node, which is what
    ``elastic-train report runs/<job-id>`` reads. User scripts get no such default."""
    if not runs_builtin_job(cfg) or cfg.worker.snapshot_dir:
        return cfg
    folder = os.path.join(cwd or os.getcwd(), "runs", _safe_name(cfg.job_id))
    log_file = cfg.worker.log_file or os.path.join(folder, f"events-{_safe_name(cfg.node)}.jsonl")
    worker = dataclasses.replace(cfg.worker, snapshot_dir=folder, log_file=log_file)
    return dataclasses.replace(cfg, worker=worker)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text) or "_"


def _given_fields(ns: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """The declared RunConfig and WorkerSettings fields given by a flag or a variable
    (the rest keep their declared defaults)."""
    out: dict[str, Any] = {}
    for name, how in _RUN.items():
        if name not in _RESOLVED_WITH_OTHERS:
            _put(out, name, how, lookup(ns, env, how))
    worker: dict[str, Any] = {}
    for name, how in flagged(WorkerSettings).items():
        _put(worker, name, how, getattr(ns, how.dest))
    out["worker"] = WorkerSettings(**worker)
    return out


def _put(out: dict[str, Any], name: str, how: Setting, raw: Any) -> None:
    if raw is not None:
        out[name] = how.read(raw)
