"""A page that shows an example file shows it verbatim: every ``<!-- example: PATH -->`` block in
README.md and docs/ equals that file without its module docstring (the example itself is run by
``tests/e2e/test_example.py``)."""

from __future__ import annotations

import re

import pytest

from tests import ROOT

PAGES = sorted({ROOT / "README.md"} | set((ROOT / "docs").glob("**/*.md")))
EXAMPLE = re.compile(r"<!-- example: (?P<path>\S+) -->\s*```python\n(?P<body>.+?)```", re.S)


def without_docstring(code: str) -> str:
    return code[code.index('"""', 3) + 3 :].lstrip("\n") if code.startswith('"""') else code


def shown_examples() -> list[tuple[str, str, str]]:
    return [
        (f"{page.relative_to(ROOT)}:{m['path']}", m["path"], m["body"])
        for page in PAGES
        for m in EXAMPLE.finditer(page.read_text())
    ]


def test_the_site_shows_the_example() -> None:
    shown = {where.split(":")[0] for where, _, _ in shown_examples()}
    assert "docs/fault-tolerant-script.md" in shown, shown


@pytest.mark.parametrize(("where", "path", "body"), shown_examples(), ids=lambda v: str(v)[:60])
def test_example_block_is_the_file(where: str, path: str, body: str) -> None:
    assert body == without_docstring((ROOT / path).read_text()), f"{where} differs from {path}"


def test_a_changed_block_is_caught() -> None:
    code = (ROOT / "examples/fault_tolerant_ddp.py").read_text()
    assert without_docstring(code) != without_docstring(code).replace("seed=0", "seed=1")
