"""bench/scale.py's arithmetic: growth laws fitted to (N, value) points, and the table.

Three laws, each by least squares: ``a + b*N`` (linear), ``a + b*N^2`` (quadratic) and
``a*N^k`` (a power law, fitted as a line in log-log). The power law's exponent ``k`` is the
figure that survives noise best: ~0 flat, ~1 linear, ~2 quadratic.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Phase:
    round_closed: float | None = None  # seconds from the fault to the last node's round
    workers_started: float | None = None  # ... to the last node's workers started
    first_closed: float | None = None  # ... to the first node's round (it is closed by then)


@dataclasses.dataclass(frozen=True)
class RoundTraffic:
    ops: int = 0  # store operations of all agents during the re-form
    bytes: int = 0  # their keys and values, both ways
    agent_cpu_ms: float | None = None  # an agent's own CPU time in it (median; workers apart)
    cpu_s: float | None = None  # all agents' together: / cores, the floor on one machine


@dataclasses.dataclass(frozen=True)
class Fit:
    a: float
    b: float
    r2: float  # of the fitted law, on the points as given (log-log for the power law)


def least_squares(xs: list[float], ys: list[float]) -> Fit:
    """y = a + b*x; r2 the coefficient of determination (1.0 for a constant y)."""
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError("a fit needs at least two points, as many x as y")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs at least two different x")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return Fit(a, b, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


def linear(ns: list[float], ys: list[float]) -> Fit:
    return least_squares(ns, ys)


def quadratic(ns: list[float], ys: list[float]) -> Fit:
    return least_squares([n * n for n in ns], ys)


def power(ns: list[float], ys: list[float]) -> Fit:
    """y = a * N^b (b: the exponent); points with y <= 0 are left out (no logarithm)."""
    pairs = [(n, y) for n, y in zip(ns, ys, strict=True) if y > 0 and n > 0]
    fit = least_squares([math.log(n) for n, _ in pairs], [math.log(y) for _, y in pairs])
    return Fit(math.exp(fit.a), fit.b, fit.r2)


def law(ns: list[float], ys: list[float | None]) -> str:
    """The three laws of the points that have a value, in one cell."""
    pairs = [(n, y) for n, y in zip(ns, ys, strict=True) if y is not None]
    if len(pairs) < 2 or len({n for n, _ in pairs}) < 2:
        return "-"
    xs, vs = [float(n) for n, _ in pairs], [float(y) for _, y in pairs]
    lin, quad = linear(xs, vs), quadratic(xs, vs)
    text = (
        f"{_g(lin.a)} + {_g(lin.b)}·N (r² {lin.r2:.2f}); "
        f"{_g(quad.a)} + {_g(quad.b)}·N² (r² {quad.r2:.2f})"
    )
    if all(v > 0 for v in vs):
        pw = power(xs, vs)
        text += f"; N^{pw.b:.2f}"
    return text


def _g(value: float) -> str:
    return f"{value:.3g}"


def cell(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


ROWS: tuple[tuple[str, str, int], ...] = (
    # (label, key in a job's flat record, digits)
    ("first formation: round closed (s)", "formation.round_closed", 2),
    ("first formation: workers started (s)", "formation.workers_started", 2),
    ("node loss: round closed (s)", "node_loss.round_closed", 2),
    ("node loss: round closed, first node to know (s)", "node_loss.first_closed", 2),
    ("node loss: workers started (s)", "node_loss.workers_started", 2),
    ("join: round closed (s)", "join.round_closed", 2),
    ("join: workers started (s)", "join.workers_started", 2),
    ("store-host loss: round closed (s)", "store_loss.round_closed", 2),
    ("store-host loss: workers started (s)", "store_loss.workers_started", 2),
    ("store ops, node-loss re-form (all agents)", "round.ops", 0),
    ("store kB, node-loss re-form (all agents)", "round.kb", 1),
    ("agent CPU, node-loss re-form (ms, median)", "round.agent_cpu_ms", 0),
    ("CPU of all agents, node-loss re-form (s)", "round.cpu_s", 2),
    ("store ops/s, idle (all agents)", "idle.ops_per_s", 0),
    ("store kB/s, idle (all agents)", "idle.kb_per_s", 1),
    ("TCP connections per agent (median)", "idle.conns", 0),
    ("TCP connections of the store host", "idle.host_conns", 0),
    ("idle agent CPU (% of a core, median)", "idle.cpu_pct", 2),
    ("idle agent USS (MB, median)", "idle.uss_mb", 1),
    ("idle agent PSS (MB, median)", "idle.pss_mb", 1),
)


def flat(record: dict[str, object]) -> dict[str, float | None]:
    """A job's record (``_scale_run.run_job``) as ``key -> number``, for the table's rows."""
    out: dict[str, float | None] = {}
    for name, value in record.items():
        if dataclasses.is_dataclass(value):
            for field, v in dataclasses.asdict(value).items():
                out[f"{name}.{field}"] = v
        elif isinstance(value, dict):
            for field, v in value.items():
                out[f"{name}.{field}"] = v
    if out.get("round.bytes") is not None:
        out["round.kb"] = out["round.bytes"] / 1000  # type: ignore[operator]
    if out.get("idle.bytes_per_s") is not None:
        out["idle.kb_per_s"] = out["idle.bytes_per_s"] / 1000  # type: ignore[operator]
    return out


def table(records: list[dict[str, object]]) -> str:
    """Markdown: one row per measure, one column per N, and the fitted laws."""
    ns = [float(r["n"]) for r in records]  # type: ignore[arg-type]
    flats = [flat(r) for r in records]
    head = "| measure | " + " | ".join(f"N={int(n)}" for n in ns) + " | fit (least squares) |"
    lines = [head, "|---|" + "---|" * len(ns) + "---|"]
    for label, key, digits in ROWS:
        values = [f.get(key) for f in flats]
        cells = " | ".join(cell(v, digits) for v in values)
        lines.append(f"| {label} | {cells} | {law(ns, values)} |")
    return "\n".join(lines)
