"""The documentation site builds with ``mkdocs build --strict`` (a broken link, #anchor or
docstring fails it), and every page and every public name is on it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

import elastic_trainer
import snapshots

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    raise AssertionError(f"mkdocs.yml nav has an entry of type {type(nav).__name__}: {nav!r}")


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    assert (tmp_path / "api" / "index.html").exists()


def test_every_docs_page_is_in_the_nav() -> None:
    pages = {str(p.relative_to(DOCS)) for p in DOCS.glob("**/*.md")}
    nav = _nav_pages(_config()["nav"])
    assert sorted(nav) == sorted(set(nav)), f"a page is in the nav twice: {nav}"
    assert pages == set(nav), (
        f"docs pages not in mkdocs.yml nav: {sorted(pages - set(nav))}; "
        f"nav entries without a page: {sorted(set(nav) - pages)}"
    )


def test_the_nav_sections() -> None:
    sections = [next(iter(item)) for item in _config()["nav"]]
    assert sections == [
        "Home",
        "User guide",
        "Operations",
        "Architecture",
        "Benchmarks",
        "API reference",
    ]


def test_the_api_reference_covers_every_public_name() -> None:
    documented = set(re.findall(r"^::: (\S+)$", (DOCS / "api.md").read_text(), re.M))
    public = {
        f"{module.__name__}.{name}"
        for module in (elastic_trainer, snapshots)
        for name in module.__all__
        if not name.startswith("__")
    }
    assert public <= documented, f"add to docs/api.md: {sorted(public - documented)}"
