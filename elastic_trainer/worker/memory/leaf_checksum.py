"""The in-memory tier's checksum: xxh3_128 of each 16 MiB leaf of the bytes, then xxh3_128 of
the leaves' digests in order. The leaves are independent, so a large copy is checksummed by
several threads at once.

Why not one xxh3_128 over all the bytes: one thread hashes at the speed of one core's memory
reads, which a copy of a state on the GPU has to wait for. On an H200 machine (16 cores) a
10.7 GB state's copy into node memory took 0.17 s per GB with the copy from the device
running beside one hashing thread, and its read 0.22 s per GB; one thread's checksum was
most of both (docs/benchmarks.md, the just-in-time copy by the size of the state).

The name (``ALGORITHM``, the commit marker's key) says the leaf size: a copy checksummed
otherwise (another leaf size, the plain xxh3_128 of earlier versions) names another
algorithm and is not used, as any copy with no valid checksum.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Sequence
from typing import Any

import xxhash

LEAF_BYTES = 16 << 20
ALGORITHM = "xxh3_128-leaves-16MiB"
DIGEST_SIZE = 16
MAX_THREADS = 8  # a node's ranks copy and read at once: 8 each is plenty beside them


def worker_threads() -> int:
    """Threads for one copy or read: the CPUs this process may run on, at most MAX_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def leaves(start: int, stop: int) -> list[tuple[int, int]]:
    """The leaves of bytes [start, stop): LEAF_BYTES each from ``start``, the last shorter;
    one empty leaf for no bytes."""
    if start >= stop:
        return [(start, start)]
    return [(a, min(a + LEAF_BYTES, stop)) for a in range(start, stop, LEAF_BYTES)]


def leaf(data: Any) -> bytes:
    """One leaf's digest (``data``: bytes-like; the hashing runs without the GIL)."""
    return bytes(xxhash.xxh3_128_digest(data))


def combine(digests: Sequence[bytes]) -> str:
    """The checksum from the leaves' digests, in order."""
    return str(xxhash.xxh3_128_hexdigest(b"".join(digests)))


def checksum(data: Any, *, threads: int | None = None) -> str:
    """The checksum of ``data`` (bytes-like), its leaves hashed by up to ``threads`` threads
    (``worker_threads()`` by default)."""
    view = memoryview(data).cast("B")
    try:
        spans = leaves(0, len(view))
        threads = min(len(spans), worker_threads() if threads is None else threads)
        if threads <= 1:
            return combine([leaf(view[a:b]) for a, b in spans])
        with cf.ThreadPoolExecutor(threads, thread_name_prefix="memory-checksum") as pool:
            return combine(list(pool.map(lambda span: leaf(view[span[0] : span[1]]), spans)))
    finally:
        view.release()


class Hasher:
    """The checksum of bytes given in order, piece by piece (``update``), in this thread."""

    digest_size = DIGEST_SIZE

    def __init__(self) -> None:
        self._done: list[bytes] = []
        self._leaf = xxhash.xxh3_128()
        self._in_leaf = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        try:
            at = 0
            while at < len(view):
                take = min(LEAF_BYTES - self._in_leaf, len(view) - at)
                self._leaf.update(view[at : at + take])
                self._in_leaf, at = self._in_leaf + take, at + take
                if self._in_leaf == LEAF_BYTES:
                    self._done.append(bytes(self._leaf.digest()))
                    self._leaf, self._in_leaf = xxhash.xxh3_128(), 0
        finally:
            view.release()

    def hexdigest(self) -> str:
        last = [bytes(self._leaf.digest())] if self._in_leaf or not self._done else []
        return combine(self._done + last)


class RangeDigest:
    """The checksum of ``view[start:stop]``, whose bytes become final in order (``advance``).
    ``parallel``: each leaf is hashed on a pool of threads as soon as its bytes are final,
    while the caller goes on writing the next ones; else in this thread at each ``advance``
    (a piece just written is still in this core's cache). Use as a context manager: the pool
    is shut down on leaving."""

    def __init__(self, view: Any, start: int, stop: int, *, parallel: bool) -> None:
        self._view, self._stop = view, stop
        self._spans = leaves(start, stop)
        self._next = 0  # the first leaf not yet handed out
        self._serial = None if parallel else Hasher()
        self._done_to = start  # bytes [start, done_to) given to the serial hasher
        self._pool = (
            cf.ThreadPoolExecutor(worker_threads(), thread_name_prefix="memory-checksum")
            if parallel
            else None
        )
        self._futures: list[cf.Future[bytes]] = []

    def advance(self, final_to: int) -> None:
        """Bytes up to ``final_to`` are written and will not change."""
        final_to = min(final_to, self._stop)
        if self._serial is not None:
            if final_to > self._done_to:
                self._serial.update(self._view[self._done_to : final_to])
                self._done_to = final_to
            return
        assert self._pool is not None
        while self._next < len(self._spans) and self._spans[self._next][1] <= final_to:
            a, b = self._spans[self._next]
            self._futures.append(self._pool.submit(leaf, self._view[a:b]))
            self._next += 1

    def hexdigest(self) -> str:
        """The checksum, once every byte is final (``advance(stop)`` first)."""
        if self._serial is not None:
            return self._serial.hexdigest()
        if self._next < len(self._spans):
            raise RuntimeError("RangeDigest.hexdigest before all its bytes are final")
        return combine([f.result() for f in self._futures])

    def __enter__(self) -> RangeDigest:
        return self

    def __exit__(self, *_: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
