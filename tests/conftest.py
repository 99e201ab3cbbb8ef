"""Shared fixtures. Multi-process tests set OMP_NUM_THREADS=1: many processes share few cores."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests import machine_share

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, before it starts a worker: where the workers' machine locks are."""
    if not hasattr(node.config, "machine_share_dir"):
        node.config.machine_share_dir = machine_share.make_folder()
    node.workerinput[machine_share.WORKER_INPUT_KEY] = node.config.machine_share_dir


def pytest_unconfigure(config):
    if hasattr(config, "machine_share_dir"):
        machine_share.remove_folder(config.machine_share_dir)


# outside pytest-timeout's hook: the wait for the machine is not the test's time
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    folder = getattr(item.config, "workerinput", {}).get(machine_share.WORKER_INPUT_KEY)
    with machine_share.turn(folder, alone=item.get_closest_marker("alone") is not None):
        yield


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
