"""Reading a slot file of the in-memory tier back into private memory, fast: a pool of
threads fills the buffer piece by piece and checksums each leaf (``leaf_checksum``) as soon
as the pieces under it have landed.

A restore's read is three passes over the copy when done one after another: the kernel
zeroes the buffer's pages (faulted in one at a time, or all at once by ``MAP_POPULATE``, on
one core either way), copies the file into them, and the checksum reads them again. Here
each thread faults in and fills its own pieces (the page faults run on every core), and the
leaves are hashed beside them: on a 2-core VM 1 GiB took 0.63 s in one thread, 0.30-0.35 s
so (``bench/memory_copy_cost.py``, "read 1 thread" and "read").

The buffer is private anonymous memory, never a mapping of the slot: the bytes checksummed
are the bytes used, whatever writes the slot afterwards (``byte_layout.read_buffer``).
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
from collections import deque
from collections.abc import Sequence

from elastic_trainer.private_files import open_file
from elastic_trainer.worker.memory import byte_layout, leaf_checksum

# The unit of work of one thread: large enough that a piece costs far more than handing it
# out, small enough that hashing starts soon after the first lands and a state of tens of
# MB is still shared out (16 MiB read 1 GiB in 0.30 s on 2 cores, 64 MiB in 0.33 s).
PIECE_BYTES = 16 << 20


def pieces(size: int) -> list[tuple[int, int]]:
    """[start, stop) of each piece of ``size`` bytes, in order."""
    piece = PIECE_BYTES
    return [(start, min(start + piece, size)) for start in range(0, size, piece)]


def read_file(
    path: str,
    size: int,
    ranges: Sequence[tuple[int, int]] = (),
    *,
    threads: int | None = None,
    what: str = "",
) -> tuple[bytearray | mmap.mmap, list[str]]:
    """The first ``size`` bytes of the file at ``path`` (ours alone: ``open_file``) in private
    memory, and the checksum (``byte_layout.CHECKSUM_ALGORITHM``) of each of ``ranges``
    (byte ranges of it, in any order, overlapping or not). ValueError when the file holds
    fewer than ``size`` bytes by the time it is read (changed while it was read).

    One pool of ``threads`` threads does both: pieces are handed out a few at a time, and
    each range's leaves join the queue as soon as the pieces below their end have landed."""
    threads = leaf_checksum.worker_threads() if threads is None else max(1, threads)
    data = byte_layout.read_buffer(size, populate=threads == 1)
    spans = [leaf_checksum.leaves(lo, hi) for lo, hi in ranges]
    view = memoryview(data)
    try:
        with open_file(path, "rb") as f:
            if threads == 1:
                for start, stop in pieces(size):
                    _fill(f.fileno(), view, start, stop, what)
                digests = [[leaf_checksum.leaf(view[a:b]) for a, b in s] for s in spans]
                return data, [leaf_checksum.combine(d) for d in digests]
            with cf.ThreadPoolExecutor(threads, thread_name_prefix="memory-read") as pool:
                return data, _read_in(pool, threads, f.fileno(), view, size, spans, what)
    finally:
        view.release()


def _read_in(
    pool: cf.ThreadPoolExecutor,
    threads: int,
    fd: int,
    view: memoryview,
    size: int,
    spans: list[list[tuple[int, int]]],
    what: str,
) -> list[str]:
    todo = deque(pieces(size))
    filling: deque[tuple[int, cf.Future[None]]] = deque()  # (piece's stop, its fill), in order
    hashed: list[list[cf.Future[bytes]]] = [[] for _ in spans]

    def hand_out() -> None:
        while todo and len(filling) < threads:
            start, stop = todo.popleft()
            filling.append((stop, pool.submit(_fill, fd, view, start, stop, what)))

    def hash_below(landed: int) -> None:
        """Queue each range's leaves whose bytes are all in memory (below ``landed``)."""
        for leaves, futures in zip(spans, hashed, strict=True):
            while len(futures) < len(leaves) and leaves[len(futures)][1] <= landed:
                a, b = leaves[len(futures)]
                futures.append(pool.submit(leaf_checksum.leaf, view[a:b]))

    try:
        hand_out()
        hash_below(0)  # empty ranges at 0
        while filling:
            stop, fill = filling.popleft()
            fill.result()
            hash_below(stop)
            hand_out()
        hash_below(size)
        return [leaf_checksum.combine([f.result() for f in futures]) for futures in hashed]
    except BaseException:
        for _, fill in filling:
            fill.cancel()  # a short file: the rest is not read
        raise


def _fill(fd: int, view: memoryview, start: int, stop: int, what: str) -> None:
    done = start
    while done < stop:
        got = os.preadv(fd, [view[done:stop]], done)
        if got <= 0:
            raise ValueError(f"{what or 'the copy'} changed while it was read")
        done += got
