"""Shared fixtures. Multi-process tests set OMP_NUM_THREADS=1: 2 cores, many processes."""

from __future__ import annotations

import os

import pytest

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
