"""The documentation's code blocks are what a reader pastes: each must be accepted as written.

Every ``elastic-train ...`` line in a ```bash/```console block parses with the real argument
parser of its (sub)command, and the built-in job's own flags after ``--`` with the job's
parser; every ```python block compiles; every ```yaml block loads. In a usage synopsis
(``snapshots prune URL --keep K [--dry-run]``) the brackets are dropped and an ALL-CAPS word
is a placeholder. A block that is not meant to run has ``<!-- not-tested: reason -->`` on the
line before its fence.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from elastic_trainer import cli
from elastic_trainer.jobs import config as job_config
from elastic_trainer.supervisor.cli import args as supervisor_args
from elastic_trainer.tools import status, store_server
from elastic_trainer.tools.report import cli as report_cli
from snapshots import cli as snapshots_cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted({ROOT / "README.md"} | set((ROOT / "docs").glob("**/*.md")))
BLOCK = re.compile(r"^(?:(?P<mark><!--.*?-->)\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)
NOT_TESTED = re.compile(r"<!-- not-tested: \S.*-->")
SHELL = {"bash", "console", "sh", "shell"}
OPERATORS = {"&&", "||", ";", "|", "&"}
BUILTIN_JOB = "elastic_trainer.jobs.default"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(langs: set[str]) -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m["lang"] in langs and not (m["mark"] and NOT_TESTED.fullmatch(m["mark"])):
                line = text.count("\n", 0, m.start("lang")) + 1
                found.append(Block(page, line, m["lang"], m["body"]))
    return found


def commands(body: str) -> list[list[str]]:
    """A shell block -> its simple commands as words (continuations joined, comments and
    ``$`` prompts dropped, split at ``&&``, ``;``, ``|``...)."""
    text = body.replace("\\\n", " ")
    out: list[list[str]] = []
    for line in text.splitlines():
        lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for word in [*lexer, ";"]:
            if word not in OPERATORS:
                words.append(word)
                continue
            if words:
                out.append(words)
            words = []
    return out


def unplaceholder(words: Sequence[str]) -> list[str]:
    """A usage synopsis -> an argv: ``[--step N]`` -> ``--step 1``, ``URL`` -> ``1``."""
    out = []
    for word in words:
        word = word.strip("[]")
        if word:
            out.append("1" if re.fullmatch(r"[A-Z][A-Z_]*", word) else word)
    return out


def _supervise(argv: list[str]) -> None:
    cfg = supervisor_args.parse(argv, env={})
    if supervisor_args.runs_builtin_job(cfg):
        job_config.parse_args(list(cfg.entrypoint.args))


PARSERS: dict[str, Callable[[list[str]], object]] = {
    "snapshots": lambda argv: snapshots_cli._parser("elastic-train snapshots").parse_args(argv),
    "report": lambda argv: report_cli.build_parser().parse_args(argv),
    "status": lambda argv: status.build_parser().parse_args(argv),
    "store": store_server.parse_args,
}


def check(words: list[str]) -> None:
    """Parse one ``elastic-train`` or ``python -m <built-in job>`` command; raises if refused."""
    argv = unplaceholder(words)
    if argv[:3] == ["python", "-m", BUILTIN_JOB]:
        job_config.parse_args(argv[3:])
    elif argv[1:2] and argv[1] in PARSERS:
        PARSERS[argv[1]](argv[2:])
    else:
        _supervise(argv[1:])


def checked_commands() -> list[tuple[str, list[str]]]:
    return [
        (block.where, words)
        for block in blocks(SHELL)
        for words in commands(block.body)
        if words[0] == "elastic-train" or words[:3] == ["python", "-m", BUILTIN_JOB]
    ]


def test_every_subcommand_has_a_parser_here() -> None:
    assert set(PARSERS) == set(cli.SUBCOMMANDS)


def test_the_docs_have_commands_to_check() -> None:
    pages = {where.split(":")[0] for where, _ in checked_commands()}
    assert {"README.md", "docs/deploying.md", "docs/snapshots.md"} <= pages, pages


@pytest.mark.parametrize(
    ("where", "words"), checked_commands(), ids=[w for w, _ in checked_commands()]
)
def test_command_parses(where: str, words: list[str]) -> None:
    try:
        check(words)
    except (Exception, SystemExit) as exc:
        pytest.fail(f"{where}: {shlex.join(words)!r} is refused: {exc}")


def test_a_wrong_flag_is_caught() -> None:
    with pytest.raises((Exception, SystemExit)):
        check(["elastic-train", "snapshots", "prune", "URL", "--keep-last", "K"])
    with pytest.raises((Exception, SystemExit)):
        check(["elastic-train", "--min-nodes", "1", "--", "--epochz", "2"])


@pytest.mark.parametrize("block", blocks({"python"}), ids=lambda b: b.where)
def test_python_block_compiles(block: Block) -> None:
    compile(block.body, block.where, "exec")


@pytest.mark.parametrize("block", blocks({"yaml", "yml"}), ids=lambda b: b.where)
def test_yaml_block_loads(block: Block) -> None:
    assert yaml.safe_load(block.body) is not None, block.where


def test_not_tested_marks_give_a_reason() -> None:
    bare = [
        f"{page.relative_to(ROOT)}: {mark}"
        for page in PAGES
        for mark in re.findall(r"<!-- not-tested.*?-->", page.read_text())
        if not NOT_TESTED.fullmatch(mark)
    ]
    assert not bare, "write <!-- not-tested: reason -->:\n" + "\n".join(bare)


def _marked_command(page: Path, marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", page.read_text(), re.S)
    assert match, f"{page.relative_to(ROOT)} has no {marker} block"
    return match.group(1).strip()


@pytest.mark.parametrize("marker", ["run-command", "test-command"])
def test_the_site_landing_page_shows_the_readme_commands(marker: str) -> None:
    readme = _marked_command(ROOT / "README.md", marker)
    assert _marked_command(ROOT / "docs/index.md", marker) == readme
