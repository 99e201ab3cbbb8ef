"""A slot file read back by several threads while its parts are checksummed in order
(``worker.memory.checked_read``)."""

from __future__ import annotations

import os

import pytest

from elastic_trainer.private_files import NotOursError
from elastic_trainer.worker.memory import byte_layout, checked_read, leaf_checksum

PIECE = 4096  # pieces this small make a few hundred kB a read of many pieces


@pytest.fixture(params=[1000, 3 * PIECE + 1, 1 << 24], ids=lambda n: f"leaf{n}")
def small_pieces(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Pieces of a few kB, and leaves of the checksum smaller, larger and far larger."""
    monkeypatch.setattr(checked_read, "PIECE_BYTES", PIECE)
    monkeypatch.setattr(leaf_checksum, "LEAF_BYTES", request.param)


def _file(tmp_path: os.PathLike[str], size: int) -> tuple[str, bytes]:
    path = os.path.join(tmp_path, "slot-a")
    data = os.urandom(size)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path, data


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("threads", [1, 3])
def test_the_bytes_and_each_range_s_checksum_are_those_of_the_file(tmp_path, threads):
    size = 37 * PIECE + 123  # a last piece shorter than the others
    path, data = _file(tmp_path, size + 999)  # a slot is longer than its copy
    # ranges that start and end inside pieces, tile the copy, overlap, and one empty
    ranges = [(0, 5 * PIECE + 7), (5 * PIECE + 7, size), (100, 3 * PIECE), (10, 10)]
    got, digests = checked_read.read_file(path, size, ranges, threads=threads)
    assert bytes(got) == data[:size]
    assert digests == [byte_layout.checksum(data[lo:hi]) for lo, hi in ranges]


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("threads", [1, 3])
def test_a_file_shorter_than_its_copy_is_refused(tmp_path, threads):
    path, _ = _file(tmp_path, 10 * PIECE)
    with pytest.raises(ValueError, match="slot-a changed while it was read"):
        checked_read.read_file(path, 12 * PIECE, [(0, 12 * PIECE)], threads=threads, what="slot-a")


@pytest.mark.usefixtures("small_pieces")
def test_the_bytes_read_are_private_not_the_slot_s(tmp_path):
    path, data = _file(tmp_path, 8 * PIECE)
    got, (digest,) = checked_read.read_file(path, 8 * PIECE, [(0, 8 * PIECE)], threads=2)
    with open(path, "r+b") as f:  # a later copy writes the slot again
        f.write(b"\xee" * PIECE)
    assert bytes(got) == data and digest == byte_layout.checksum(data)


def test_a_link_in_place_of_the_slot_is_not_followed(tmp_path):
    target, _ = _file(tmp_path, PIECE)
    link = os.path.join(tmp_path, "slot-b")
    os.symlink(target, link)
    with pytest.raises(NotOursError):
        checked_read.read_file(link, PIECE, threads=2)
