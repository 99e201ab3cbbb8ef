"""``torch.multiprocessing.spawn`` for the dist tests, through a fork server that imports
torch and the workers' modules once per test process: each rank then starts as a fork of
it (milliseconds) instead of a fresh interpreter importing torch (seconds of CPU per rank
and per phase, on a 2-core CI machine). The fork server is a process of its own, started
before any thread or process group of the tests, so nothing but imports is forked."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "tests.dist.memory_shard_workers"]


def spawn(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, join: bool = True) -> Any:
    multiprocessing.set_forkserver_preload(PRELOAD)
    try:
        return mp.start_processes(fn, args, nprocs, join, start_method="forkserver")
    except ChildProcessError:
        # The fork server is gone and someone else reaped it: a test that ran the supervisor
        # in this process (it reaps and kills its children) took it, and the standard
        # library, which asks waitpid whether its server lives, cannot tell and start another.
        server = forkserver._forkserver  # type: ignore[attr-defined]
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = server._forkserver_address = None
        server._forkserver_pid = None
        return mp.start_processes(fn, args, nprocs, join, start_method="forkserver")
