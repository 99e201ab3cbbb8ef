"""One declaration per setting: every flag round-trips flag > ELASTIC_TRAIN_* > PET_* > default,
shows its default in --help, refuses a bad value in one line (exit 2), and has its row in
docs/command-line.md exactly as declared."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from elastic_trainer.cliparse import OneLineParser
from elastic_trainer.contract import protocol
from elastic_trainer.contract.config import RendezvousTuning, RunConfig, supervisor_flags
from elastic_trainer.contract.protocol import WorkerSettings
from elastic_trainer.contract.settings import (
    SWITCH,
    TOGGLE,
    VALUE,
    Setting,
    declared,
    env_defaults,
    flagged,
    lookup,
    resolve,
)
from elastic_trainer.errors import ConfigError
from elastic_trainer.jobs import config as job_config
from elastic_trainer.jobs.config import JobConfig
from elastic_trainer.supervisor.cli import args, torchrun_flags
from elastic_trainer.supervisor.run import main

DOC = Path(__file__).parents[3] / "docs" / "command-line.md"
# a valid sample is the first that parses (and is not the default); another, the next
CANDIDATES = ("7", "8", "1.5", "auto", "json", "console", "x", "y")
BAD = "bogus!"
SUPERVISOR = supervisor_flags()
EVERY = (*SUPERVISOR, *torchrun_flags.FLAGS, *declared(JobConfig).values())


def valid(how: Setting, raw: str) -> bool:
    try:
        return how.check(how.parse(raw)) is None and how.parse(raw) != how.default
    except ValueError:
        return False


def sample(how: Setting) -> str:
    return next(raw for raw in CANDIDATES if valid(how, raw))


def parser_of(how: Setting, env: dict[str, str]) -> argparse.ArgumentParser:
    p = OneLineParser(prog="t")
    how.add_to(p)
    p.set_defaults(**env_defaults([how], env))
    return p


def given(how: Setting) -> tuple[list[str], object]:
    """(argv that gives it, the value it gives)."""
    if how.kind == VALUE:
        raw = sample(how)
        return [how.flags[0], raw], how.parse(raw)
    return [how.flags[0]], True


@pytest.mark.parametrize("how", EVERY, ids=lambda h: h.flags[0])
def test_each_declaration_round_trips_flag_env_pet_and_default(how: Setting) -> None:
    argv, value = given(how)
    assert resolve(parser_of(how, {}).parse_args(argv), {}, how) == value  # the flag
    assert resolve(parser_of(how, {}).parse_args([]), {}, how) == how.default  # the default
    text = sample(how) if how.kind == VALUE else "true"
    if how.variable:  # ours: the flag's default, so the flag still wins
        ns = parser_of(how, {how.variable: text}).parse_args([])
        assert resolve(ns, {}, how) == value
        if how.kind == VALUE:
            other = next(r for r in CANDIDATES if r != text and valid(how, r))
            ns = parser_of(how, {how.variable: text}).parse_args([how.flags[0], other])
            assert resolve(ns, {}, how) == how.parse(other)
    if how.pet:  # torchrun's: after ours
        empty = parser_of(how, {}).parse_args([])
        assert resolve(empty, {how.pet: text}, how) == value
        if how.variable and how.kind == VALUE:
            ours = parser_of(how, {how.variable: text}).parse_args([])
            assert lookup(ours, {how.pet: BAD}, how) == value
    assert how.variables == tuple(v for v in (how.variable, how.pet) if v)


@pytest.mark.parametrize(
    ("name", "how"),
    [*flagged(RunConfig).items(), *flagged(WorkerSettings).items()],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_a_declared_field_reaches_the_run_config_from_its_flag_and_its_variable(name, how):
    argv, value = given(how)
    if name in ("min_nodes", "max_nodes"):
        argv = ["--min-nodes", "7", "--max-nodes", "7"]
    target = "worker" if name in flagged(WorkerSettings) else None

    def read(cfg: RunConfig) -> object:
        return getattr(cfg.worker if target else cfg, name)

    if name == "nproc_per_node":
        value = int(value)
    assert read(args.parse([*argv, "x.py"], env={})) == value
    assert read(args.parse(["x.py"], env={})) == getattr(
        WorkerSettings() if target else RunConfig(), name
    ) or name in ("node", "max_nodes")  # chosen at run time: the hostname, --min-nodes
    if how.variable and name not in ("min_nodes", "max_nodes"):
        text = argv[1] if how.kind == VALUE else "true"
        assert read(args.parse(["x.py"], env={how.variable: text})) == value


def test_every_flag_declared_once_in_every_spelling() -> None:
    spellings = [f for how in EVERY for f in how.flags]
    assert len(spellings) == len(set(spellings))
    assert all(how.kind in (VALUE, SWITCH, TOGGLE) for how in EVERY)
    # a worker setting's flag reads the variable the workers get
    assert all(how.variable == how.env_name for how in flagged(WorkerSettings).values())


@pytest.mark.parametrize("parser", [args.build_parser(), job_config.build_parser()])
def test_every_flag_shows_its_default_in_help(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:  # argparse has no public list of actions
        if action.dest not in ("help", "version"):
            assert action.help and re.search(r"\(default [^)]", action.help), action.dest


def rejects_bad(how: Setting) -> bool:
    try:
        how.parse(BAD)
    except ValueError:
        return True
    return False


CHECKED = [how for how in SUPERVISOR if how.kind == VALUE and rejects_bad(how)]


def test_most_values_are_checked_by_their_declaration() -> None:
    assert len(CHECKED) >= 12


@pytest.mark.parametrize("how", CHECKED, ids=lambda h: h.flag)
def test_a_bad_value_is_one_line_naming_the_flag_and_exit_2(how: Setting, capsys) -> None:
    for argv, env in (([how.flags[0], BAD], {}), ([], {how.variable: BAD})):
        with pytest.raises(ConfigError, match=re.escape(how.flag or "")) as info:
            args.parse([*argv, "x.py"], env=env)
        assert BAD in str(info.value) and "\n" not in str(info.value)
    assert main([how.flags[0], BAD, "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and how.flag in err and BAD in err
    if how.pet:
        with pytest.raises(ConfigError, match=re.escape(f"{how.flag}='{BAD}' is invalid")):
            args.parse(["x.py"], env={how.pet: BAD})


def table(heading: str) -> list[list[str]]:
    section = DOC.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


@pytest.mark.parametrize(
    ("heading", "declared"),
    [("## Flags", SUPERVISOR), ("## torchrun's flags", torchrun_flags.FLAGS)],
)
def test_the_docs_flag_tables_are_the_declarations(heading, declared) -> None:
    """Flags, variables and defaults exactly; each meaning begins with the flag's --help."""
    rows = table(heading)
    expected = [how.doc_row() for how in declared]
    lines = "\n".join(
        f"| {' | '.join(cells)} | {how.help} |"
        for cells, how in zip(expected, declared, strict=True)
    )
    assert [tuple(r[:3]) for r in rows] == expected, f"the rows of {heading} begin:\n{lines}"
    for row, how in zip(rows, declared, strict=True):
        assert row[3].startswith(how.help), how.flag


