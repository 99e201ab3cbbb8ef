"""Shared fixtures. Multi-process tests set OMP_NUM_THREADS=1: many processes share few cores."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def worker_env(tmp_path):
    return clean_worker_env()


def clean_worker_env() -> dict[str, str]:
    """A clean environment for subprocesses: single-threaded BLAS, no inherited torchrun vars."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "ELASTIC_TRAIN_"))
        and k
        not in {
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        }
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one (a file store in the test's folder), destroyed after."""
    store = dist.FileStore(str(tmp_path / "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
