"""torchrun's command line works here: every flag of the installed torch's parser is known in
both spellings; the ones we cannot honour say why in one line; none is 'unrecognized'."""

from __future__ import annotations

import pytest
from torch.distributed.run import get_args_parser

from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor.cli import args, torchrun_flags

SAMPLE = {  # a valid value for each torchrun flag that takes one
    "--nnodes": "1",
    "--nproc-per-node": "1",
    "--rdzv-backend": "c10d",
    "--rdzv-endpoint": "127.0.0.1:29400",
    "--rdzv-id": "job",
    "--rdzv-conf": "join_timeout=900",
    "--max-restarts": "1",
    "--monitor-interval": "0.5",
    "--start-method": "spawn",
    "--event-log-handler": "null",
    "--role": "trainer",
    "--log-dir": "/tmp/logs",
    "--redirects": "3",
    "--tee": "3",
    "--log-line-prefix-template": "[${rank}]",
    "--local-ranks-filter": "0",
    "--node-rank": "0",
    "--master-addr": "127.0.0.1",
    "--master-port": "29500",
    "--local-addr": "127.0.0.1",
    "--shutdown-timeout": "5",
    "--signals-to-handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
}


def torchrun_options() -> list[tuple[str, bool]]:
    """(option string, takes a value) for every flag of the installed torch's parser."""
    found = []
    for action in get_args_parser()._actions:  # argparse has no public list of actions
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                found.append((option, action.nargs != 0))
    return found


@pytest.mark.parametrize(("option", "takes_value"), torchrun_options())
def test_every_torchrun_flag_is_known_in_every_spelling(option: str, takes_value: bool) -> None:
    parser = args.build_parser()
    known = {o for a in parser._actions for o in a.option_strings}
    assert option in known, f"{option} (torch's) is unknown to elastic-train"
    spelling = option.replace("_", "-")
    value = SAMPLE.get(spelling) or SAMPLE.get(option)
    argv = [option, value] if takes_value and value is not None else [option]
    if takes_value and value is None:
        argv = [option, "x"]  # a flag we refuse: any value gives one clear line
    try:
        args.parse([*argv, "x.py"], env={})
    except ConfigError as exc:
        assert "unrecognized" not in str(exc) and "\n" not in str(exc)
        assert spelling in str(exc) or option in str(exc)


def test_our_table_covers_the_torchrun_flags_we_do_not_define_ourselves() -> None:
    ours = {o for a in args.build_parser()._actions for o in a.option_strings}
    assert {option for option, _ in torchrun_options()} <= ours


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--numa-binding", "node"], "--numa-binding='node' cannot be honoured"),
        (["--virtual-local-rank"], "--virtual-local-rank=True cannot be honoured"),
        (["--event-log-handler", "console"], "own structured events"),
        (["--signals-to-handle", "SIGUSR2"], "handles SIGTERM, SIGINT and SIGUSR1 itself"),
        (["--tee", "3"], "give --log-dir DIR"),
        (["--redirects", "7"], "--redirects='7' is invalid"),
        (["--local-ranks-filter", "a,b"], "--local-ranks-filter='a,b' is invalid"),
        (["--start-method", "thread"], "--start-method='thread' is invalid"),
        (["--rdzv-backend", "etcd"], "--rdzv-backend='etcd' is not supported"),
        (["--nnodes", "1:3", "--node-rank", "0"], "fixed size"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "use 0 .. 1"),
    ],
)
def test_what_cannot_be_honoured_is_one_line_naming_the_flag(argv, words) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        args.parse([*argv, "x.py"], env={})
    assert words in str(info.value) and "\n" not in str(info.value)


def test_torchrun_defaults_are_always_accepted() -> None:
    cfg = args.parse(
        ["--event-log-handler", "null", "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
         "--start-method", "spawn", "--run-path", "x.py"],
        env={},
    )  # fmt: skip
    assert cfg.entrypoint.script == "x.py"


@pytest.mark.parametrize(("node_rank", "hosts"), [("0", True), ("1", False)])
def test_static_mode_is_a_fixed_size_c10d_rendezvous_hosted_by_node_rank_0(node_rank, hosts):
    cfg = args.parse(
        ["--nnodes", "2", "--node-rank", node_rank, "--master-addr", "127.0.0.21",
         "--master-port", "1234", "x.py"],
        env={},
    )  # fmt: skip
    assert (cfg.rdzv_host, cfg.rdzv_port, cfg.is_host) == ("127.0.0.21", 1234, hosts)
    assert (cfg.min_nodes, cfg.max_nodes) == (2, 2)
    assert cfg.local_addr == ("127.0.0.21" if hosts else None)  # MASTER_ADDR, as torchrun's
    assert cfg.torchrun.node_rank == int(node_rank)  # the group rank the rendezvous gives


@pytest.mark.parametrize(
    "argv",
    [["--rdzv-endpoint", "[::1]:29400"], ["--nnodes", "2", "--master-addr", "::1",
                                          "--master-port", "29400", "--node-rank", "1"]],
)  # fmt: skip
def test_an_ipv6_endpoint_is_shown_as_it_is_given_back(argv) -> None:
    cfg = args.parse([*argv, "x.py"], env={})
    assert (cfg.rdzv_host, cfg.rdzv_endpoint) == ("::1", "[::1]:29400")


def test_elastic_mode_keeps_the_rendezvous_ranks() -> None:
    assert args.parse(["--nnodes", "1:2", "x.py"], env={}).torchrun.node_rank is None


def test_static_mode_local_addr_flag_wins_over_master_addr() -> None:
    cfg = args.parse(
        ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.21", "--local-addr",
         "127.0.0.29", "x.py"],
        env={},
    )  # fmt: skip
    assert cfg.local_addr == "127.0.0.29"


def test_static_mode_defaults_and_pet_variables_as_torchrun() -> None:
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_RDZV_BACKEND": "static"}
    cfg = args.parse(["x.py"], env=env)
    assert (cfg.rdzv_host, cfg.rdzv_port, cfg.is_host) == ("127.0.0.1", 29500, False)
    assert cfg.torchrun.node_rank == 1


def test_logging_flags_reach_the_config_with_their_pet_variables() -> None:
    env = {"PET_LOG_DIR": "/tmp/l", "PET_TEE": "3", "PET_LOCAL_RANKS_FILTER": "0,1"}
    cfg = args.parse(["--role", "worker", "--shutdown-timeout", "7", "x.py"], env=env)
    options = cfg.torchrun
    assert (options.log_dir, options.tee, options.local_ranks_filter) == ("/tmp/l", "3", {0, 1})
    assert (options.role, options.shutdown_timeout) == ("worker", 7.0)


def test_no_python_runs_the_executable_itself() -> None:
    from elastic_trainer.supervisor.processes import workerenv

    cfg = args.parse(["--no-python", "/bin/echo", "hello"], env={})
    assert workerenv.worker_entrypoint(cfg) == "/bin/echo"
    assert workerenv.worker_args(cfg) == ("hello",)


def test_flags_table_is_consistent() -> None:
    dests = [f.dest for f in torchrun_flags.FLAGS]
    assert len(dests) == len(set(dests))
    assert all(f.env == f"PET_{f.dest.upper()}" for f in torchrun_flags.FLAGS)
