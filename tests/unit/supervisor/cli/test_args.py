"""argv + PET_* -> RunConfig; every bad input is one line and exit code 2."""

from __future__ import annotations

import os
import re

import pytest

from elastic_trainer.cli import SUBCOMMANDS
from elastic_trainer.cli import main as cli_main
from elastic_trainer.contract.auth import JobKey
from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor.cli import args
from elastic_trainer.supervisor.run import main


def parse(argv: list[str], env: dict[str, str] | None = None):
    return args.parse(argv, env or {})


def test_script_and_its_own_flags_are_split_from_ours() -> None:
    cfg = parse(["--max-restarts", "5", "train.py", "--max-restarts", "9", "--lr", "0.1"])
    assert cfg.max_restarts == 5
    assert cfg.entrypoint.script == "train.py"
    assert cfg.entrypoint.args == ("--max-restarts", "9", "--lr", "0.1")


def test_module_entrypoint_takes_the_rest() -> None:
    cfg = parse(["--nproc-per-node", "2", "-m", "pkg.train", "--epochs", "3"])
    assert cfg.entrypoint.module == "pkg.train"
    assert cfg.entrypoint.argv() == ("-m", "pkg.train", "--epochs", "3")
    assert cfg.nproc_per_node == 2


def test_no_script_runs_the_builtin_job_with_args_after_double_dash() -> None:
    cfg = parse(["--min-nodes", "1", "--max-nodes", "4", "--", "--epochs", "2"])
    assert cfg.entrypoint.argv() == ("-m", "elastic_trainer.jobs.default", "--epochs", "2")
    assert (cfg.min_nodes, cfg.max_nodes) == (1, 4)


def test_nnodes_range_and_consistent_spellings() -> None:
    assert (parse(["--nnodes", "2:4"]).min_nodes, parse(["--nnodes", "2:4"]).max_nodes) == (2, 4)
    cfg = parse(["--nnodes", "1:3", "--min-nodes", "1", "--max-nodes", "3"])
    assert (cfg.min_nodes, cfg.max_nodes) == (1, 3)
    assert parse(["--nnodes", "3"]).max_nodes == 3


def test_only_min_nodes_means_a_fixed_size() -> None:
    cfg = parse(["--min-nodes", "2"])
    assert (cfg.min_nodes, cfg.max_nodes) == (2, 2)


def test_pet_env_fills_gaps_and_flags_win() -> None:
    env = {
        "PET_NNODES": "1:4",
        "PET_NPROC_PER_NODE": "3",
        "PET_RDZV_ENDPOINT": "10.0.0.5:1234",
        "PET_RDZV_ID": "kube-job",
        "PET_MAX_RESTARTS": "7",
        "PET_RDZV_BACKEND": "c10d",
    }
    cfg = parse([], env)
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (1, 4, 3)
    assert (cfg.rdzv_host, cfg.rdzv_port, cfg.job_id, cfg.max_restarts) == (
        "10.0.0.5",
        1234,
        "kube-job",
        7,
    )
    cfg = parse(["--max-restarts", "1", "--job-id", "mine", "--nnodes", "2"], env)
    assert (cfg.max_restarts, cfg.job_id, cfg.min_nodes, cfg.max_nodes) == (1, "mine", 2, 2)


def test_pet_master_addr_is_the_endpoint_fallback() -> None:
    cfg = parse([], {"PET_MASTER_ADDR": "master-0", "PET_MASTER_PORT": "23456"})
    assert cfg.rdzv_endpoint == "master-0:23456"


def test_endpoint_default_port_and_ipv6() -> None:
    assert parse(["--rdzv-endpoint", "node1"]).rdzv_port == 29400
    cfg = parse(["--rdzv-endpoint", "[::1]:1234"])
    assert (cfg.rdzv_host, cfg.rdzv_port) == ("::1", 1234)


def test_rdzv_conf_overrides_our_tuning() -> None:
    cfg = parse(["--rdzv-conf", "last_call_timeout=4,keep_alive_interval=0.5,is_host=false"])
    assert cfg.rdzv.last_call_timeout == 4.0
    assert cfg.rdzv.keep_alive_interval == 0.5
    assert cfg.is_host is False


def test_standalone_is_one_local_node_on_a_free_port() -> None:
    cfg = parse(["--standalone", "--nproc-per-node", "2"])
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_host) == (1, 1, "127.0.0.1")
    assert cfg.rdzv_port != 29400


