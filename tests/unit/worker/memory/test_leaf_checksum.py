"""The in-memory tier's checksum (``worker.memory.leaf_checksum``): xxh3_128 of 16 MiB
leaves combined, the same whether computed in one pass, piece by piece, or leaf by leaf on
threads as the bytes become final."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from elastic_trainer.worker.memory import leaf_checksum

LEAF = 4096


@pytest.fixture(autouse=True)
def small_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leaf_checksum, "LEAF_BYTES", LEAF)


def by_hand(data: bytes) -> str:
    """The definition, computed the plain way."""
    spans = [data[a : a + LEAF] for a in range(0, len(data), LEAF)] or [b""]
    return xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(s) for s in spans))


@pytest.mark.parametrize("size", [0, 1, LEAF - 1, LEAF, LEAF + 1, 7 * LEAF + 300])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_checksum_is_its_definition(size, threads):
    data = os.urandom(size)
    assert leaf_checksum.checksum(data, threads=threads) == by_hand(data)


@pytest.mark.parametrize("cuts", [[], [1], [LEAF], [LEAF - 1, LEAF + 1, 3 * LEAF + 5]])
def test_piece_by_piece_in_order_is_the_same_checksum(cuts):
    data = os.urandom(5 * LEAF + 17)
    hasher = leaf_checksum.Hasher()
    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
        hasher.update(data[a:b])
    assert hasher.hexdigest() == by_hand(data)
    assert leaf_checksum.Hasher().hexdigest() == by_hand(b"")


@pytest.mark.parametrize("parallel", [False, True])
def test_a_range_whose_bytes_become_final_in_order_is_the_same_checksum(parallel):
    """As ``byte_layout.write_into`` uses it: bytes [start, stop) of a buffer written in
    order; a leaf is hashed (on a thread, when parallel) only once its bytes are final."""
    data = np.frombuffer(os.urandom(9 * LEAF), dtype=np.uint8)
    slot = np.zeros_like(data)
    start, stop = 100, 8 * LEAF + 5
    with leaf_checksum.RangeDigest(slot, start, stop, parallel=parallel) as digest:
        for a in range(start, stop, 1000):
            b = min(a + 1000, stop)
            slot[a:b] = data[a:b]
            digest.advance(b)
        got = digest.hexdigest()
    assert got == by_hand(data[start:stop].tobytes())


def test_a_range_asked_before_its_bytes_are_final_is_refused():
    slot = np.zeros(3 * LEAF, dtype=np.uint8)
    with leaf_checksum.RangeDigest(slot, 0, 3 * LEAF, parallel=True) as digest:
        digest.advance(2 * LEAF)
        with pytest.raises(RuntimeError, match="before all its bytes are final"):
            digest.hexdigest()


def test_an_empty_range_is_the_empty_leaf():
    slot = np.zeros(LEAF, dtype=np.uint8)
    for parallel in (False, True):
        with leaf_checksum.RangeDigest(slot, 10, 10, parallel=parallel) as digest:
            digest.advance(10)
            assert digest.hexdigest() == by_hand(b"")


def test_a_copy_or_read_uses_the_cpus_it_may_run_on_up_to_a_cap(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert leaf_checksum.worker_threads() == leaf_checksum.MAX_THREADS
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3})
    assert leaf_checksum.worker_threads() == 1
