"""WorkerContext: everything a worker learns from its environment, validated once.

torchrun (and ``elastic-train``) describe the worker with RANK, WORLD_SIZE... ; the
supervisor adds ELASTIC_TRAIN_* (``elastic_trainer.contract.protocol``). With none of torchrun's
variables set, the context is a single process (world size 1), so a script also runs with
plain ``python script.py``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch

from elastic_trainer.contract import protocol
from elastic_trainer.contract.protocol import DEFAULT_COLLECTIVE_TIMEOUT_S, WorkerSettings
from elastic_trainer.errors import EnvironmentProblem

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "WorkerContext", "WorkerSettings"]
_SETTINGS = frozenset(f.name for f in fields(WorkerSettings))
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str | None = None
    # what elastic-train adds (protocol.WorkerSettings: the one contract with the supervisor)
    settings: WorkerSettings = field(default_factory=WorkerSettings)

    def __post_init__(self) -> None:
        _check(
            0 <= self.rank < self.world_size, f"RANK={self.rank}", f"WORLD_SIZE={self.world_size}"
        )
        _check(
            0 <= self.local_rank < self.local_world_size <= self.world_size,
            f"LOCAL_RANK={self.local_rank}, LOCAL_WORLD_SIZE={self.local_world_size}",
            f"WORLD_SIZE={self.world_size}",
        )
        if self.world_size > 1 and not (self.master_addr and self.master_port):
            raise EnvironmentProblem(
                f"WORLD_SIZE={self.world_size} but MASTER_ADDR/MASTER_PORT are not set; launch "
                "the script with elastic-train or torchrun"
            )

    # --- the supervisor's settings, as the worker uses them (the ones with a fallback here;
    # the rest through __getattr__) ------------------------------------------------------
    @property
    def job_id(self) -> str | None:
        return self.settings.job_id or self.run_id

    @property
    def node(self) -> str:
        return self.settings.node or socket.gethostname()

    def __getattr__(self, name: str) -> Any:
        """Every other setting of the supervisor's reads as the context's own
        (``ctx.snapshot_dir``, ``ctx.collective_timeout_s``...): each is declared once, as a
        field of ``WorkerSettings``, and never copied here."""
        if name in _SETTINGS:
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def is_distributed(self) -> bool:
        """Launched by torchrun/elastic-train (even at world size 1)."""
        return self.master_addr is not None

    @property
    def device(self) -> torch.device:
        """``cuda:<local_rank>`` when GPUs are visible, else CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def shared_gpu_problem(self, visible_gpus: int) -> str | None:
        """Why NCCL cannot start on this node, or None: with more ranks on the node than
        visible GPUs, ``device`` puts two ranks on one GPU, and NCCL refuses that (its
        'Duplicate GPU detected', raised in the first collective of every rank)."""
        if self.world_size == 1 or visible_gpus == 0 or self.local_world_size <= visible_gpus:
            return None
        return (
            f"{self.local_world_size} workers on this node but {visible_gpus} visible "
            f"GPU{'s' if visible_gpus > 1 else ''}: NCCL takes one GPU per rank; use "
            f"--nproc-per-node {visible_gpus} (or auto), or make more GPUs visible "
            "(CUDA_VISIBLE_DEVICES)"
        )

    @property
    def stop_file(self) -> str | None:
        return os.path.join(self.control_dir, protocol.STOP_FILE) if self.control_dir else None

    @property
    def restart_file(self) -> str | None:
        return os.path.join(self.control_dir, protocol.RESTART_FILE) if self.control_dir else None

    @property
    def progress_path(self) -> str | None:
        if not self.control_dir:
            return None
        return os.path.join(self.control_dir, protocol.progress_file(self.local_rank))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerContext:
        """Read and validate the environment; EnvironmentProblem names what is wrong."""
        env = os.environ if environ is None else environ
        return cls(**_launcher_fields(env), settings=WorkerSettings.from_env(env))


def _check(ok: bool, what: str, against: str) -> None:
    if not ok:
        raise EnvironmentProblem(
            f"inconsistent worker environment: {what} does not fit {against}; launch the "
            "script with elastic-train or torchrun, or unset these variables for a single process"
        )


def _launcher_fields(env: Mapping[str, str]) -> dict[str, object]:
    present = [name for name in _LAUNCHER_VARS if env.get(name)]
    if not present:
        return {}
    if len(present) != len(_LAUNCHER_VARS):
        missing = sorted(set(_LAUNCHER_VARS) - set(present))
        raise EnvironmentProblem(
            f"{', '.join(present)} set but {', '.join(missing)} missing; launch the script with "
            "elastic-train or torchrun, or unset them for a single process"
        )
    world = _get(env, "WORLD_SIZE", int)
    return {
        "rank": _get(env, "RANK", int),
        "local_rank": _get(env, "LOCAL_RANK", int),
        "world_size": world,
        "local_world_size": _get(env, "LOCAL_WORLD_SIZE", int, world),
        "group_rank": _get(env, "GROUP_RANK", int, 0),
        "master_addr": env.get("MASTER_ADDR") or None,
        "master_port": _get(env, "MASTER_PORT", int, None),
        "restart_count": _get(env, "TORCHELASTIC_RESTART_COUNT", int, 0),
        "max_restarts": _get(env, "TORCHELASTIC_MAX_RESTARTS", int, 0),
        "run_id": env.get("TORCHELASTIC_RUN_ID") or None,
    }


_MISSING = object()


def _get(env: Mapping[str, str], name: str, parse: Callable[[str], T], default: object = _MISSING):
    raw = env.get(name)
    if raw is None or raw == "":
        if default is _MISSING:
            raise EnvironmentProblem(f"{name} is not set; launch with elastic-train or torchrun")
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise EnvironmentProblem(f"{name}={raw!r} is not valid: {exc}") from exc
