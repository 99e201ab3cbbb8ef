"""TrainingSession's ``snapshot_keep`` keyword (the setting's own name) and ``keep``, its
former name: accepted, with one warning per process; the fallback is the declaration's."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
from torch import nn

from elastic_trainer.contract.protocol import DEFAULT_SNAPSHOT_KEEP
from elastic_trainer.contract.settings import flagged
from elastic_trainer.errors import ConfigError
from elastic_trainer.worker import session as session_module
from elastic_trainer.worker.context import WorkerContext, WorkerSettings
from elastic_trainer.worker.session import TrainingSession


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(session_module, "_keep_warned", False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def kept(tmp_path, monkeypatch, operator: int | None = None, **keywords) -> int:
    """The number of snapshots the session keeps, as it opens its snapshot folder."""
    seen: list[int] = []
    real = session_module.open_snapshots

    def spy(url, keep, *rest):
        seen.append(keep)
        return real(url, keep, *rest)

    monkeypatch.setattr(session_module, "open_snapshots", spy)
    session = TrainingSession(
        {"model": nn.Linear(1, 1)},
        context=WorkerContext(settings=WorkerSettings(snapshot_keep=operator)),
        snapshot_dir=str(tmp_path / "snaps"),
        configure_logs=False,
        **keywords,
    )
    session.close()
    dist.destroy_process_group()
    return seen[0]


def test_snapshot_keep_is_the_keyword_and_the_fallback_is_declared_once(tmp_path, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the setting's own name never warns
        assert kept(tmp_path, monkeypatch, snapshot_keep=2) == 2
        assert kept(tmp_path, monkeypatch) == DEFAULT_SNAPSHOT_KEEP
        assert kept(tmp_path, monkeypatch, operator=5, snapshot_keep=2) == 5  # the flag wins


def test_keep_still_works_and_warns_once(tmp_path, monkeypatch):
    with pytest.warns(FutureWarning, match="snapshot_keep"):
        assert kept(tmp_path, monkeypatch, keep=2) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kept(tmp_path, monkeypatch, keep=4) == 4  # once per process
        assert kept(tmp_path, monkeypatch, keep=4, snapshot_keep=4) == 4


def test_keep_and_snapshot_keep_that_disagree_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="give snapshot_keep only") as info:
        kept(tmp_path, monkeypatch, keep=2, snapshot_keep=3)
    assert "\n" not in str(info.value)


def test_the_api_page_lists_every_keyword_and_the_declared_flag_and_default() -> None:
    page = Path(__file__).parents[3] / "docs" / "api.md"
    rows = {
        re.match(r"\| `(\w+)`", line).group(1): line
        for line in page.read_text().splitlines()
        if re.match(r"\| `\w+`", line)
    }
    keywords = set(inspect.signature(TrainingSession.__init__).parameters) - {"self"}
    assert keywords <= rows.keys()
    with_fallback = {n: h for n, h in flagged(WorkerSettings).items() if h.fallback is not None}
    assert with_fallback.keys() <= keywords
    for name, how in with_fallback.items():  # "--snapshot-keep, else 3"
        assert f"`{how.flag}`, else {how.fallback}" in rows[name], name
