"""The GPU tier: every test here is marked ``gpu`` and skipped, with one line saying why, on a
machine where torch sees no CUDA device. Run it with ``bench/gpu_check.sh``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.workers.harness import cleanup

HERE = Path(__file__).parent
NO_GPU = "no CUDA device visible to torch (torch.cuda.is_available() is False)"
# NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected").
ONE_RANK_PER_GPU = "needs 2 GPUs: NCCL takes one rank per GPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available = torch.cuda.is_available()
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not available:
                item.add_marker(pytest.mark.skip(reason=NO_GPU))


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def agents():
    """Agents a test started; their whole process trees are killed afterwards."""
    started: list = []
    yield started
    cleanup(started)


@pytest.fixture
def record(request):
    """``record(**figures)``: one JSON line per call in ``$GPU_RESULTS`` (bench/gpu_check.sh
    prints them), with the test, the device and the torch version."""

    def write(**figures: Any) -> None:
        path = os.environ.get("GPU_RESULTS")
        if not path:
            return
        row = {
            "test": request.node.nodeid,
            "device": torch.cuda.get_device_name(0),
            "gpus": gpu_count(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **figures,
        }
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    return write
