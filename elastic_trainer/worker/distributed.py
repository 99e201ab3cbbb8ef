"""Process-group set-up and the few tiny collectives the session needs.

Kept apart from the session so a script can set up the group (and its DDP model) before it
builds the session: ``ctx = init_worker()``.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.errors import ConfigError
from elastic_trainer.logging import configure_logging
from elastic_trainer.worker.context import WorkerContext

_created_here = False  # only a group this module created is destroyed by shutdown()

# A rank other than 0 waits this long for rank 0's store to accept connections before it hands
# over to torch's own connect (which then retries, and fails, on its own terms).
STORE_WAIT_S = 10.0
STORE_POLL_S = 0.01


def init_worker(
    context: WorkerContext | None = None, *, configure_logs: bool = True
) -> WorkerContext:
    """Read the environment, configure logging and initialise the process group. Idempotent.

    gloo on CPU, NCCL on CUDA (device set from LOCAL_RANK), with the collective timeout from
    ``ELASTIC_TRAIN_COLLECTIVE_TIMEOUT`` (``--collective-timeout``; 300 s by default, not
    torch's 30 min). A group the script initialised itself is kept as is. A plain
    ``python script.py`` gets a world of one.

    Args:
        context: The worker's context. Default None: read from the environment the
            launcher set (``WorkerContext.from_env()``: elastic-train's, torchrun's, or none).
        configure_logs: Default True: this process logs elastic-train's events as JSON lines
            (console lines on a terminal), with its rank, node and job id. False: the
            script's own logging set-up is left alone.

    Returns:
        The worker's context: ``rank``, ``world_size``, ``local_rank``, ``device`` (use it
        for the model and the batches), the job id, node and settings.

    Raises:
        EnvironmentProblem: The launcher's environment is partial or inconsistent (for
            example ``WORLD_SIZE`` without ``MASTER_ADDR``), or a setting variable is invalid.
        ConfigError: More workers on this node than visible GPUs (NCCL takes one GPU per
            rank).
    """
    ctx = context or WorkerContext.from_env()
    if configure_logs:
        configure_logging(
            fmt=ctx.log_format,  # type: ignore[arg-type]
            log_file=ctx.log_file,
            group_access=ctx.settings.snapshot_group_access,
            static_fields={
                "job_id": ctx.job_id,
                "node": ctx.node,
                "rank": ctx.rank,
                "local_rank": ctx.local_rank,
                "restart_count": ctx.restart_count,
            },
        )
    if ctx.device.type == "cuda":
        if not dist.is_initialized() and (problem := ctx.shared_gpu_problem(gpu_count())):
            raise ConfigError(problem)
        torch.cuda.set_device(ctx.device)
    if not dist.is_initialized():
        _init_process_group(ctx)
    return ctx


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _init_process_group(ctx: WorkerContext) -> None:
    global _created_here
    _created_here = True
    timeout = datetime.timedelta(seconds=ctx.collective_timeout_s)
    if ctx.is_distributed:
        if ctx.rank != 0:
            wait_for_store(ctx.master_addr or "", ctx.master_port or 0, within_s=STORE_WAIT_S)
        # env:// reads MASTER_ADDR/PORT, RANK, WORLD_SIZE exactly as torchrun set them.
        dist.init_process_group(
            backend=ctx.backend,
            timeout=timeout,
            device_id=ctx.device if ctx.backend == "nccl" else None,
        )
        return
    # A world of one without a launcher: an in-memory store, no port to pick.
    dist.init_process_group(
        backend=ctx.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
    )


def wait_for_store(host: str, port: int, *, within_s: float) -> bool:
    """True once ``host:port`` accepts a TCP connection; False after ``within_s`` seconds, or
    at once on an error other than a refused connection (torch's connect then reports it).

    Why: the workers' store is hosted by the rank-0 worker itself (the supervisor sets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and a TCPStore client that finds the port still
    closed retries only after its connect backoff (about half a second); workers forked from
    the warm pool start within milliseconds of each other, so a rank that comes first often
    loses that backoff (docs/benchmarks.md, "Recovery, phase by phase": the worker-crash
    rows). Polling the port every 10 ms instead lets it
    connect as soon as the store listens. The probe connection is closed without a word, which
    the store server treats as a client that left.
    """
    deadline = time.monotonic() + within_s
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(left, STORE_POLL_S)).close()
            return True
        except (ConnectionRefusedError, TimeoutError):
            if left <= 0:
                return False
        except OSError:  # unresolvable, unreachable: nothing a wait fixes
            return False
        time.sleep(STORE_POLL_S)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_ints(values: list[int], op: Any = None) -> list[int]:
    """One all-reduce of a few int64s (SUM by default); no collective at world size 1."""
    if world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM)
    return [int(v) for v in tensor.tolist()]


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """One all-gather of a few int64s per rank (the same count on every rank): each rank's
    values, by rank; no collective at world size 1."""
    if world_size() == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.int64, device=collective_device())
    out = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(out, mine)
    return [[int(v) for v in t.tolist()] for t in out]


def send_bytes(data: Any, to: list[int], *, tag: int = 0) -> None:
    """Point to point: ``data`` (writable bytes-like, not empty) to each rank of ``to``, which
    must each ``recv_bytes_into`` a buffer of the same size with the same ``tag``. No pickle
    on either side."""
    if not to:
        return
    tensor = torch.frombuffer(data, dtype=torch.uint8).to(collective_device())
    for work in [dist.isend(tensor, dst, tag=tag) for dst in to]:
        work.wait()


def recv_bytes_into(buffer: Any, source: int, *, tag: int = 0) -> None:
    """Fill ``buffer`` (writable, bytes-like) with what ``source`` sends (``send_bytes``)."""
    host = torch.frombuffer(buffer, dtype=torch.uint8)
    device = collective_device()
    if device.type == "cpu":
        dist.recv(host, source, tag=tag)
        return
    staged = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    dist.recv(staged, source, tag=tag)
    host.copy_(staged)


def gather_problems(problem: str | None) -> list[tuple[int, str]]:
    """Collective: (rank, problem) for every rank that had one. Where none had (a restore's
    usual case) that is one all-reduce of a flag; the texts are gathered only after one did."""
    if not all_reduce_ints([int(problem is not None)], op=dist.ReduceOp.MAX)[0]:
        return []
    texts: list[Any] = [problem]
    if world_size() > 1:
        texts = [None] * world_size()
        dist.all_gather_object(texts, problem)
    return [(r, str(p)) for r, p in enumerate(texts) if p is not None]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """Leave together, then destroy the group if init_worker created it.

    Exiting with a live gloo group while a peer closes its sockets can abort the process
    (SIGABRT from gloo's background thread): the barrier makes every rank leave at once.
    """
    global _created_here
    if not (_created_here and dist.is_initialized()):
        return
    barrier()
    dist.destroy_process_group()
    _created_here = False
