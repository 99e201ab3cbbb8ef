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
    "WorkerContext": "elastic_trainer.worker.context",
    "ElasticSampler": "elastic_trainer.worker.sampler",
    "TrainingSession": "elastic_trainer.worker.session",
    "init_worker": "elastic_trainer.worker.distributed",
    "AugmentedDataset": "elastic_trainer.worker.augment",
    "sample_generator": "elastic_trainer.worker.augment",
    "sample_rng": "elastic_trainer.worker.augment",
    "sample_seed": "elastic_trainer.worker.augment",
    "AuditLog": "elastic_trainer.worker.audit",
    "read_audit_log": "elastic_trainer.worker.audit",
    "check_exactly_once": "elastic_trainer.worker.audit",
}

if TYPE_CHECKING:
    from elastic_trainer.worker.audit import AuditLog, check_exactly_once, read_audit_log
    from elastic_trainer.worker.augment import (
        AugmentedDataset,
        sample_generator,
        sample_rng,
        sample_seed,
    )
    from elastic_trainer.worker.context import WorkerContext
    from elastic_trainer.worker.distributed import init_worker
    from elastic_trainer.worker.sampler import ElasticSampler
    from elastic_trainer.worker.session import TrainingSession


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
