"""Large page-aligned writes to local disk go past the page cache (O_DIRECT), byte-exact;
buffered wherever the memory, the length or the file system does not allow it."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from snapshots.errors import StorageError
from snapshots.format.serialization import staging_buffer
from snapshots.storage import local as _local_storage
from snapshots.storage import open_storage
from snapshots.storage.local import DIRECT_ALIGN, DIRECT_MIN, LocalStorage

needs_o_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def _buffer(nbytes: int) -> memoryview:
    """Random bytes in a staging buffer (its own pages: page-aligned)."""
    buf = staging_buffer(torch.Size([nbytes]), torch.uint8)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    return memoryview(buf.numpy())


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    lengths: list[int] = []
    real = _local_storage._write_direct

    def spy(fd: int, view: memoryview) -> int:
        lengths.append(len(view))
        return real(fd, view)

    monkeypatch.setattr(_local_storage, "_write_direct", spy)
    return lengths


@needs_o_direct
def test_an_aligned_buffer_goes_direct_and_its_unaligned_tail_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = _spy(monkeypatch)
    data = _buffer(2 * DIRECT_MIN + 3 * DIRECT_ALIGN + 123)
    LocalStorage(str(tmp_path)).write("f.bin", data)
    assert (tmp_path / "f.bin").read_bytes() == bytes(data)
    assert lengths and all(n % DIRECT_ALIGN == 0 for n in lengths)
    assert sum(lengths) == len(data) // DIRECT_ALIGN * DIRECT_ALIGN  # only the tail buffered


def test_unaligned_memory_and_small_writes_stay_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = _spy(monkeypatch)
    data = _buffer(2 * DIRECT_MIN + 1)
    storage = LocalStorage(str(tmp_path))
    storage.write("shifted.bin", data[1:])  # one byte past a page boundary
    storage.write("small.bin", data[: DIRECT_MIN // 2])
    assert (tmp_path / "shifted.bin").read_bytes() == bytes(data[1:])
    assert (tmp_path / "small.bin").read_bytes() == bytes(data[: DIRECT_MIN // 2])
    assert lengths == []


@needs_o_direct
@pytest.mark.parametrize("refused_by", ["fcntl", "write"])
def test_a_file_system_that_refuses_o_direct_gets_the_same_bytes_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_by: str
) -> None:
    """tmpfs refuses O_DIRECT at the write, some FUSE file systems at the flag."""
    real_fcntl, real_write = fcntl.fcntl, os.write

    def no_flag(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    def no_direct_write(fd: int, data: Any) -> int:
        if real_fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    if refused_by == "fcntl":
        monkeypatch.setattr(fcntl, "fcntl", no_flag)
    else:
        monkeypatch.setattr(os, "write", no_direct_write)
    data = _buffer(2 * DIRECT_MIN)
    LocalStorage(str(tmp_path)).write("f.bin", data)
    assert (tmp_path / "f.bin").read_bytes() == bytes(data)


@needs_o_direct
def test_a_short_direct_write_is_finished_buffered_from_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write, calls = os.write, []

    def short_once(fd: int, data: Any) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, memoryview(data)[: DIRECT_ALIGN + 100])  # a partial write
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", short_once)
    data = _buffer(2 * DIRECT_MIN)
    LocalStorage(str(tmp_path)).write("f.bin", data)
    assert (tmp_path / "f.bin").read_bytes() == bytes(data)


def test_direct_io_can_be_turned_off_per_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = _spy(monkeypatch)
    storage = open_storage(str(tmp_path), storage_options={"direct_io": False})
    data = _buffer(2 * DIRECT_MIN)
    storage.write("f.bin", data)
    assert (tmp_path / "f.bin").read_bytes() == bytes(data) and lengths == []
    with pytest.raises(StorageError, match=r"direct_io.*True or False"):
        open_storage(str(tmp_path), storage_options={"direct_io": "no"})
