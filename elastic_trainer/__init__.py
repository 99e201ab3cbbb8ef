"""elastic-train: fault-tolerant elastic training for PyTorch.

The worker-side public API (what a training script imports) is re-exported here as it lands:
``WorkerContext``, ``ElasticSampler``, ``TrainingSession``.
"""

from __future__ import annotations

__version__ = "0.1.0"
