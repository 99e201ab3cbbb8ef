"""``torch.multiprocessing.spawn`` for the dist tests, through a fork server that imports
torch and the workers' modules once per test process: each rank then starts as a fork of
it (milliseconds) instead of a fresh interpreter importing torch (seconds of CPU per rank
and per phase, on a 2-core CI machine). The fork server is a process of its own, started
before any thread or process group of the tests, so nothing but imports is forked."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "tests.dist.memory_shard_workers"]


def spawn(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, join: bool = True) -> Any:
    multiprocessing.set_forkserver_preload(PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
