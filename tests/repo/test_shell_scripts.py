"""The Python our shell scripts carry (``bench/gpu_check.sh``'s heredoc, say) names modules of
ours that exist: such a script runs only where CI does not (a GPU machine), and a module that
moved stopped it at its first line there."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p for folder in ("bench", ".ci", "deploy") for p in (ROOT / folder).glob("**/*.sh")
)
OURS = re.compile(r"^\s*from ((?:elastic_trainer|snapshots)(?:\.\w+)*) import ([\w, ]+)$", re.M)
RUN_MODULE = re.compile(r"-m ((?:elastic_trainer|snapshots)(?:\.\w+)*)")


def test_there_are_scripts_with_python_of_ours_to_check():
    assert any(OURS.search(p.read_text()) for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_and_module_of_ours_a_script_names_exists(script: Path):
    text = script.read_text()
    for module, names in OURS.findall(text):
        imported = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(imported, name), f"{script.name}: {module} has no {name}"
    for module in RUN_MODULE.findall(text):
        assert importlib.util.find_spec(module) is not None, f"{script.name}: no {module}"
