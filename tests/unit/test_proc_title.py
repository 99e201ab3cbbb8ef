"""Process titles (``elastic_trainer/proc_title.py`` and its twin ``snapshots/proc_title.py``):
the titles, and setting one never fails a process nor leaves anything in its environment.
Spawns nothing: the backend is a stand-in (tests/process/test_proc_title.py runs the real one).
"""

from __future__ import annotations

import os
import sys
import types

import pytest

import snapshots.proc_title
from elastic_trainer import proc_title

IMPLEMENTATIONS = [proc_title, snapshots.proc_title]
KEEP_ENVIRON = "SPT_NOENV"


def test_a_worker_shows_its_rank_and_its_command() -> None:
    title = proc_title.worker({"RANK": "12"}, ["train.py", "--lr", "1"])
    assert title == ("elastic-train worker 12: train.py --lr 1", "et-worker 12")
    title = proc_title.worker({"RANK": "0"}, ["-m", "pkg.train", "--lr", "1"])
    assert title.text == "elastic-train worker 0: -m pkg.train --lr 1"
    # outside a job (the preflight, forked through the bootstrap, retitles itself)
    assert proc_title.worker({}, ["x.py"]) == ("elastic-train worker: x.py", "et-worker")


def test_each_helper_shows_its_role() -> None:
    pool = proc_title.warm_pool({"ELASTIC_TRAIN_NODE": "gpu-07"})
    assert pool == ("elastic-train warm pool (node gpu-07)", "et-warm-pool")
    assert proc_title.warm_pool({}).text == "elastic-train warm pool"
    assert proc_title.sentinel(812).text == "elastic-train sentinel (supervisor 812)"
    assert (
        proc_title.preflight(["t.py", "--lr", "1"]).text == "elastic-train preflight: t.py --lr 1"
    )
    writer = snapshots.proc_title.writer({"RANK": "3"}, 99)
    assert writer == ("elastic-train snapshot writer (rank 3)", "et-writer 3")
    assert snapshots.proc_title.writer({}, 99).text == "elastic-train snapshot writer (for pid 99)"


def test_names_fit_the_kernels_fifteen_bytes() -> None:
    titles = [
        proc_title.worker({"RANK": "1234567"}, ["t.py"]),
        proc_title.warm_pool({}),
        proc_title.sentinel(1),
        proc_title.preflight(["t.py"]),
        snapshots.proc_title.writer({"RANK": "1234567"}, 1),
    ]
    assert all(0 < len(t.name.encode()) <= 15 for t in titles), titles


class Backend(types.ModuleType):
    """A stand-in for setproctitle that records, or raises like a broken C extension."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__("setproctitle")
        self.error = error
        self.calls: list[tuple[str, str, str | None]] = []

    def setproctitle(self, text: str) -> None:
        self.calls.append(("title", text, os.environ.get(KEEP_ENVIRON)))
        if self.error is not None:
            raise self.error

    def setthreadtitle(self, name: str) -> None:
        self.calls.append(("name", name, os.environ.get(KEEP_ENVIRON)))


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda m: m.__name__)
def impl(request, monkeypatch):
    monkeypatch.delenv(KEEP_ENVIRON, raising=False)
    return request.param


def test_a_failing_backend_is_swallowed(impl, monkeypatch) -> None:
    backend = Backend(SystemError("no argv area"))
    monkeypatch.setitem(sys.modules, "setproctitle", backend)
    impl.set_title(impl.Title("elastic-train x", "et-x"))  # does not raise
    assert backend.calls == [("title", "elastic-train x", "1")]
    assert KEEP_ENVIRON not in os.environ


def test_a_missing_backend_does_nothing(impl, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "setproctitle", None)  # import raises ImportError
    impl.set_title(impl.Title("elastic-train x", "et-x"))
    assert KEEP_ENVIRON not in os.environ


def test_the_title_keeps_the_environment_readable_and_leaves_it_as_it_was(
    impl, monkeypatch
) -> None:
    backend = Backend()
    monkeypatch.setitem(sys.modules, "setproctitle", backend)
    impl.set_title(impl.Title("elastic-train x", "et-x"))
    # asked for while set: setproctitle then leaves /proc/PID/environ alone
    assert backend.calls == [("title", "elastic-train x", "1"), ("name", "et-x", "1")]
    assert KEEP_ENVIRON not in os.environ  # the script's environment is the one it was given
    monkeypatch.setenv(KEEP_ENVIRON, "yes")  # the user's own value is kept
    impl.set_title(impl.Title("elastic-train y", "et-y"))
    assert backend.calls[-2][2] == "1" and os.environ[KEEP_ENVIRON] == "yes"
