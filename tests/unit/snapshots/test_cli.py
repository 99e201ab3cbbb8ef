"""`elastic-train snapshots ...`: output, exit codes, one-line errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import structlog
import torch

from snapshots import SnapshotStore
from snapshots.cli import main
from snapshots.format import layout
from tests.tamper import resign
from tests.unit.snapshots.sharded.test_sharded import _save


@pytest.fixture
def url(tmp_path: Path) -> str:
    root = str(tmp_path / "snaps")
    store = SnapshotStore(root, async_save=False, keep=None)
    for step in (10, 20, 30):
        store.save(step, {"w": torch.full((8,), float(step))}, epoch=step // 10)
    return root


def test_list_json_parses(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["epoch"]) for r in rows] == [(10, 1), (20, 2), (30, 3)]
    assert all(r["bytes"] > 0 and r["url"].endswith(layout.step_dir(r["step"])) for r in rows)


def test_list_table(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", url]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "step" and [ln.split()[0] for ln in lines[1:]] == [
        "10",
        "20",
        "30",
    ]


def test_show_defaults_to_latest(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", url]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["step"] == 30 and body["verified"] is True
    assert main(["show", url, "--step", "10"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 10


def test_verify_names_the_bad_file_and_exits_1(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", url]) == 0
    bad = next((Path(url) / layout.step_dir(20)).glob("*-w.*.pt"))
    bad.write_bytes(bad.read_bytes()[:-1])
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"FAILED  step 20: file {bad.name}" in out and "ok      step 30" in out
    assert main(["verify", url, "--step", "30"]) == 0


def test_prune_keeps_the_newest(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", url, "--keep", "1"]) == 0
    assert "[10, 20]" in capsys.readouterr().out
    assert SnapshotStore(url).committed_steps() == [30]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["list", "{missing}"], "there is no snapshot folder at"),
        (["verify", "{missing}"], "there is no snapshot folder at"),
        (["show", "{missing}"], "there is no snapshot folder at"),
        (["list", "{missing}", "--storage-options", "{{not json"], "--storage-options"),
        (["prune", "{missing}"], "--keep"),  # argparse's own usage error
        (["prune", "{missing}", "--keep", "0"], "integer >= 1"),
        (["explode"], "invalid choice"),
        ([], "required"),
        (["list", "gs://bucket/run"], "pip install 'elastic-train[gcs]'"),
        (["show", "{empty}"], "no committed snapshots"),
        (["list", "{empty}"], "no committed snapshots"),
    ],
)
def test_errors_exit_2_with_one_prefixed_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    if argv[1:2] == ["gs://bucket/run"]:
        pytest.importorskip("fsspec")
        if importlib.util.find_spec("gcsfs") is not None:
            pytest.skip("gcsfs is installed: gs:// opens")
    missing, empty = tmp_path / "nowhere", tmp_path / "empty"
    empty.mkdir()
    assert main([a.format(missing=missing, empty=empty) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("elastic-train: error: "), err
    assert words in err and "writable" not in err
    assert not missing.exists()


def test_missing_steps_exit_2_for_show_and_verify(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("show", "verify"):
        assert main([command, url, "--step", "99"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("elastic-train: error: no committed snapshot of step 99")


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert main(["prune", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "--keep-every" in out


def test_prune_dry_run_deletes_nothing(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", url, "--keep", "1", "--dry-run"]) == 0
    assert "would delete 2 snapshot(s): [10, 20]" in capsys.readouterr().out
    assert SnapshotStore(url).committed_steps() == [10, 20, 30]


def test_list_shows_the_verified_state(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = next((Path(url) / layout.step_dir(20)).glob("*-w.*.pt"))
    bad.write_bytes(bad.read_bytes()[:-1])
    assert main(["list", url]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.strip().splitlines()]
    assert rows[0][4] == "verified" and [r[4] for r in rows[1:]] == ["ok", "FAILED", "ok"]
    assert main(["list", url, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [r["verified"] for r in body] == [True, False, True]
    assert body[1]["problems"] and bad.name in body[1]["problems"][0]
    assert main(["list", url, "--json", "--no-verify"]) == 0
    assert [r["verified"] for r in json.loads(capsys.readouterr().out)] == [None] * 3


def test_events_never_reach_stdout_even_after_capture_logs(tmp_path, capsys) -> None:
    """Regression: after any capture_logs() structlog counts as configured with its default
    factory, which prints to stdout; the CLI kept that, so `show` on a store whose newest
    snapshot is damaged printed its snapshot.corrupt event into the JSON answer."""
    import json

    import structlog
    import torch
    from structlog.testing import capture_logs

    from snapshots import SnapshotStore
    from snapshots.cli import main
    from snapshots.format import layout

    store = SnapshotStore(str(tmp_path), async_save=False, keep=None)
    for step in (1, 2):
        store.save(step, {"w": torch.ones(2) * step})
    data = next(p for p in (tmp_path / layout.step_dir(2)).iterdir() if p.suffix == ".pt")
    data.write_bytes(data.read_bytes()[:-3])  # truncated: show falls back to step 1
    with capture_logs():
        pass
    assert structlog.is_configured()
    capsys.readouterr()
    assert main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["step"] == 1  # the answer alone: the event went elsewhere


# --- text from a snapshot reaches the terminal escaped --------------------------------------
PWNED = "\x1b]0;pwned\x07"  # sets the terminal's title
RAW = ("\x1b", "\x07", "\x9b", "\x7f", "\r", "\u202e")  # ESC BEL CSI(C1) DEL CR RLO


def _edit_manifest(url: str, step: int, **fields: object) -> None:
    path = Path(url) / layout.manifest_path(step)
    body = json.loads(path.read_bytes())
    body.update(fields)
    path.write_text(json.dumps(body))


def _raw_in(text: str) -> list[str]:
    return [c for c in RAW if c in text]


def test_list_shows_a_manifests_escape_sequence_as_text_never_as_one(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _edit_manifest(url, 20, created_at=PWNED + "\x9b2J\x7f\r\u202e")
    assert main(["list", url]) == 0
    out = capsys.readouterr().out
    assert _raw_in(out) == [] and "\\x1b]0;pwned\\x07\\x9b2J\\x7f\\x0d\\u202e" in out
    for argv in (["list", url, "--json"], ["show", url, "--step", "20"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert _raw_in(out) == [] and PWNED in out.replace("\\u001b", "\x1b").replace(
            "\\u0007", "\x07"
        )
    (row,) = [r for r in json.loads(_list_json(url, capsys)) if r["step"] == 20]
    assert row["created_at"].startswith(PWNED)  # JSON escapes, and reads back the same


def _list_json(url: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["list", url, "--json"]) == 0
    return capsys.readouterr().out


def test_a_field_of_another_type_or_a_long_one_neither_crashes_nor_floods(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _edit_manifest(url, 10, created_at=12)
    _edit_manifest(url, 20, created_at="x" * 10_000)
    for argv in (["list", url], ["list", url, "--no-verify"]):
        assert main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 4 and max(len(line) for line in lines) < 200


def _pwn_a_tensor_name(root: Path, step: int) -> None:
    """A tensor of the shard table renamed with an escape sequence (and a bad dtype, so that
    the deep check quotes it), the manifest signed again: only loading tells."""
    table = next((root / layout.step_dir(step)).glob("shards.*.json"))
    body = json.loads(table.read_bytes())
    name = next(iter(body["tensors"]))
    body["tensors"][PWNED + name] = {**body["tensors"].pop(name), "dtype": "bogus"}
    resign(root, step, lambda f: f.get("table", False), json.dumps(body).encode())


def test_problems_and_errors_show_a_tensor_name_from_a_shard_table_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    structlog.reset_defaults()  # events printed by the CLI itself, whatever ran before
    root = tmp_path / "sharded"
    _save(str(root), step=1)
    _save(str(root), step=2)
    _pwn_a_tensor_name(root, 2)
    capsys.readouterr()
    assert main(["verify", str(root), "--deep"]) == 1
    out = capsys.readouterr().out
    assert "FAILED  step 2: " in out and "\\x1b]0;pwned\\x07" in out and _raw_in(out) == []
    assert main(["prune", str(root), "--keep", "1"]) == 0  # step 2 does not load: keeps both
    err = capsys.readouterr().err
    assert "snapshot.corrupt" in err and "\\x1b]0;pwned\\x07" in err and _raw_in(err) == []
    _pwn_a_tensor_name(root, 1)
    assert main(["prune", str(root), "--keep", "1"]) == 1  # none loads: the error quotes both
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("elastic-train: error: ") and "\\x1b]0;pwned\\x07" in err
    assert _raw_in(err) == []
