"""WorkerContext.from_env: torchrun's variables, ours, defaults and one-line errors."""

from __future__ import annotations

import pytest

from elastic_trainer.contract import protocol
from elastic_trainer.errors import EnvironmentProblem
from elastic_trainer.worker.context import DEFAULT_COLLECTIVE_TIMEOUT_S, WorkerContext

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


def test_worker_settings_round_trip_through_the_environment(tmp_path) -> None:
    """The one contract between supervisor and workers: what one side writes, the other reads."""
    from elastic_trainer.contract.config import RunConfig
    from elastic_trainer.contract.protocol import WorkerSettings

    cfg = RunConfig(
        job_id="job-9",
        node="n1",
        worker=WorkerSettings(
            snapshot_dir="memory://s",
            snapshot_every=7,
            snapshot_keep=2,
            storage_timeout_s=12.5,
            log_format="console",
            log_file=str(tmp_path / "l.jsonl"),
            collective_timeout_s=33.0,
            grace_period_s=4.0,
        ),
    )
    sent = cfg.worker_settings(str(tmp_path))
    assert WorkerSettings.from_env(sent.to_env()) == sent
    ctx = WorkerContext.from_env(sent.to_env())
    assert (ctx.job_id, ctx.node, ctx.snapshot_every, ctx.snapshot_keep) == ("job-9", "n1", 7, 2)
    assert ctx.settings.storage_timeout_s == 12.5 and ctx.collective_timeout_s == 33.0


def test_unset_settings_never_leak_from_a_stale_environment() -> None:
    """A value left in the supervisor's own environment must not reach the worker as if the
    operator had set it; other variables are left alone."""
    from elastic_trainer.contract.protocol import ENV_SNAPSHOT_EVERY, WorkerSettings

    environ = {ENV_SNAPSHOT_EVERY: "5", "PATH": "/bin"}
    WorkerSettings(job_id="j").apply_to(environ)
    assert WorkerSettings.from_env(environ) == WorkerSettings(job_id="j")
    assert ENV_SNAPSHOT_EVERY not in environ and environ["PATH"] == "/bin"


def test_one_default_per_value() -> None:
    """RunConfig, WorkerSettings and WorkerContext agree because they share the constants."""
    from elastic_trainer.contract.config import RunConfig

    settings = RunConfig().worker_settings("/tmp/x")
    ctx = WorkerContext.from_env(settings.to_env())
    assert (
        ctx.collective_timeout_s
        == DEFAULT_COLLECTIVE_TIMEOUT_S
        == RunConfig().worker.collective_timeout_s
    )
    assert settings.snapshot_every is None and settings.snapshot_keep is None


@pytest.mark.parametrize(
    ("world", "local", "gpus", "refused"),
    [
        (2, 2, 1, True),
        (8, 4, 2, True),
        (4, 2, 2, False),
        (2, 1, 1, False),
        (1, 1, 1, False),
        (2, 2, 0, False),
    ],
)
def test_more_ranks_on_a_node_than_gpus_is_named_with_the_fix(world, local, gpus, refused):
    ctx = WorkerContext(world_size=world, local_world_size=local, master_addr="h", master_port=1)
    problem = ctx.shared_gpu_problem(gpus)
    assert (problem is not None) == refused
    if refused:
        assert f"{local} workers on this node" in problem
        assert f"--nproc-per-node {gpus}" in problem and "\n" not in problem
