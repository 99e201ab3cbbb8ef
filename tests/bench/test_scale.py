"""bench/scale.py: the growth laws on hand-computed points, the table, and the harness itself
on three real agents (formation, node loss, join, store-host loss all complete)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _scale_calc import Phase, RoundTraffic, law, linear, power, quadratic, table

BENCH = Path(__file__).resolve().parents[2] / "bench"

NS = [8.0, 16.0, 32.0, 64.0]


def test_a_line_is_fitted_exactly() -> None:
    fit = linear(NS, [0.2 + 0.005 * n for n in NS])
    assert (fit.a, fit.b, fit.r2) == pytest.approx((0.2, 0.005, 1.0))


def test_a_square_law_is_fitted_exactly_and_a_line_fits_it_worse() -> None:
    ys = [1.0 + 0.01 * n * n for n in NS]
    quad = quadratic(NS, ys)
    assert (quad.a, quad.b, quad.r2) == pytest.approx((1.0, 0.01, 1.0))
    assert linear(NS, ys).r2 < 0.99


def test_the_power_law_gives_the_exponent() -> None:
    fit = power(NS, [3.0 * n**1.5 for n in NS])
    assert (fit.a, fit.b) == pytest.approx((3.0, 1.5))
    assert power(NS, [0.4] * 4).b == pytest.approx(0.0)  # flat


def test_a_fit_needs_two_different_points() -> None:
    with pytest.raises(ValueError, match="two different"):
        linear([8.0, 8.0], [1.0, 2.0])
    assert law([8.0, 16.0], [1.0, None]) == "-"


def test_the_table_has_a_column_per_n_and_the_laws() -> None:
    records = [
        {"n": n, "node_loss": Phase(0.1 + 0.01 * n, 0.2 + 0.01 * n),
         "round": RoundTraffic(ops=4 * n, bytes=1000 * n * n), "idle": {"cpu_pct": 0.5}}
        for n in (8, 16, 32)
    ]  # fmt: skip
    text = table(records)
    row = next(line for line in text.splitlines() if line.startswith("| node loss: round"))
    assert "| 0.18 | 0.26 | 0.42 |" in row and "0.1 + 0.01·N (r² 1.00)" in row and "N^0." in row
    kb = next(line for line in text.splitlines() if line.startswith("| store kB, node-loss"))
    assert "| 64.0 | 256.0 | 1024.0 |" in kb and "N^2.00" in kb
    formed = next(line for line in text.splitlines() if line.startswith("| first formation: r"))
    assert formed.endswith("| - | - | - | - |")  # not measured: no law


@pytest.mark.timeout(420)
def test_the_harness_runs_three_real_agents_through_every_phase() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(BENCH / "scale.py"), "--nodes", "3", "--idle", "1", "--timeout", "90"],
        capture_output=True, text=True, timeout=400, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")[1]
        for line in done.stdout.splitlines()
        if line.startswith("| ") and " | N=3 " not in line
    }
    for label in (
        "node loss: round closed (s)",
        "join: round closed (s)",
        "store-host loss: workers started (s)",
        "store ops, node-loss re-form (all agents)",
        "node loss: round closed, first node to know (s)",
        "CPU of all agents, node-loss re-form (s)",
    ):
        assert math.isfinite(float(rows[label])) and float(rows[label]) > 0, label
    first = float(rows["node loss: round closed, first node to know (s)"])
    assert first <= float(rows["node loss: round closed (s)"])
    assert float(rows["TCP connections per agent (median)"]) >= 2  # the store, a peer at least
