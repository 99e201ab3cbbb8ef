"""What the supervisor hands its workers besides torchrun's variables: our environment and a
fresh control directory per attempt (stop file, progress files; ``elastic_trainer.protocol``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from elastic_trainer.config import RunConfig

# Workers run their script through this module (see its docstring: a clean interpreter exit)
BOOTSTRAP_MODULE = "elastic_trainer.supervisor.bootstrap"


def set_worker_env(cfg: RunConfig, control_dir: str) -> None:
    """Put this attempt's settings into our environment, which torch hands to the workers."""
    cfg.worker_settings(control_dir).apply_to(os.environ)


def worker_args(cfg: RunConfig) -> tuple[str, ...]:
    """Arguments after the Python executable: unbuffered, through the bootstrap."""
    return ("-u", "-m", BOOTSTRAP_MODULE, *cfg.entrypoint.argv())


def make_control_root(cfg: RunConfig) -> str:
    base = cfg.control_root or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"elastic-train-{os.getpid()}-", dir=base)


def new_control_dir(root: str, attempt: int) -> str:
    """An empty ``attempt-N`` folder; the previous attempt's is removed (stale stop files)."""
    path = os.path.join(root, f"attempt-{attempt}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    shutil.rmtree(os.path.join(root, f"attempt-{attempt - 1}"), ignore_errors=True)
    return path
