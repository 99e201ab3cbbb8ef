"""Page-locking a slot's mapping for the GPU (``cudaHostRegister``), so that a state on the
device is copied into it at the link's speed: on an H200 a 1 GiB ``copy_`` from the GPU into
the mapped slot took 0.067 s pageable and 0.019 s registered (docs/benchmarks.md, the
just-in-time copy by the size of the state). Registering costs ~0.036 s per GiB, paid when
the slot is mapped (ahead of a failure: ``MemoryTier.reserve``), not when it is copied into.

Only in a process whose CUDA runtime is already up: this never initialises CUDA (a warm
pool's process must not, and a CPU job has none). A registration the driver refuses (a slot
on a disk rather than tmpfs: its pages cannot be locked for long, seen on an H200 as
cudaErrorInvalidValue) leaves the mapping pageable: the copy is slower, never wrong. The
refusal also stays behind as the thread's last CUDA error, which torch's next kernel launch
check raises as its own ("invalid argument", seen on the H200): torch binds no call that
clears it, so it is cleared through the CUDA runtime torch loaded, and where that library
cannot be found (a torch linked with a static runtime) nothing is registered at all.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from elastic_trainer.contract.events import emit

_refused: set[int] = set()  # error codes already reported, once each per process


def cuda_in_use() -> bool:
    """Whether this process runs CUDA already (never starts it)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def register(mapped: torch.Tensor) -> bool:
    """Page-lock the memory of ``mapped`` (a uint8 CPU tensor over a mapping) for the device;
    True when it is. Call ``unregister`` with the same tensor before the mapping goes."""
    if mapped.numel() == 0 or not cuda_in_use() or runtime_library() is None:
        return False
    code = int(torch.cuda.cudart().cudaHostRegister(mapped.data_ptr(), mapped.numel(), 0))
    if code != 0:
        clear_last_error()
        if code not in _refused:
            _refused.add(code)
            emit(
                "snapshot.memory_unpinned",
                level="warning",
                bytes=mapped.numel(),
                error=f"cudaHostRegister returned {code}: copies from the GPU into node "
                "memory go through pageable memory (slower)",
            )
        return False
    return True


def unregister(mapped: torch.Tensor) -> None:
    """Undo ``register`` (before the mapping is closed)."""
    torch.cuda.cudart().cudaHostUnregister(mapped.data_ptr())


def clear_last_error() -> None:
    """``cudaGetLastError`` on this thread: forget a refusal (see the module's docstring)."""
    library = runtime_library()
    if library is not None:
        library.cudaGetLastError()


@functools.cache
def runtime_library() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (with torch), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if line.count(" ") >= 5}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libcudart.so"):
            try:
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            except OSError:
                return None
    return None