def test_the_docs_list_every_variable_the_supervisor_sets_for_workers() -> None:
    listed = {row[0].strip("`") for row in table("## The workers' environment")}
    assert listed == set(protocol.worker_variables())


def test_the_builtin_jobs_flag_table_is_its_declarations() -> None:
    page = DOC.parent / "built-in-job.md"
    rows = [
        [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        for line in page.read_text().splitlines()
        if line.startswith("| `--")
    ]
    declared_ = list(declared(JobConfig).values())
    assert [(r[0], r[1]) for r in rows] == [how.doc_row()[::2] for how in declared_]
    for row, how in zip(rows, declared_, strict=True):
        assert row[2].startswith(how.help), how.flag
        assert how.variables == ()  # the job reads its command line only


def test_the_api_page_says_the_declared_collective_timeout() -> None:
    from elastic_trainer.worker.distributed import init_worker

    shown = f"{protocol.DEFAULT_COLLECTIVE_TIMEOUT_S:g} s by default"
    assert shown in " ".join((init_worker.__doc__ or "").split())


def test_the_docs_recovery_defaults_are_rendezvous_tunings() -> None:
    """--rdzv-conf's keys: the table's defaults are RendezvousTuning's, key for key."""
    rows = table("## Recovery defaults")
    documented = {r[0].strip("`"): r[1].removesuffix(" s") for r in rows if r[0] != "`is_host`"}
    declared_ = {f.name: f"{f.default:g}" for f in dataclasses.fields(RendezvousTuning)}
    assert documented == declared_
