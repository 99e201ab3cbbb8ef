"""Pure: the byte ranges to read for a set of stored chunks.

A load needs many chunks (at most ``_shards.CHUNK_BYTES`` each) that sit back to back in a
few shard files. Reading each on its own costs a request per MiB (an open, a seek and a read
on local disk; a GET on an object store) and, from a cold page cache, small reads the kernel
cannot read ahead of. Chunks that follow each other in a file are read as one span instead,
up to ``SPAN_BYTES`` (bounding the memory a span holds); each chunk is still checked against
its own checksum before use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from snapshots.format.sharding import Chunk

SPAN_BYTES = 32 * 2**20


@dataclass(frozen=True, kw_only=True)
class Span:
    file: str
    start: int
    length: int
    chunks: tuple[Chunk, ...]  # in file order, back to back, exactly covering the span


def spans(chunks: Iterable[Chunk], max_bytes: int = SPAN_BYTES) -> list[Span]:
    """The spans covering ``chunks``: per file, in file order, consecutive chunks merged."""
    by_file: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_file.setdefault(chunk.file, []).append(chunk)
    out: list[Span] = []
    for file in sorted(by_file):
        run: list[Chunk] = []
        for chunk in sorted(by_file[file], key=lambda c: c.byte_offset):
            if run and not _extends(run, chunk, max_bytes):
                out.append(_span(run))
                run = []
            run.append(chunk)
        out.append(_span(run))
    return out


def _extends(run: list[Chunk], chunk: Chunk, max_bytes: int) -> bool:
    end = run[-1].byte_offset + run[-1].nbytes
    return chunk.byte_offset == end and end + chunk.nbytes - run[0].byte_offset <= max_bytes


def _span(run: list[Chunk]) -> Span:
    start = run[0].byte_offset
    end = run[-1].byte_offset + run[-1].nbytes
    return Span(file=run[0].file, start=start, length=end - start, chunks=tuple(run))
