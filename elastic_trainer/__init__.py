"""elastic-train: fault-tolerant elastic training for PyTorch.

The worker-side public API (what a training script imports): ``WorkerContext``,
``ElasticSampler``, ``TrainingSession``, ``init_worker`` and the per-sample augmentation
seeds. Imports stay light: nothing here pulls in torch.distributed.elastic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module; loaded on first use so `import elastic_trainer` (the supervisor's CLI)
# does not pay for the worker runtime's imports.
_LAZY = {
    "WorkerContext": "elastic_trainer.runtime.context",
    "ElasticSampler": "elastic_trainer.runtime.sampler",
    "TrainingSession": "elastic_trainer.runtime.session",
    "init_worker": "elastic_trainer.runtime.distributed",
    "AugmentedDataset": "elastic_trainer.runtime.augment",
    "sample_generator": "elastic_trainer.runtime.augment",
    "sample_rng": "elastic_trainer.runtime.augment",
    "sample_seed": "elastic_trainer.runtime.augment",
    "AuditLog": "elastic_trainer.runtime.audit",
    "read_audit_log": "elastic_trainer.runtime.audit",
    "check_exactly_once": "elastic_trainer.runtime.audit",
}

if TYPE_CHECKING:
    from elastic_trainer.runtime.audit import AuditLog, check_exactly_once, read_audit_log
    from elastic_trainer.runtime.augment import (
        AugmentedDataset,
        sample_generator,
        sample_rng,
        sample_seed,
    )
    from elastic_trainer.runtime.context import WorkerContext
    from elastic_trainer.runtime.distributed import init_worker
    from elastic_trainer.runtime.sampler import ElasticSampler
    from elastic_trainer.runtime.session import TrainingSession


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_trainer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AuditLog",
    "AugmentedDataset",
    "ElasticSampler",
    "TrainingSession",
    "WorkerContext",
    "__version__",
    "check_exactly_once",
    "init_worker",
    "read_audit_log",
    "sample_generator",
    "sample_rng",
    "sample_seed",
]
