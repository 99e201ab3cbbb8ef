"""The in-memory snapshot tier: the latest state copy of every node, in node-local memory.

Every ``memory_snapshot_every`` steps (default 1) the ranks of each node copy the state
straight into a slot file of the node's memory folder, a tmpfs the supervisor owns
(``WorkerSettings.memory_dir``: stable across worker restarts on one live agent, removed when
the supervisor exits), each rank about 1/L of the bytes (L: the node's ranks; the node's first
rank also copies the tensors that may differ between ranks, such as DDP's buffers). The slot
stays mapped from step to step (``slots``): one memory copy per tensor, checksummed
while it is still in the cache (``byte_layout.write_into``); no staging buffer. The
optimizer's parameters and state are copied by a background thread during the next
forward/backward, and its step waits for that (``MemoryTier.save``); the rest at the call.
(Staging buffers and a writer thread would add a second copy of every byte, and a thread
competing with training for the CPU.)
A node has two slot files: a copy overwrites the slot that does not
hold the newest whole copy, and each rank commits its part by atomically replacing a small
marker (step, byte range, checksum), without a collective; a copy is whole once every part
names its step, so a crash mid-copy never leaves a copy that is used, and a node never holds
more than two copies (the newest whole one and the one being written).

Replicated (DDP) state only: every node's copy holds the whole state and every rank's RNG,
so each node is the other nodes' mirror (``plan`` says how a restore is chosen).
Sharded (FSDP2) state keeps to storage snapshots (its per-rank shards would need a mirror).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import io
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from elastic_trainer.contract.events import emit
from elastic_trainer.private_files import NotOursError, open_file, open_private, private_dirs
from elastic_trainer.worker.distributed import (
    all_gather_ints,
    gather_problems,
    recv_bytes_into,
    send_bytes,
)
from elastic_trainer.worker.memory import byte_layout, leaf_checksum
from elastic_trainer.worker.memory.plan import RestorePlan, Source, shares
from elastic_trainer.worker.memory.plan import plan_restore as plan_restore
from elastic_trainer.worker.memory.slots import FailureStreak, StaleRead, refused
from elastic_trainer.worker.memory.slots import NodeCopies as NodeCopies
from snapshots.format.serialization import Stager, is_stateful
from snapshots.store import restore_into

# A rank's streams (RNG states) are a few KB; anything near this is not one of ours.
MAX_STREAMS_BYTES = 64 * 2**20


class RankStreams:
    """One rank's own per-rank state (its RNG streams), one small file per step in its node's
    folder, written by the rank itself: no collective per copy (an all-gather to the node's
    writer would cost more than the whole copy, and grows with the world size). A rank whose
    node lost its folder keeps its own streams, as a rank new to the world size does."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory, self.rank = os.path.join(directory, "ranks"), rank

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.rank}-{step:012d}.pt")

    def write(self, step: int, value: Mapping[str, Any], committed: int | None) -> None:
        """Write ``step``'s; drop those older than the node's committed copy (no longer of use)."""
        private_dirs(self.directory)
        tmp = f"{self._path(step)}.{uuid.uuid4().hex}.tmp"
        body = io.BytesIO()
        torch.save(dict(value), body)
        digest = byte_layout.checksum(body.getbuffer())
        with open_file(tmp, "xb") as f:  # "<algorithm> <checksum>" on a line, then torch.save's
            f.write(f"{byte_layout.CHECKSUM_ALGORITHM} {digest}\n".encode())
            f.write(body.getbuffer())
        os.replace(tmp, self._path(step))
        self.forget(lambda s: committed is not None and s < committed)

    def read(self, step: int) -> dict[str, Any] | None:
        """None where this rank has no streams of ``step``; ValueError for a damaged file."""
        try:
            with open_file(self._path(step), "rb") as f:
                data = f.read(MAX_STREAMS_BYTES + 1)
        except FileNotFoundError:
            return None
        except NotOursError as exc:  # damage to us: never read
            refused(exc)
            raise ValueError(str(exc)) from exc
        if len(data) > MAX_STREAMS_BYTES:
            raise ValueError(f"{self._path(step)} is over {MAX_STREAMS_BYTES} bytes")
        line, _, body = data.partition(b"\n")
        algorithm, _, digest = line.decode("ascii", "replace").partition(" ")
        if algorithm != byte_layout.CHECKSUM_ALGORITHM:  # no digest would be valid then
            digest = ""
        byte_layout.verify(body, digest, self._path(step))
        return torch.load(io.BytesIO(body), weights_only=True)

    def forget(self, which: Callable[[int], bool]) -> None:
        """Delete this rank's files of the steps ``which`` selects, and its leftover
        temporary files (only this rank writes them, never while this runs)."""
        prefix = f"{self.rank}-"
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                step = name[len(prefix) : len(prefix) + 12]
                if not (name.startswith(prefix) and step.isdigit()):
                    continue
                if name.endswith(".tmp") or which(int(step)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.directory, name))


