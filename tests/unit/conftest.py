"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one (a file store in the test's folder), destroyed after."""
    store = dist.FileStore(str(tmp_path / "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
