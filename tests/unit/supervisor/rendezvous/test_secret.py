"""Where the job's secret comes from: the operator's file, the snapshot folder (made there by
the first node, exclusively, 0600), or this user's private folder; anything not ours alone
is refused with one line."""

from __future__ import annotations

import os
import stat
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor.rendezvous import secret
from elastic_trainer.supervisor.rendezvous.handler import handler_on
from elastic_trainer.supervisor.rendezvous.state_backend import ForeignSecret


def _key(**where: str | None) -> JobKey:
    return secret.job_key(
        secret_file=where.get("secret_file"),
        snapshot_dir=where.get("snapshot_dir"),
        job_id=where.get("job_id") or "job",
    )


def test_the_operators_file_is_the_secret(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"  " + b"k" * 32 + b"\n")
    assert _key(secret_file=str(path)).secret == b"k" * 32
    link = tmp_path / "mounted"  # Kubernetes mounts a Secret's files as links
    link.symlink_to(path)
    assert _key(secret_file=str(link)) == _key(secret_file=str(path))


@pytest.mark.parametrize(
    ("content", "mode", "named"),
    [
        (b"short", 0o600, "holds 5 bytes"),
        (b"k" * 32, 0o666, "any local user may write it"),
    ],
)
def test_an_operators_file_that_cannot_be_a_secret_is_one_line(
    tmp_path: Path, content: bytes, mode: int, named: str
) -> None:
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(mode)
    with pytest.raises(ConfigError, match=named) as caught:
        _key(secret_file=str(path))
    assert "\n" not in str(caught.value) and "--rdzv-secret-file" in str(caught.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        _key(secret_file=str(tmp_path / "missing"))


def test_the_first_node_makes_it_in_the_snapshot_folder_private_and_the_others_read_it(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "run"
    old = os.umask(0)  # whatever the umask
    try:
        first = _key(snapshot_dir=str(folder))
    finally:
        os.umask(old)
    made = folder / secret.SECRET_NAME
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    assert _key(snapshot_dir=str(folder)) == first == _key(snapshot_dir=f"file://{folder}")
    assert len(first.secret) == 64


@pytest.mark.parametrize("plant", ["link", "readable", "not-a-file"])
def test_a_secret_file_not_ours_alone_is_refused(tmp_path: Path, plant: str) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    path = folder / secret.SECRET_NAME
    if plant == "link":
        target = tmp_path / "elsewhere"
        target.write_bytes(b"k" * 32)
        target.chmod(0o600)
        path.symlink_to(target)
    elif plant == "readable":
        path.write_bytes(b"k" * 32)
        path.chmod(0o644)
    else:
        os.mkfifo(path, 0o600)  # never waited on
    with pytest.raises(ConfigError, match="the job's secret is refused"):
        _key(snapshot_dir=str(folder))


def test_without_a_folder_each_job_of_this_user_has_a_private_one(
    tmp_path: Path, monkeypatch
) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    a, b = _key(job_id="a"), _key(job_id="b")
    assert a != b and _key(job_id="a") == a  # another node of job a on this machine
    folder = runtime / "elastic-train"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in folder.iterdir())


def test_a_reader_never_makes_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no job secret there"):
        secret.job_key(secret_file=None, snapshot_dir=str(tmp_path), job_id="j", create=False)
    assert list(tmp_path.iterdir()) == []


def _handler(port: int, key: JobKey):  # type: ignore[no-untyped-def]
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return handler_on(
        store, key, "job", 1, 2, "127.0.0.1", RendezvousTimeout(),
        keep_alive_interval=5, keep_alive_max_attempt=3,
    )  # fmt: skip


def test_a_node_with_another_secret_is_told_so_and_writes_nothing() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ours = _handler(server.port, JobKey.generate())
    before = bytes(server.get("torch.rendezvous.job"))
    with pytest.raises(ForeignSecret, match="signed with another secret") as caught:
        _handler(server.port, JobKey.generate())
    assert "--rdzv-secret-file" in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, ConfigError)  # exit 2
    assert bytes(server.get("torch.rendezvous.job")) == before
    assert ours.state_backend.peek() is None  # ours still reads its own state


def test_nodes_starting_at_once_agree_and_never_read_it_half_made(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    folder = str(tmp_path / "run")
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda _: _key(snapshot_dir=folder), range(32)))
    assert len({k.secret for k in keys}) == 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [secret.SECRET_NAME]
