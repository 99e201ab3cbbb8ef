"""Capture state into reused staging buffers; bytes in and out without executing code.

``Stager.capture`` walks a state tree, copies every tensor into a preallocated buffer that it
keeps for the next save (copying into memory already touched is many times faster than into
fresh memory, which page-faults on every page), and rejects values that
``torch.load(weights_only=True)`` could not read back, at the call rather than at restore time.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import mmap
import pickle
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from snapshots.errors import SnapshotCorruptError, UnsafeStateError
from snapshots.format import manifest
from snapshots.sharded import torch_compat
from snapshots.storage.local import DIRECT_ALIGN
from snapshots.write import shared_staging

# Values copied as they are (matched by exact type) and the types a mapping's keys may have:
# what torch.load(weights_only=True) reads back. tests/unit/snapshots/format/test_weights_only.py
# checks that every state the stager accepts round-trips through it.
PLAIN_TYPES = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)
KEY_TYPES = (str, int, float, bool, type(None))


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


class Stager:
    """Copies state trees into buffers reused across saves (one save in flight at a time).
    ``shared``: the buffers are on shared memory where the platform has it
    (``shared_staging``), so the writer process can serialise them (``_writer_process``)."""

    def __init__(self, *, shared: bool = False) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        use_arena = shared and shared_staging.available()
        self._arena = shared_staging.SharedArena() if use_arena else None
        self._stranded = 0  # bytes of arena buffers replaced (a tensor changed shape or dtype)
        self._defer: frozenset[int] = frozenset()
        self.deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, source)
        self._copying = threading.Condition()
        self._in_copy = 0  # deferred copies under way

    def capture_overlapped(
        self, state: Mapping[str, Any], optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Like capture, but tensors that change only at ``optimizer.step()`` (its parameters
        and its state) are left in ``deferred`` for ``copy_deferred`` to copy later."""
        self._defer = frozenset(_optimizer_tensor_ptrs(optimizer))
        self.deferred = []
        try:
            return self.capture(state)
        finally:
            self._defer = frozenset()

    def copy_deferred(self) -> None:
        """Copy what is left in ``deferred``; returns once every deferred copy is done.
        Safe from two threads at once (the writer, and the training thread in the optimizer
        hook): each tensor is copied by one of them, so training never waits on a writer
        that a busy machine (or its lower CPU priority) keeps off the CPU."""
        with torch.no_grad():
            while (item := self._take_deferred()) is not None:
                buf, source = item
                try:
                    buf.copy_(source)
                finally:
                    with self._copying:
                        self._in_copy -= 1
                        self._copying.notify_all()
        with self._copying:
            self._copying.wait_for(lambda: self._in_copy == 0)

    def _take_deferred(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._copying:
            if not self.deferred:
                return None
            self._in_copy += 1
            return self.deferred.pop()

    def capture(self, state: Mapping[str, Any], *, prefix: tuple[Any, ...] = ()) -> dict[str, Any]:
        if not state:
            # Readers refuse a snapshot without entries (it would restore nothing).
            raise UnsafeStateError("state is empty: a snapshot needs at least one entry")
        out: dict[str, Any] = {}
        with torch.no_grad():
            for key, value in state.items():
                if not isinstance(key, str):
                    raise UnsafeStateError(f"state keys must be str, got {key!r}")
                tree = value.state_dict() if is_stateful(value) else value
                out[key] = self.copy_tree(tree, (*prefix, key))
        return out

    def copy_tree(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._stage(obj, path)
        if isinstance(obj, Mapping):
            return self._copy_mapping(obj, path)
        # Exact types: a subclass (an IntEnum, numpy.float64, a str subclass) pickles as its
        # own class, which the weights-only loader refuses.
        if type(obj) in PLAIN_TYPES or type(obj) is torch.Size:
            return obj
        if type(obj) in (list, tuple):
            return type(obj)(self.copy_tree(v, (*path, i)) for i, v in enumerate(obj))
        raise UnsafeStateError(
            f"state{_fmt(path)} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
            "cannot be loaded back without executing code; store plain values (numbers, "
            "strings, tensors, lists, dicts) or give it a state_dict()"
        )

    def _copy_mapping(self, obj: Mapping[Any, Any], path: tuple[Any, ...]) -> Any:
        metadata = getattr(obj, "_metadata", None)
        # Only an OrderedDict carries attributes through pickling (and the loader).
        ordered = isinstance(obj, OrderedDict) or metadata is not None
        out: dict[Any, Any] = OrderedDict() if ordered else {}
        for k, v in obj.items():
            if type(k) not in KEY_TYPES:
                raise UnsafeStateError(f"state{_fmt(path)} has a key of type {type(k).__name__}")
            out[k] = self.copy_tree(v, (*path, k))
        if metadata is not None:
            # nn.Module.state_dict() keeps per-module versions here (BatchNorm needs them).
            out._metadata = self.copy_tree(metadata, (*path, "_metadata"))  # type: ignore[attr-defined]
        return out

    def _stage(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.is_nested or tensor.is_meta:
            kind = "a nested tensor" if tensor.is_nested else "a meta tensor (no data)"
            raise UnsafeStateError(f"state{_fmt(path)} is {kind}, which snapshots cannot hold")
        if tensor.layout != torch.strided or tensor.is_quantized:
            if type(tensor) is not torch.Tensor:  # pickles as its own class: refused on load
                raise UnsafeStateError(
                    f"state{_fmt(path)} is a sparse or quantized {type(tensor).__qualname__}; "
                    "store a plain torch.Tensor"
                )
            return tensor.clone()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = self._new_buffer(tensor.shape, tensor.dtype, replacing=buf)
            self._buffers[path] = buf
        if tensor.data_ptr() in self._defer and tensor.device.type == "cpu":
            self.deferred.append((buf, tensor))
        else:
            buf.copy_(tensor)
        return buf

    def _new_buffer(
        self, shape: torch.Size, dtype: torch.dtype, *, replacing: torch.Tensor | None
    ) -> torch.Tensor:
        if self._arena is None:
            return staging_buffer(shape, dtype)
        if replacing is not None:
            # The arena never frees one buffer: once replaced ones outweigh the live ones,
            # start a new arena, every buffer reallocated there as it is next staged.
            self._stranded += replacing.numel() * replacing.element_size()
            if self._stranded > self.staged_bytes:
                self._arena, self._stranded = shared_staging.SharedArena(), 0
                self._buffers.clear()
        return self._arena.tensor(shape, dtype)

    @property
    def staged_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


# Staging buffers from this size up get pages of their own (an anonymous mapping; on shared
# staging memory, ``shared_staging``, every buffer does), outside the malloc heap the
# training loop allocates its activations and gradients from. In that
# heap, the long-lived buffers placed by the first save change how glibc reuses and trims
# it, so that every later training step faults in fresh pages.
OWN_PAGES_BYTES = 1 << 16


def staging_buffer(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones on their own pages, outside the malloc heap."""
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < OWN_PAGES_BYTES:
        return torch.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes)  # freed with the tensor's storage, which keeps it alive
    return torch.frombuffer(pages, dtype=dtype, count=shape.numel()).view(shape)


def _optimizer_tensor_ptrs(optimizer: torch.optim.Optimizer) -> set[int]:
    ptrs = {p.data_ptr() for group in optimizer.param_groups for p in group["params"]}
    for per_param in optimizer.state.values():
        ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
    return ptrs


def _fmt(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)


def serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch_compat.save_without_crc32(obj, buf, alignment=DIRECT_ALIGN)
    return buf.getvalue()


def serialize_into(obj: Any, sink: Any, algorithm: str) -> tuple[int, str]:
    """``torch.save`` straight into ``sink`` (a file), hashed on the way in one pass:
    (size, hex digest) of exactly the bytes written. The same bytes as ``serialize``:
    a ``torch.save`` file without CRCs, its tensors at page-aligned offsets (see
    ``torch_compat.save_without_crc32``), which ``torch.load`` reads as any other."""
    with cf.ThreadPoolExecutor(1, thread_name_prefix="snapshot-hash") as pool:
        hashing = _Hashing(sink, algorithm, pool)
        torch_compat.save_without_crc32(obj, hashing, alignment=DIRECT_ALIGN)
    return hashing.size, hashing.hasher.hexdigest()


# Records from this size up are hashed on a second thread while the sink writes them.
OVERLAP_BYTES = 1 << 20


class _Hashing:
    """A write-only file that hashes what passes through it. torch.save hands over each
    tensor's storage as one memoryview (no copy). A large one is hashed on ``pool``'s
    thread while the sink writes it: both only read the staging buffer, the hash and the
    write (an O_DIRECT one mostly waits for the disk) release the GIL, so the save takes
    the longer of the two instead of their sum (it counts most on the job's tail, which
    waits for the last save)."""

    def __init__(self, sink: Any, algorithm: str, pool: cf.Executor | None = None) -> None:
        self._sink = sink
        self._pool = pool
        self.hasher = manifest.hasher(algorithm)
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        hashed = self._hash_aside(view) if len(view) >= OVERLAP_BYTES else None
        if hashed is not None:
            try:
                self._sink.write(view)
            finally:
                hashed.result()  # in order: the next record is hashed after this one
        else:
            self.hasher.update(view)
            self._sink.write(view)
        self.size += len(view)
        return len(view)

    def _hash_aside(self, view: memoryview) -> cf.Future[None] | None:
        if self._pool is None:
            return None
        try:
            return self._pool.submit(self.hasher.update, view)
        except RuntimeError:  # interpreter exit (a save flushed at exit): hash it here
            return None

    def flush(self) -> None:
        pass  # the sink is flushed and fsynced by its storage once torch.save returns


def deserialize(data: bytes, *, what: str) -> Any:
    """Load bytes with the weights-only unpickler: no code from storage ever runs."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        ImportError,
        KeyError,
        IndexError,
    ) as exc:
        raise SnapshotCorruptError(
            f"{what} cannot be loaded safely (weights_only): {refusal(exc)}"
        ) from exc


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torch's error wraps what it refused in advice to load with weights_only=False, or to allow
# the global: neither is ever right for a snapshot read from storage.
_ADVICE = re.compile(
    r"weights_only\W+(set to\W+)?false|safe_globals|trusted source|check the documentation"
    r"|file an issue|two options|we changed the default|^\(\d\)",
    re.IGNORECASE,
)


def refusal(exc: BaseException) -> str:
    """The part of a load error that names what was refused, without torch's advice."""
    text = _ANSI.sub("", str(exc))
    text = text.split("WeightsUnpickler error:", 1)[-1]
    for line in text.splitlines():
        sentences = [p.strip() for p in line.split(". ") if p.strip()]
        kept = [p for p in sentences if not _ADVICE.search(p) and "load failed" not in p]
        if kept:
            return kept[0].rstrip(".")[:300]  # the first sentence names it; the rest advises
    return f"the loader refused it ({type(exc).__name__})"
