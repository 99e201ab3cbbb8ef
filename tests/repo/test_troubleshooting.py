"""docs/troubleshooting.md has a row for every event a user can meet at warning or error level,
with the levels the code logs it at, and names no event the catalogue lacks.

The catalogue does not carry levels: they are read from the code the way it logs them, from
every ``emit`` call's ``level=`` (``info`` when absent; ``tests/repo/test_emit_sites.py`` reads
the calls) and, for the snapshots package, from ``snapshots.events._LEVELS``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

import snapshots.events
from elastic_trainer.contract import events
from tests import ROOT
from tests.repo.test_emit_sites import PACKAGES, find_sites

PAGE = ROOT / "docs" / "troubleshooting.md"
NOTICED = frozenset({"warning", "error", "critical"})
# a table row whose first cell is an event: | `peer.lost` | warning | ...
ROW = re.compile(r"^\| `(?P<event>[a-z_]+\.[a-z_.]+)` \| (?P<levels>[a-z, ]+) \|", re.M)
NAMESPACES = frozenset(name.split(".")[0] for name in events.CATALOGUE)
MENTION = re.compile(r"`(?P<name>[a-z_]+\.[a-z_]+)`")


def emitted_levels() -> Mapping[str, frozenset[str]]:
    """Event name -> every level a call in the code logs it at."""
    levels: dict[str, set[str]] = defaultdict(set)
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for site in find_sites(path.read_text(), where):
            if site.name is None:
                continue
            if site.emitter.module == snapshots.events.__name__:
                levels[site.name].add(snapshots.events._LEVELS.get(site.name, "info"))
            else:
                levels[site.name].update(site.levels or ("info",))
    return {name: frozenset(found) for name, found in levels.items()}


def noticed() -> Mapping[str, frozenset[str]]:
    """The events a user meets at warning or error level, with all their levels."""
    return {name: lv for name, lv in emitted_levels().items() if lv & NOTICED}


def page_rows(text: str) -> Mapping[str, frozenset[str]]:
    rows: dict[str, frozenset[str]] = {}
    for m in ROW.finditer(text):
        rows[m["event"]] = frozenset(w.strip() for w in m["levels"].split(","))
    return rows


def test_levels_are_read_from_the_code() -> None:
    found = noticed()
    assert found["worker.failed"] == {"warning", "error"}, found.get("worker.failed")
    assert found["snapshot.failed"] == {"error"}
    assert "session.started" not in found


def test_every_warning_and_error_event_has_a_row() -> None:
    rows = page_rows(PAGE.read_text())
    missing = sorted(set(noticed()) - set(rows))
    assert not missing, f"add a row (| `event` | level | cause | fix |) to {PAGE.name}: {missing}"


def test_each_row_gives_the_levels_the_code_logs() -> None:
    levels = emitted_levels()
    rows = page_rows(PAGE.read_text())
    wrong = {
        name: (sorted(given), sorted(levels.get(name, ())))
        for name, given in rows.items()
        if given != levels.get(name, given)
    }
    assert not wrong, f"page levels vs the code's (page, code): {wrong}"


def test_the_page_names_only_catalogued_events() -> None:
    text = PAGE.read_text()
    named = {m["name"] for m in MENTION.finditer(text) if m["name"].split(".")[0] in NAMESPACES}
    named |= set(page_rows(text))
    unknown = sorted(named - set(events.CATALOGUE))
    assert not unknown, f"{PAGE.name} names events the catalogue lacks: {unknown}"


def test_a_missing_row_and_an_unknown_event_are_caught() -> None:
    rows = page_rows("| `peer.lost` | warning | cause | fix |\n| `peer.gone` | error | c | f |\n")
    assert set(noticed()) - set(rows), "a page with one row must miss the others"
    assert "peer.gone" in set(rows) - set(events.CATALOGUE)