LOCK_NAME = "node.lock"


@contextlib.contextmanager
def node_lock(directory: str) -> Iterator[None]:
    """The node's ranks one at a time (``flock``: released if the holder dies)."""
    private_dirs(directory)
    fd = open_private(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True, kw_only=True)
class MemoryRestored:
    step: int
    state: dict[str, Any]
    source: Source


class MemoryTier:
    """Collective: every rank of the group calls ``save`` and ``restore`` at the same step."""

    def __init__(self, directory: str, *, every: int) -> None:
        self.every = every
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._streams = RankStreams(directory, self.rank)
        part, parts = shares(self._all_gather(os.path.realpath(directory)))[self.rank]
        self.copies = NodeCopies(directory, part=part, parts=parts)
        # the just-in-time copy: one rank writes it all (``dump``), into a slot mapped ahead
        self._whole = NodeCopies(directory)
        self.is_writer = part == 0  # it tidies the node's folder after a restore
        self._walker = _TreeOnly()
        self._failures = FailureStreak(directory)
        self._copied: int | None = None  # the step of this rank's newest committed part
        # The rest of a copy whose optimizer-owned tensors are copied during the next
        # forward/backward (``save``); ``optimizer.step()`` waits for it.
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="memory-copy")
        self._in_flight: cf.Future[None] | None = None
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its pre-hook's handle

    # --- save -------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def dump(
        self,
        step: int,
        state: Mapping[str, Any],
        per_rank: Mapping[str, Any],
        *,
        valid: Callable[[], bool] | None = None,
    ) -> bool:
        """No collective, from any thread: this rank's per-rank state, and (unless the node
        already holds ``step`` or newer) the node's whole copy of ``step`` written by this
        rank alone, under the node's lock: the copy made just in time when the group ends
        (``on_failure``). True when the node holds it; a failure is reported, never raised.
        ``valid``: asked once the tensors are read, before the commit; False: not committed
        (a GPU that began the step while its state was read, ``on_failure._copy_held``)."""
        try:
            self.flush()
            self._streams.write(step, _plain(per_rank), None)
            with node_lock(self.copies.directory):
                newest = self._whole.newest()
                if newest is None or newest < step:
                    self._whole.write(step, self._payload(step, state), valid=valid)
        except StaleRead:
            return False
        except Exception as exc:  # tmpfs full, folder gone: storage stays the fallback
            self.failed(step, exc, "just-in-time copy: ")
            return False
        self._committed(step)
        return True

    def reserve(self, step: int, state: Mapping[str, Any]) -> None:
        """For the just-in-time copy, once training goes on (the optimizer's state exists):
        on the tier's thread, the slot that copy goes into gets its pages (the node's first
        rank to get here allocates them) and this rank maps it (``NodeCopies.reserve``), so
        that at a failure whichever rank writes the copy writes straight into pages that
        already exist (the cost of faulting them in at the failure is measured by
        ``bench/memory_copy_cost.py``), and a tmpfs too small
        for it says so now (``snapshot.memory_failed``), not at a failure. A copy that
        starts meanwhile waits for it (``flush``)."""
        layout = byte_layout.plan(self._payload(step, state))
        self.flush()
        self._in_flight = self._pool.submit(self._reserve, step, layout.size, layout.on_device)

    def _reserve(self, step: int, size: int, pin: bool) -> None:
        try:
            with node_lock(self.copies.directory):
                self._whole.reserve(size, pin=pin)
        except Exception as exc:  # training goes on; the copy at a failure tries again
            self.failed(step, exc, "reserving the just-in-time copy's memory: ")

    def _payload(self, step: int, state: Mapping[str, Any]) -> dict[str, Any]:
        """What a copy holds: the state's state_dicts (tensors referenced, not copied)."""
        return {"step": step, "world_size": self.world_size, "state": self._walker.capture(state)}

    def failed(self, step: int, exc: Exception, what: str) -> None:
        """``snapshot.memory_failed`` for this tier (once per streak)."""
        self._failures.failed(step, exc, what)

    def save(self, step: int, state: Mapping[str, Any], per_rank: Mapping[str, Any]) -> None:
        """No collective: every rank writes its per-rank state, then copies its part of the
        state into the node's slot being written and commits that part.

        With exactly one optimizer in ``state`` whose tensors are all on the CPU, only the
        other tensors (BatchNorm's statistics change in the next forward) are copied here;
        the optimizer's parameters and state (the bulk), the checksum and the commit follow
        on a background thread during the next forward/backward, and ``optimizer.step()``
        waits until they are done (a step pre-hook): the bulk of the copy overlaps the
        step's compute instead of adding to it. ``bench/snapshot_stall.py --kinds memory``
        measures what a copy every step costs (docs/benchmarks.md, "In-memory tier")."""
        self.flush()  # the previous copy's slot is committed (or failed) before this one
        self._streams.write(step, _plain(per_rank), self.copies.newest())
        payload = self._payload(step, state)
        optimizer = _overlappable(state)
        try:
            rest = self.copies.write(step, payload, _replicated(state), defer=optimizer is not None)
        except Exception as exc:  # tmpfs full, folder removed: storage stays the fallback
            self._failures.failed(step, exc)
            return
        if rest is None:
            self._committed(step)
            return
        if optimizer is not None:  # always, when the copy was deferred
            self._hook(optimizer)
        self._in_flight = self._pool.submit(self._finish, step, rest)

    def _finish(self, step: int, rest: Callable[[], None]) -> None:
        try:
            rest()
        except Exception as exc:
            self._failures.failed(step, exc)
            return
        self._committed(step)

    def _committed(self, step: int) -> None:
        self._failures.succeeded()
        self._copied = step

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self._hooks:
            self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(lambda *_: self.flush())

    def flush(self) -> None:
        """Wait for the copy in flight, if any (committed or failed once this returns)."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """The session's end: nothing runs between ranks here (``flush`` is all)."""
        self.flush()
        self._pool.shutdown(wait=True)
        self._whole.unmap()
        for handle in self._hooks.values():  # else the optimizer keeps this tier (and its
            handle.remove()  # slot mappings) alive for as long as it lives
        self._hooks.clear()

    def holds(self, step: int) -> bool:
        """Local: this rank committed its part of ``step``'s copy (the copy is whole once every
        rank of the node did: the caller agrees on it), or dumped it whole."""
        self.flush()
        return self._copied == step

    # --- restore ----------------------------------------------------------------------------
    def restore(
        self,
        into: Mapping[str, Any],
        rank_into: Mapping[str, Any],
        storage_newest: Callable[[], int | None] | None,
    ) -> tuple[RestorePlan, MemoryRestored | None]:
        """Collective. All ranks agree on a plan (``plan.plan_restore``); on a memory or
        mirror plan every rank loads, agrees on success, then restores. A copy that fails to
        load on any rank turns the plan into a storage one, on every rank, with the reason."""
        self.flush()
        copy = self.copies.newest_copy()
        mine, size = (None, 0) if copy is None else (copy.step, copy.size)
        newest = storage_newest() if self.rank == 0 and storage_newest is not None else None
        # what each node holds, storage's newest, and the size of each node's copy (a node
        # without the newest receives its source's copy: it makes room for it, no pickle)
        facts = all_gather_ints([_step_int(mine), _step_int(newest), size])
        held = [_int_step(f[0]) for f in facts]
        plan = plan_restore(held, _int_step(facts[0][1]))
        if plan.source is Source.STORAGE or plan.step is None:
            return plan, None
        payload, problem = self._load(plan, held, [f[2] for f in facts])
        try:  # before the agreement: then it may be gone
            streams = self._streams.read(plan.step)
        except Exception as exc:  # never raise here: the peers are in the agreement below
            streams, problem = None, problem or _one_line(exc)
        problems = gather_problems(problem)
        if problems:
            text = "; ".join(f"rank {r}: {p}" for r, p in problems)[:500]
            reason = f"the in-memory copy of step {plan.step} did not load ({text})"
            return RestorePlan(source=Source.STORAGE, step=None, reason=reason), None
        restore_into(into, payload["state"], step=plan.step)
        if streams is not None:  # else (a new rank, a node that lost it) it keeps its own
            restore_into(rank_into, streams, step=plan.step)
        source = plan.source_of(self.rank, held)
        emit(
            "snapshot.restored",
            step=plan.step,
            saved_world_size=payload["world_size"],
            world_size=self.world_size,
            source=source,
        )
        return plan, MemoryRestored(step=plan.step, state=payload["state"], source=source)

    def _load(
        self, plan: RestorePlan, held: list[int | None], sizes: list[int]
    ) -> tuple[Any, str | None]:
        """This node's copy, or (a mirror plan, a node without it) the source rank's copy,
        sent as its bytes point to point to the ranks without it (``mirror_message``):
        nothing received is unpickled; its skeleton is read with ``weights_only`` once its
        checksum matches."""
        step = cast(int, plan.step)
        if plan.source is not Source.MIRROR or (
            held[self.rank] == step and self.rank != plan.src_rank
        ):
            return self._read(step)
        src = cast(int, plan.src_rank)
        if self.rank == src:
            try:
                data = self.copies.read_bytes(step)
                payload, problem = self._checked_payload(byte_layout.read(data), step)
            except Exception as exc:  # the receivers must still get their bytes: see below
                data, payload, problem = None, None, _one_line(exc)
            lacking = [r for r, s in enumerate(held) if s != step]
            for tag, message in enumerate(mirror_message(data, sizes[src])):
                send_bytes(message, lacking, tag=tag)
            return cast(dict[str, Any], payload), problem
        received = byte_layout.read_buffer(sizes[src])
        digest = bytearray(leaf_checksum.DIGEST_SIZE)
        recv_bytes_into(received, src, tag=0)
        recv_bytes_into(digest, src, tag=1)
        try:
            data = checked_mirror_message(received, bytes(digest), f"the copy from rank {src}")
            return self._checked_payload(byte_layout.read(data), step)
        except Exception as exc:
            return cast(dict[str, Any], None), _one_line(exc)

    @staticmethod
    def _checked_payload(payload: dict[str, Any], step: int) -> tuple[Any, str | None]:
        """``payload`` if it is the copy of ``step`` (the marker said so; the bytes must too)."""
        if payload.get("step") != step:
            return None, f"the copy of step {step} says step {payload.get('step')}"
        return payload, None

    def _read(self, step: int) -> tuple[Any, str | None]:
        try:
            return self._checked_payload(self.copies.read(step), step)
        except Exception as exc:  # any failure means "use storage"; raising would strand peers
            return None, _one_line(exc)

    def after_restore(self, step: int | None) -> None:
        """Collective-free: the node's first rank drops copies other than the restored step's
        (a copy newer than the step the group resumed from belongs to an abandoned future);
        every rank lets go of its slot mappings (a removed file's pages stay while mapped)."""
        self.copies.unmap()
        if self.is_writer:
            self.copies.keep_only(step)
        self._streams.forget(lambda s: step is None or s != step)

    def _all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out


