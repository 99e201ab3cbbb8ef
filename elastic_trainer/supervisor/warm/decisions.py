"""Pure decisions of the warm pool: which commands it serves, what it preloads, when a worker
must start fresh instead. No I/O but reading a script's source to list its imports."""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Mapping, Sequence

from elastic_trainer.contract.config import RunConfig
from elastic_trainer.supervisor.processes.workerenv import BOOTSTRAP_MODULE

# Imported by every worker anyway; importing them has no side effect worth the name.
BASE_MODULES = ("torch", "torch.distributed", "torch.distributed.elastic.multiprocessing.errors")
# Top-level imports of a user script preloaded in the pool: packages known to do nothing at
# import but define things. Anything else the script imports runs in the worker, as before.
OWN_PACKAGES = frozenset({"elastic_trainer", "snapshots"})
# What a job that imports elastic_trainer reaches through its lazy attributes
# (``elastic_trainer.TrainingSession``): the session imports the snapshot store and with it
# torch.distributed.checkpoint (seconds of imports per worker: ``bench/worker_start.py``),
# which ``import elastic_trainer`` alone does not.
SESSION_MODULES = ("elastic_trainer.worker.session",)
SAFE_ROOTS = frozenset({"torch", "torchvision", "numpy", *OWN_PACKAGES})
# Variables read when the interpreter or torch's native libraries load: a worker whose value
# differs from the pool's must start fresh to see its own.
IMPORT_TIME_PREFIXES = (
    *("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO_"),  # thread pools (GOTO_: OpenBLAS)
    *("PYTHON", "LD_", "MALLOC_"),
)
# The folder that holds our packages (``elastic_trainer`` and ``snapshots`` sit side by side).
_PACKAGES_ROOT = os.path.dirname(
    os.path.dirname(os.path.abspath(sys.modules["elastic_trainer"].__file__ or ""))
)


def pool_argv(entrypoint: str, args: Sequence[str], *, executable: str) -> list[str] | None:
    """The argv the bootstrap would get (``SCRIPT args`` / ``-m MODULE args``) if this
    command is ``python -u -m bootstrap ...``; None for anything else (``--no-python``)."""
    head = ("-u", "-m", BOOTSTRAP_MODULE)
    if entrypoint != executable or tuple(args[:3]) != head or len(args) < 4:
        return None
    return [str(a) for a in args[3:]]


def modules_to_preload(argv: Sequence[str]) -> list[str]:
    """torch, plus what this job imports at its top level that is known to be safe to import
    early. A module run with ``-m`` is not imported itself: runpy would then run a second copy
    of it as ``__main__`` (and warn); its imports are, when it is one of ours."""
    extra: list[str] = []
    if argv and argv[0] == "-m":
        source = own_module_file(argv[1]) if len(argv) > 1 else None
        extra = script_imports(source) if source else []
    elif argv:
        extra = script_imports(argv[0])
    if any(name.split(".")[0] == "elastic_trainer" for name in extra):
        extra = [*extra, *SESSION_MODULES]
    return list(dict.fromkeys([*BASE_MODULES, *extra]))


def own_module_file(name: str) -> str | None:
    """The source file of one of our modules (``elastic_trainer.*``, ``snapshots.*``),
    found without importing anything; None for anyone else's."""
    parts = name.split(".")
    if parts[0] not in OWN_PACKAGES:
        return None
    base = os.path.join(_PACKAGES_ROOT, *parts)
    for path in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(path):
            return path
    return None


def script_imports(path: str) -> list[str]:
    """Modules a script imports at its top level whose package is in ``SAFE_ROOTS``
    (``from a import b`` names both ``a`` and, should it be a module, ``a.b``)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return [n for n in dict.fromkeys(names) if n.split(".")[0] in SAFE_ROOTS]


def import_env_mismatch(pool_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """Import-time variables the worker would see differently from the pool (sorted)."""
    keys = {k for k in (*pool_env, *worker_env) if k.startswith(IMPORT_TIME_PREFIXES)}
    return sorted(k for k in keys if pool_env.get(k) != worker_env.get(k))


def pool_refusal(cfg: RunConfig, *, subreaper: bool) -> str | None:
    """Why this supervisor runs no warm pool, or None."""
    if not cfg.warm_workers:
        return "--no-warm-workers"
    if cfg.entrypoint.no_python:
        return "--no-python: workers are not Python"
    if not subreaper:  # forked workers would be re-parented to init, out of our reach
        return "the supervisor is not a child subreaper (Linux only)"
    return None
