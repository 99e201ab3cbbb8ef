"""WorkerContext.from_env: torchrun's variables, ours, defaults and one-line errors."""

from __future__ import annotations

import pytest

from elastic_trainer import protocol
from elastic_trainer.errors import EnvironmentProblem
from elastic_trainer.runtime.context import DEFAULT_COLLECTIVE_TIMEOUT_S, WorkerContext

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_MAX_RESTARTS": "5",
    "TORCHELASTIC_RUN_ID": "run-7",
}


def test_plain_python_run_is_a_single_process():
    ctx = WorkerContext.from_env({})
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.restart_count) == (0, 1, 0, 0)
    assert not ctx.is_distributed
    assert ctx.snapshot_dir is None and ctx.stop_file is None and ctx.progress_path is None
    assert ctx.collective_timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S


def test_torchrun_and_elastic_train_variables_are_read(tmp_path):
    env = {
        **TORCHRUN,
        protocol.ENV_JOB_ID: "job-1",
        protocol.ENV_NODE: "node-a",
        protocol.ENV_SNAPSHOT_DIR: "memory://snaps",
        protocol.ENV_SNAPSHOT_EVERY: "10",
        protocol.ENV_SNAPSHOT_KEEP: "2",
        protocol.ENV_CONTROL_DIR: str(tmp_path),
        protocol.ENV_LOG_FORMAT: "json",
        protocol.ENV_LOG_FILE: str(tmp_path / "log.jsonl"),
        protocol.ENV_COLLECTIVE_TIMEOUT: "7.5",
    }
    ctx = WorkerContext.from_env(env)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (3, 1, 4, 2)
    assert (ctx.group_rank, ctx.master_port, ctx.restart_count, ctx.max_restarts) == (
        1,
        29500,
        2,
        5,
    )
    assert (ctx.run_id, ctx.job_id, ctx.node) == ("run-7", "job-1", "node-a")
    assert (ctx.snapshot_dir, ctx.snapshot_every, ctx.snapshot_keep) == ("memory://snaps", 10, 2)
    assert ctx.collective_timeout_s == 7.5
    assert ctx.stop_file == str(tmp_path / protocol.STOP_FILE)
    assert ctx.progress_path == str(tmp_path / protocol.progress_file(1))
    assert ctx.is_distributed


def test_job_id_falls_back_to_the_run_id():
    assert WorkerContext.from_env(TORCHRUN).job_id == "run-7"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"WORLD_SIZE": None}, "WORLD_SIZE missing"),
        ({"RANK": "4"}, "RANK=4 does not fit WORLD_SIZE=4"),
        ({"RANK": "x"}, "RANK='x' is not valid"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2, LOCAL_WORLD_SIZE=2"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR/MASTER_PORT are not set"),
        ({protocol.ENV_SNAPSHOT_EVERY: "0"}, "ELASTIC_TRAIN_SNAPSHOT_EVERY='0' is not valid"),
        ({protocol.ENV_COLLECTIVE_TIMEOUT: "-1"}, "ELASTIC_TRAIN_COLLECTIVE_TIMEOUT='-1'"),
        ({protocol.ENV_LOG_FORMAT: "xml"}, "ELASTIC_TRAIN_LOG_FORMAT='xml'"),
    ],
)
def test_broken_environments_are_one_line_errors(change, words):
    env = {**TORCHRUN, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(EnvironmentProblem) as info:
        WorkerContext.from_env(env)
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_cpu_context_uses_gloo(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    ctx = WorkerContext.from_env({})
    assert (ctx.device.type, ctx.backend) == ("cpu", "gloo")