def _overlappable(state: Mapping[str, Any]) -> torch.optim.Optimizer | None:
    """The state's optimizer, if it has exactly one and its parameters and state are all on
    the CPU (a CUDA tensor's copy to the host is left on the training thread, in its stream
    order); then those tensors change only at its step, and may be copied until then."""
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    if len(optimizers) != 1:
        return None
    (optimizer,) = optimizers
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for per_param in optimizer.state.values():
        tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return optimizer if all(t.device.type == "cpu" for t in tensors) else None


def _replicated(state: Mapping[str, Any]) -> Callable[[torch.Tensor], bool]:
    """Which tensors are equal on every rank, so the node's ranks may split their copy: the
    parameters and optimizer state of the state's optimizers (DDP keeps them in step). Buffers
    are not (BatchNorm's running statistics are each rank's own until the next forward)."""
    ptrs = set()
    for value in state.values():
        if isinstance(value, torch.optim.Optimizer):
            ptrs.update(p.data_ptr() for group in value.param_groups for p in group["params"])
            for per_param in value.state.values():
                ptrs.update(v.data_ptr() for v in per_param.values() if torch.is_tensor(v))
    return lambda t: t.data_ptr() in ptrs


class _TreeOnly(Stager):
    """The stager's walk and its checks (what the weights-only loader reads back), without
    its copies: ``NodeCopies.write`` copies the tensors straight into the slot."""

    def _stage(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        odd = tensor.layout != torch.strided or tensor.is_quantized
        if odd or tensor.is_nested or tensor.is_meta:
            return super()._stage(tensor, path)  # refused, or cloned into the skeleton
        return tensor.detach()


# A step (>= 0) or None, as an int64 of a collective.
_NONE = -1


def mirror_message(data: Any, size: int) -> tuple[Any, bytearray]:
    """What the source of a mirror restore sends, in two messages: the copy's ``size`` bytes,
    then their checksum (``leaf_checksum``, 16 bytes). Where its own read failed (``data``
    None, or not ``size`` bytes) it sends zeros all the same, which no receiver takes (they
    fail the checksum), so that no receiver waits for bytes that never come; the problem is
    agreed right after."""
    if data is None or len(data) != size:
        return bytearray(size), bytearray(leaf_checksum.DIGEST_SIZE)
    return data, bytearray.fromhex(leaf_checksum.checksum(data))


def checked_mirror_message(data: Any, digest: bytes, what: str) -> Any:
    """``data`` once it matches ``digest`` (``mirror_message``); ValueError otherwise."""
    byte_layout.compare(leaf_checksum.checksum(data), digest.hex(), what)
    return data


def _step_int(step: int | None) -> int:
    return _NONE if step is None else step


def _int_step(value: int) -> int | None:
    return None if value == _NONE else value


def _one_line(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _plain(per_rank: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in per_rank.items()}