BAD = [
    (["--min-nodes", "3", "--max-nodes", "2"], "--max-nodes"),
    (["--nnodes", "1:4", "--max-nodes", "2"], "contradicts --nnodes"),
    (["--nnodes", "a:b"], "--nnodes"),
    (["--nproc-per-node", "many"], "--nproc-per-node"),
    (["--rdzv-endpoint", "host:port"], "bad port"),
    (["--rdzv-conf", "last_call_timeout"], "key=value"),
    (["--rdzv-conf", "bogus=1"], "unknown"),
    (["--rdzv-conf", "join_timeout=soon"], "join_timeout"),
    (["--rdzv-conf", "is_host=maybe"], "is_host"),
    (["--rdzv-backend", "etcd"], "c10d"),
    (["--log-format", "xml"], "--log-format: invalid value 'xml': use json, console or auto"),
    (["--snapshot-every", "0"], "--snapshot-every"),
    (["--memory-snapshot-every", "-1"], "--memory-snapshot-every"),
    (["--frobnicate"], "unknown option --frobnicate"),
    (["-m"], "MODULE"),
    (["--grace-period", "-3"], "--grace-period"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD)
def test_bad_input_is_a_config_error(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        parse(argv)


@pytest.mark.parametrize(("argv", "needle"), BAD)
def test_bad_input_prints_one_line_and_exits_2(argv, needle, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_missing_script_and_module_exit_2(tmp_path, capsys) -> None:
    assert main([str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["-m", "no_such_module_xyz"]) == 2
    assert "no such module" in capsys.readouterr().err


def test_unwritable_snapshot_dir_exits_2(tmp_path, capsys) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    assert main(["--snapshot-dir", str(blocker / "snaps"), str(script)]) == 2
    err = capsys.readouterr().err
    assert "--snapshot-dir" in err and err.count("\n") == 1


def test_unwritable_remote_snapshot_dir_exits_2_without_leaking_secrets(tmp_path, capsys) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    url = "s3://user:hunter2@bucket-that-is-not-there/run"
    env_main = main(
        [
            "--snapshot-dir",
            url,
            str(script),
        ]
    )
    err = capsys.readouterr().err
    assert env_main == 2
    assert "hunter2" not in err


def test_unwritable_log_file_exits_2(tmp_path, capsys) -> None:
    (tmp_path / "a-file").write_text("")  # a log path below a regular file cannot be created
    assert main(["--log-file", str(tmp_path / "a-file" / "x.log"), "x.py"]) == 2
    assert "--log-file" in capsys.readouterr().err


# --- the built-in job's run folder and preflight -------------------------------------------
def test_builtin_job_without_snapshot_dir_gets_a_run_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = args.parse(["--job-id", "demo", "--node", "n/1"])
    assert cfg.worker.snapshot_dir == str(tmp_path / "runs" / "demo")
    assert cfg.worker.log_file == str(tmp_path / "runs" / "demo" / "events-n_1.jsonl")


def test_run_folder_never_overrides_what_the_user_chose(tmp_path) -> None:
    from elastic_trainer.supervisor.cli.args import with_run_folder

    script = tmp_path / "train.py"
    script.write_text("")
    user_script = args.parse([str(script)])
    assert with_run_folder(user_script, cwd=str(tmp_path)).worker.snapshot_dir is None
    chosen = args.parse(["--snapshot-dir", "s3://b/x", "--log-file", "/tmp/l.jsonl"])
    assert (chosen.worker.snapshot_dir, chosen.worker.log_file) == ("s3://b/x", "/tmp/l.jsonl")


@pytest.mark.parametrize(
    "job_flags",
    [["--model", "resnet9000"], ["--lr", "-1"], ["--dataset", "cifar10", "--data-dir", "/nope"]],
)
def test_bad_builtin_job_flags_are_one_line_and_exit_2_before_workers(
    tmp_path, monkeypatch, capsys, job_flags
) -> None:
    from elastic_trainer.supervisor.run import main

    monkeypatch.chdir(tmp_path)
    assert main(["--standalone", "--", *job_flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elastic-train: error: ") and "\n" not in err
    log = next((tmp_path / "runs").rglob("events-*.jsonl"))
    assert "workers.started" not in log.read_text()


def test_local_addr_flag_and_pet_variable() -> None:
    assert args.parse(["--local-addr", "127.0.0.15", "x.py"]).local_addr == "127.0.0.15"
    assert args.parse(["--local_addr=127.0.0.16", "x.py"]).local_addr == "127.0.0.16"
    assert args.parse(["x.py"], env={"PET_LOCAL_ADDR": "127.0.0.17"}).local_addr == "127.0.0.17"
    assert args.parse(["x.py"], env={}).local_addr is None


def test_the_rendezvous_node_is_advertised_at_local_addr() -> None:
    """--local-addr reaches torch's node descriptor (what peers dial for MASTER_ADDR)."""
    import socket

    from elastic_trainer.supervisor import torch_compat
    from elastic_trainer.supervisor.rendezvous.handler import create_handler

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = args.parse(
        [
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-conf",
            "is_host=true",
            "--local-addr",
            "127.0.0.9",
            "x.py",
        ],
        env={},
    )
    handler = create_handler(cfg, key=JobKey.generate(), serve=True)
    assert torch_compat.this_node(handler).addr == "127.0.0.9"


def test_nproc_auto_counts_the_allocation_not_the_host(monkeypatch) -> None:
    from elastic_trainer.supervisor.cli import allocation

    monkeypatch.setattr(allocation, "read_cuda_devices", lambda: 0)
    monkeypatch.setattr(allocation, "read_cpu_quota", lambda: None)
    monkeypatch.setattr(allocation, "read_affinity", lambda host: 64)
    env = {"SLURM_CPUS_ON_NODE": "1"}  # this 2-CPU host, allocated one CPU
    assert args.parse(["--nproc-per-node", "auto", "x.py"], env=env).nproc_per_node == 1


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--standalone", "--min-nodes", "3", "--max-nodes", "2"], "--standalone runs exactly one"),
        (["--standalone", "--nnodes", "2"], "--standalone runs exactly one"),
        (["--standalone", "--rdzv-endpoint", "127.0.0.1:29400"], "drop --rdzv-endpoint"),
        (["--rdzv-endpoint", "127.0.0.1:"], "ends in ':' without a port"),
        (["--rdzv-endpoint", "[::1:29400"], "opens '[' without ']'"),
        (["--rdzv-endpoint", "[::1]29400"], "use [IPV6]:PORT"),
        (["--rdzv-endpoint", ":29400"], "has no host"),
    ],
)
def test_malformed_node_and_endpoint_flags_are_named(argv, words) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        args.parse([*argv, "x.py"], env={})


def test_standalone_with_one_node_spelled_out_is_fine() -> None:
    assert args.parse(["--standalone", "--nnodes", "1", "x.py"], env={}).max_nodes == 1


def test_snapshot_storage_that_does_not_answer_is_exit_1_within_the_storage_timeout(
    tmp_path, monkeypatch, capsys
) -> None:
    """A refused S3 endpoint at start-up is transient (exit 1, retried by the platform), and
    bounded by --storage-timeout instead of botocore's own minute of retries."""
    import socket
    import time

    pytest.importorskip("s3fs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x")):
        monkeypatch.setenv(name, value)
    script = tmp_path / "x.py"
    script.write_text("")
    began = time.monotonic()
    argv = ["--standalone", "--snapshot-dir", "s3://bucket/run", "--storage-timeout", "3"]
    code = main([*argv, str(script)])
    assert code == 1
    *retries, last = capsys.readouterr().err.strip().splitlines()
    assert last.startswith("elastic-train: error: --snapshot-dir='s3://bucket/run' did not answer")
    assert all('"snapshot.storage_retry"' in line for line in retries)  # warnings, no chatter
    assert time.monotonic() - began < 60  # bounded (the bug was minutes): not a timing target


def test_an_unwritable_snapshot_dir_is_still_exit_2(tmp_path, capsys) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    script = tmp_path / "x.py"
    script.write_text("")
    if os.access(folder, os.W_OK):  # root ignores modes: use a path below a file instead
        folder = tmp_path / "x.py" / "below-a-file"
    assert main(["--standalone", "--snapshot-dir", str(folder), str(script)]) == 2
    assert "is not writable" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("supervisor_flags", "job_flags", "words"),
    [
        ([], ["--model", "vit_b_16"], "vit_b_16"),
        (["--nproc-per-node", "3"], ["--global-batch-size", "64"], "not divisible"),
    ],
)
def test_the_crash_loops_of_issue_9_are_refused_before_any_worker(
    tmp_path, monkeypatch, capsys, supervisor_flags, job_flags, words
) -> None:
    """Both passed the old preflight; every worker then exited 2 and was restarted 3 times."""
    monkeypatch.chdir(tmp_path)
    assert main(["--standalone", *supervisor_flags, "--", *job_flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elastic-train: error: ") and words in err and "\n" not in err
    log = next((tmp_path / "runs").rglob("events-*.jsonl"))
    assert "workers.started" not in log.read_text()


def test_every_option_has_an_elastic_train_variable_and_the_flag_wins() -> None:
    env = {
        "ELASTIC_TRAIN_MAX_RESTARTS": "7",
        "ELASTIC_TRAIN_SNAPSHOT_DIR": "memory://env",
        "ELASTIC_TRAIN_STANDALONE": "true",
        "PET_MAX_RESTARTS": "1",  # torchrun's: ours wins over it
    }
    cfg = args.parse(["x.py"], env=env)
    assert (cfg.max_restarts, cfg.worker.snapshot_dir, cfg.max_nodes) == (7, "memory://env", 1)
    assert args.parse(["--max-restarts", "2", "x.py"], env=env).max_restarts == 2
    with pytest.raises(ConfigError, match="invalid int value: 'many'"):
        args.parse(["x.py"], env={"ELASTIC_TRAIN_MAX_RESTARTS": "many"})
    with pytest.raises(ConfigError, match="ELASTIC_TRAIN_STANDALONE='maybe' is invalid"):
        args.parse(["x.py"], env={"ELASTIC_TRAIN_STANDALONE": "maybe"})


def test_version_and_help_list_the_sub_commands(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "elastic-train 0.1.0"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"elastic-train {c} " in out for c in SUBCOMMANDS)


def test_job_flags_before_the_separator_get_a_hint(capsys) -> None:
    assert main(["--epochs", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown option --epochs" in err and "go after `--`" in err


@pytest.mark.parametrize("argv", [["--max-node", "4"], ["--max-node=4"], ["--max-node=4", "x.py"]])
def test_an_unknown_option_names_the_closest_flag_and_abbreviations_are_off(
    argv: list[str], capsys
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "elastic-train: error: unknown option --max-node: did you mean --max-nodes?"


def test_a_separator_after_script_is_not_passed_to_the_job() -> None:
    assert parse(["x.py", "--", "--lr", "1"]).entrypoint.args == ("--lr", "1")
    assert parse(["-m", "pkg", "--", "--", "a"]).entrypoint.args == ("--", "a")


PREFLIGHTED_JOB = """
import argparse

def parser():
    p = argparse.ArgumentParser(prog="myjob")
    p.add_argument("--lr", type=float, default=0.1)
    return p

def preflight(argv, world_sizes):
    parser().parse_args(argv)

if __name__ == "__main__":
    parser().parse_args()
    print("TRAINED")
"""


@pytest.mark.parametrize("sep", [["--"], []])
def test_the_jobs_help_prints_and_exits_0(tmp_path, capfd, sep: list[str]) -> None:
    script = tmp_path / "myjob.py"
    script.write_text(PREFLIGHTED_JOB)  # its preflight runs the parser, which exits on --help
    assert cli_main(["--standalone", str(script), *sep, "--help"]) == 0
    out = capfd.readouterr().out
    assert "usage: myjob" in out and "--lr" in out and "TRAINED" not in out


def test_the_builtin_jobs_help_prints_and_exits_0(capfd) -> None:
    assert cli_main(["--", "--help"]) == 0
    out, err = capfd.readouterr()
    assert "--epochs" in out and "error" not in err


def test_gloo_uses_the_interface_of_local_addr_unless_the_operator_chose() -> None:
    from elastic_trainer.supervisor.processes.workerenv import point_gloo_at

    environ: dict[str, str] = {}
    point_gloo_at("127.0.0.1", environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "lo"}
    chosen = {"GLOO_SOCKET_IFNAME": "eth1"}
    point_gloo_at("127.0.0.1", chosen)
    assert chosen == {"GLOO_SOCKET_IFNAME": "eth1"}
    nowhere: dict[str, str] = {}
    point_gloo_at("127.0.0.77", nowhere)  # on no interface of this machine: left to gloo
    assert nowhere == {}
