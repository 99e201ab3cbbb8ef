"""Which byte ranges a load reads: consecutive chunks of a file as one span, bounded."""

from __future__ import annotations

from snapshots.format.sharding import Chunk
from snapshots.read.spans import spans


def _chunk(file: str, start: int, nbytes: int) -> Chunk:
    return Chunk(file=file, offsets=(start,), sizes=(nbytes,), byte_offset=start, nbytes=nbytes,
                 checksum="0" * 64)  # fmt: skip


def test_consecutive_chunks_of_a_file_are_one_span_in_file_order() -> None:
    chunks = [_chunk("b", 0, 10), _chunk("a", 10, 5), _chunk("a", 0, 10), _chunk("a", 15, 1)]
    got = spans(chunks)
    assert [(s.file, s.start, s.length) for s in got] == [("a", 0, 16), ("b", 0, 10)]
    assert [c.byte_offset for c in got[0].chunks] == [0, 10, 15]


def test_a_gap_or_the_size_bound_starts_a_new_span() -> None:
    chunks = [_chunk("a", 0, 10), _chunk("a", 20, 10), _chunk("a", 30, 10), _chunk("a", 40, 10)]
    got = spans(chunks, max_bytes=20)
    assert [(s.start, s.length) for s in got] == [(0, 10), (20, 20), (40, 10)]
    assert spans([]) == []


def test_a_chunk_larger_than_the_bound_is_a_span_of_its_own() -> None:
    got = spans([_chunk("a", 0, 50), _chunk("a", 50, 5)], max_bytes=20)
    assert [(s.start, s.length) for s in got] == [(0, 50), (50, 5)]
