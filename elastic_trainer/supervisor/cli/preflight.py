"""Entrypoint preflight: let a training script refuse a bad configuration before any worker
starts, without the supervisor knowing anything about it.

A script or module may define, at top level::

    def preflight(argv: list[str], world_sizes: list[int]) -> list[str] | None:
        '''Raise to refuse (one line: the problem and the fix); return warnings.'''

``argv`` is what its workers will get; ``world_sizes`` every world size the job may run at
(``--nproc-per-node`` x each node count from ``--min-nodes`` to ``--max-nodes``). The
supervisor finds the function by reading the source (nothing runs if there is none), then
calls it in a process of its own (``python -m elastic_trainer.entrypoints.preflight ...``)
that imports the entrypoint under a name other than ``__main__``: training code behind the
usual ``if __name__ == "__main__":`` guard does not run. A refusal is exit 2 with its one
line before any worker starts, instead of a crash in every worker.

That process is forked from the warm pool where there is one (``WarmPool.run``): the pool
imports torch and the job's modules for the workers anyway, and a fresh interpreter doing
the same beside it doubled the supervisor's start (seconds on a loaded machine). Without a
pool, or where it cannot fork, it is a fresh ``python``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from elastic_trainer.contract.config import Entrypoint
from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor.warm.launcher import WarmPool, WarmPoolUnavailable

FUNCTION = "preflight"
# the child that imports the entrypoint and calls its preflight
PREFLIGHT_MODULE = "elastic_trainer.entrypoints.preflight"
ENV_WORLD_SIZES = "ELASTIC_TRAIN_PREFLIGHT_WORLD_SIZES"
# importing torch, a model and a dataset index: generous, but bounded
TIMEOUT_S = 180.0


def source_of(entry: Entrypoint) -> str | None:
    """The entrypoint's source file (None: not found, or not Python source)."""
    if entry.script:
        return entry.script
    try:
        spec = importlib.util.find_spec(entry.effective_module or "")
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


def defines_preflight(path: str) -> bool:
    """True if the file defines ``preflight`` at top level (read, not run)."""
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return False  # the worker itself will report an unreadable script
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == FUNCTION
        for node in tree.body
    )


def run(
    entry: Entrypoint,
    world_sizes: Sequence[int],
    *,
    timeout_s: float = TIMEOUT_S,
    pool: WarmPool | None = None,
) -> list[str]:
    """Call the entrypoint's preflight, if it has one; its warnings, or ConfigError."""
    if entry.no_python:
        return []  # an executable, not Python source
    path = source_of(entry)
    if path is None or not defines_preflight(path):
        return []
    env = {**os.environ, ENV_WORLD_SIZES: ",".join(map(str, world_sizes))}
    argv = ["-m", PREFLIGHT_MODULE, *entry.argv()]
    try:
        done = _forked(pool, argv, env, timeout_s)
        if done is None:
            done = subprocess.run(
                [sys.executable, *argv],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"the preflight of {entry.name()} did not finish within {timeout_s:.0f} s: make its "
            f"{FUNCTION}() check flags and data only"
        ) from None
    return _answer(entry, done)


def _forked(
    pool: WarmPool | None, argv: list[str], env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str] | None:
    """The preflight run in a fork of the warm pool; None where there is none to ask."""
    if pool is None:
        return None
    try:
        return pool.run(argv, env, timeout_s)
    except WarmPoolUnavailable:  # said so in warm_pool.unavailable; workers start fresh too
        return None


def _answer(entry: Entrypoint, done: subprocess.CompletedProcess[str]) -> list[str]:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    try:
        answer = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"the preflight of {entry.name()} failed: {last}") from None
    if answer.get("error"):
        raise ConfigError(str(answer["error"]))
    if answer.get("exit", 1) in (0, None):  # the job's own --help: printed, and all it asked
        print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("{")))
        raise SystemExit(0)
    if "exit" in answer:  # the script's argument parser exited: its last line says why
        last = (done.stderr.strip().splitlines() or [f"exit {answer['exit']}"])[-1]
        raise ConfigError(f"{entry.name()} refused its arguments: {last}")
    return [str(w) for w in answer.get("warnings") or []]
