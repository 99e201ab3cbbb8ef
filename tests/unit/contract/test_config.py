"""RunConfig / RendezvousTuning validation: every bad value is a one-line ConfigError."""

from __future__ import annotations

from dataclasses import fields

import pytest

from elastic_trainer.contract.config import Entrypoint, RendezvousTuning, RestartTuning, RunConfig
from elastic_trainer.contract.protocol import WorkerSettings, setting_of
from elastic_trainer.errors import ConfigError


def test_defaults_are_valid_and_run_the_builtin_job() -> None:
    cfg = RunConfig()
    assert cfg.entrypoint.argv() == ("-m", "elastic_trainer.jobs.default")
    assert cfg.rdzv_endpoint == "127.0.0.1:29400"
    assert cfg.worker.grace_period_s == 25.0


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"min_nodes": 0}, "--min-nodes"),
        ({"min_nodes": 3, "max_nodes": 2}, "--max-nodes"),
        ({"nproc_per_node": 0}, "--nproc-per-node"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"monitor_interval": 0}, "--monitor-interval"),
        ({"hang_timeout": -1}, "--hang-timeout"),
        ({"hang_timeout": 0.1, "monitor_interval": 0.5}, "--hang-timeout"),
        ({"job_id": ""}, "--job-id"),
        ({"rdzv_port": 70000}, "--rdzv-endpoint"),
    ],
)
def test_bad_values_name_the_field_and_the_value(kwargs: dict, names: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig(**kwargs)
    message = str(info.value)
    assert names in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (
            {"grace_period_s": -1.0},
            "--grace-period=-1.0 is invalid (expected a number of seconds >= 0)",
        ),
        ({"snapshot_every": 0}, "--snapshot-every"),
        ({"snapshot_every": "sometimes"}, "--snapshot-every"),
        ({"memory_snapshot_every": -1}, "--memory-snapshot-every"),
        ({"snapshot_keep": 0}, "--snapshot-keep"),
        ({"snapshot_dir": "  "}, "--snapshot-dir"),
        ({"log_format": "xml"}, "--log-format"),
        ({"storage_timeout_s": float("inf")}, "--storage-timeout"),
        ({"mtbf_s": 0.0}, "ELASTIC_TRAIN_MTBF_S"),
    ],
)
def test_bad_worker_settings_name_the_flag_and_the_value(kwargs: dict, names: str) -> None:
    with pytest.raises(ConfigError) as info:
        WorkerSettings(**kwargs)
    assert names in str(info.value) and "\n" not in str(info.value)


def test_every_worker_setting_is_declared_once_with_its_variable_and_parser() -> None:
    env_names = [setting_of(WorkerSettings, f.name).env for f in fields(WorkerSettings)]
    assert len(set(env_names)) == len(env_names) and all(
        n.startswith("ELASTIC_TRAIN_") for n in env_names
    )
    # what the supervisor writes, the worker reads back as the same settings
    chosen = WorkerSettings(
        snapshot_dir="s3://b/run",
        snapshot_every="auto",
        memory_snapshot_every=0,
        snapshot_keep=2,
        storage_timeout_s=12.5,
        log_format="console",
        grace_period_s=0.0,
        mtbf_s=600.0,
    )
    assert WorkerSettings.from_env(chosen.to_env()) == chosen


def test_a_zero_grace_period_reaches_the_workers() -> None:
    """``--grace-period 0`` (stop at once) was valid for the supervisor, but its workers'
    parser wanted seconds > 0: every worker failed at start."""
    cfg = RunConfig(worker=WorkerSettings(grace_period_s=0.0))
    env = cfg.worker_settings("/tmp/control").to_env()
    assert WorkerSettings.from_env(env).grace_period_s == 0.0


def test_positional_arguments_are_rejected() -> None:
    with pytest.raises(TypeError):
        RunConfig(1, 2)  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_alive_max_attempt": 1},
        {"keep_alive_interval": 0},
        {"last_call_timeout": -2},
        {"join_timeout": 5, "first_last_call_timeout": 10},
        {"read_timeout": 0},
    ],
)
def test_bad_rendezvous_tuning(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="--rdzv-conf"):
        RendezvousTuning(**kwargs)


def test_dead_after_is_interval_times_attempts() -> None:
    assert RendezvousTuning(keep_alive_interval=2, keep_alive_max_attempt=4).dead_after_s == 8


def test_restart_tuning_backoff_cap_must_cover_base() -> None:
    with pytest.raises(ConfigError, match="backoff_max_s"):
        RestartTuning(backoff_base_s=5, backoff_max_s=1)


def test_entrypoint_script_and_module_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="not both"):
        Entrypoint(script="train.py", module="pkg.train")
    assert Entrypoint(script="t.py", args=("--x", "1")).argv() == ("t.py", "--x", "1")
    assert Entrypoint(module="pkg.m").argv() == ("-m", "pkg.m")
