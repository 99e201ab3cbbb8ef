"""Which rank is a straggler: a pure verdict from the group's per-step compute times.

Every rank of a ``TrainingSession`` puts its own compute time of a step (the step's wall time
less its waits in collectives, ``worker.step_timing``) into its slot of the step's all-reduce,
so every rank holds the same vector of the group's compute times after every step and runs
this function on it: every rank reaches the same verdict without another collective.

A rank is compared with the other ranks (at two ranks the other one; at many ranks the
group's median). One step's ratio is noise on a shared machine (a scheduler tick, a snapshot
on rank 0), so the verdict looks at the last ``window`` steps: each rank's typical compute
(the window's low median: more than half its steps at least this slow) over the others'
typical compute. A slowdown is *detected* once that ratio reaches ``threshold`` (and the
excess ``min_excess_s``, so the jitter of tiny steps never counts) for ``confirm`` steps in a
row, the slowdown has lasted ``sustain_s`` of the group's steps (or ``sustain_steps`` of them,
however short) since it began, and most of its last ``confirm`` steps are still slow; it is
*recovered* once the ratio falls below ``recover_below`` (hysteresis: a rank hovering at
the threshold does not flap). On a noisy machine both bars rise: the ratio must also stand
``noise_z`` standard deviations of a window's median above 1, from the step-to-step noise
the ranks show (measured over ``noise_steps``, at least two windows before any verdict).

With a window of 14 a slowdown that starts at step s makes the window say slow at step s + 7
(8 slow steps make the majority); it is reported at s + 9 where 0.7 s has passed by then
(steps of 70 ms or more) and at s + 15 at the latest where steps are shorter: within the 20
steps the issue asks for on a quiet machine (later only where the noise raises the bar). A
slowdown that comes and goes (a rank stopped on a duty cycle is slow in about two steps of
three) makes the window's majority steps later, but its time is counted from where it began:
its first slow step not behind three healthy ones in a row. A single spike, or seven in
fourteen, never makes the majority; a co-tenant that takes a shared core for under 0.7 s (or
16 steps) is not reported, nor is a burst that ended before then (the window says slow for
half a window after it).

Every rank runs this after every step, so its cost is per step and per rank of the group: the
figures are kept as tensors (a window of steps by ranks) and each step is a fixed number of
tensor operations whatever the world size; only the ranks flagged or about to be are looked at
one by one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True, kw_only=True)
class StragglerPolicy:
    threshold: float = 1.10  # compute this many times the others' median: slow
    recover_below: float = 1.05  # ... and below this again: recovered
    window: int = 14  # steps whose median ratio decides
    confirm: int = 3  # steps in a row the window must say slow before it is reported
    # ... and for this long (the group's steps' time): a co-tenant that takes a shared core for
    # a moment makes a real 1.5-2x straggler for that moment, not one worth a report (0.7 s:
    # the shortest floor that left no report in 30-minute healthy runs, docs/benchmarks.md)
    sustain_s: float = 0.7
    # ... or for this many steps, however short (both counted from where the slowdown began): it
    # is reported within 20 steps of its onset; fewer let co-tenants' bursts through at steps of
    # ~60 ms (docs/benchmarks.md#stragglers)
    sustain_steps: int = 16
    min_excess_s: float = 0.002  # a smaller median excess over the others is jitter
    warmup_steps: int = 5  # an attempt's first steps (lazy start-up, DDP's bucket rebuild)
    # a slowdown must also stand this many standard deviations of a window's median above the
    # noise the group's ranks show step to step (a shared 2-core machine: +-25 % a step)
    noise_z: float = 5.0
    noise_steps: int = 100  # steps the noise is measured over

    def __post_init__(self) -> None:
        if not 1.0 < self.recover_below <= self.threshold:
            raise ValueError("StragglerPolicy: need 1 < recover_below <= threshold")
        if self.window < 1 or self.min_excess_s < 0 or self.warmup_steps < 0:
            raise ValueError("StragglerPolicy: window >= 1, min_excess_s >= 0, warmup >= 0")
        if self.noise_z < 0 or self.noise_steps < 1:
            raise ValueError("StragglerPolicy: noise_z >= 0, noise_steps >= 1")
        if self.confirm < 1 or self.sustain_s < 0 or self.sustain_steps < self.confirm:
            raise ValueError(
                "StragglerPolicy: confirm >= 1, sustain_s >= 0, sustain_steps >= confirm"
            )


@dataclass(frozen=True)
class Straggler:
    """An ongoing slowdown of one rank."""

    rank: int
    since_step: int  # the onset: the first slow step of the run that detected it
    detected_step: int
    slowdown: float  # the median ratio of its steps from the onset (at recovery: the window's)
    waited_s: float = 0.0  # the others' time waiting for it since detected


@dataclass(frozen=True)
class Verdict:
    """A change to report: ``detected`` or ``recovered`` (with the episode's figures)."""

    kind: str
    straggler: Straggler
    step: int


DETECTED, RECOVERED = "detected", "recovered"
_EMPTY = torch.empty(0, dtype=torch.float64)


@dataclass(frozen=True)
class Watch:
    """The verdict's state: the ranks' last ``window`` steps (compute, and its ratio to the
    others' median that step: rows are steps, columns ranks), the ongoing slowdowns, and the
    time the group spent waiting for its slowest rank (each step: the slowest compute less
    the median). Tensors are never changed in place: each step makes new ones."""

    compute: torch.Tensor = field(default=_EMPTY)  # (steps, ranks), seconds
    ratio: torch.Tensor = field(default=_EMPTY)  # (steps, ranks)
    steps: tuple[int, ...] = ()  # the step of each row
    flagged: Mapping[int, Straggler] = field(default_factory=dict)
    slow_streak: torch.Tensor = field(default=_EMPTY)  # (ranks,): steps the window said slow
    onset: torch.Tensor = field(default=_EMPTY)  # (ranks,): its slow run's first step, or -1
    # (ranks,): where the slowdown began, its intermittent steps counted too, or -1 ...
    began: torch.Tensor = field(default=_EMPTY)
    slow_s: torch.Tensor = field(default=_EMPTY)  # ... and the group's time since then
    # each step's noise: the median over ranks of a rank's change since its previous step
    # (|c_t / c_t-1 - 1|: a steady straggler adds none, and at two ranks it still tells)
    noise: torch.Tensor = field(default=_EMPTY)
    steps_seen: int = 0
    waited_s: float = 0.0


def observe(
    watch: Watch, step: int, compute_s: Sequence[float], policy: StragglerPolicy
) -> tuple[Watch, list[Verdict]]:
    """``watch`` after one step's compute times (``compute_s[rank]``, seconds), and the
    changes to report. Fewer than two ranks, or a step in the warm-up: nothing to compare."""
    seen = watch.steps_seen + 1
    if len(compute_s) < 2 or seen <= policy.warmup_steps:
        return replace(watch, steps_seen=seen), []
    if watch.compute.numel() and watch.compute.shape[1] != len(compute_s):
        watch = Watch(flagged=watch.flagged, steps_seen=watch.steps_seen, waited_s=watch.waited_s)
    now = torch.tensor(compute_s, dtype=torch.float64)
    ordered, others = _medians_of_others(now)
    median = _median(ordered)
    waited = watch.waited_s + float(ordered[-1]) - median
    ratio = torch.where(others > 0, now / others.where(others > 0, 1.0), 1.0)
    kept = max(0, len(watch.steps) - policy.window + 1)  # the rows the window keeps
    compute = torch.cat([watch.compute[kept:], now[None]])
    ratios = torch.cat([watch.ratio[kept:], ratio[None]])
    steps = (*watch.steps[kept:], step)
    flagged = {
        r: _waited(s, float(now[r]) - median) for r, s in watch.flagged.items() if r < len(now)
    }
    noise = torch.cat([watch.noise, _change(watch.compute, now)])[-policy.noise_steps :]
    limit = slow_limit(noise, policy)
    full = len(steps) >= policy.window and len(noise) >= 2 * policy.window
    typical, excess = _window_ratios(compute)
    slow = (typical >= limit) & (excess >= policy.min_excess_s) & full
    before = watch.slow_streak if watch.slow_streak.numel() else torch.zeros_like(now)
    streak = torch.where(slow, before + 1, 0.0)
    # a slow run's onset, found as the window first says slow, among the steps that made its
    # majority: the healthy steps before them are where a busy machine's blips would pass for
    # the start
    kept_onset = watch.onset if watch.onset.numel() else torch.full_like(now, -1, dtype=torch.long)
    onset = torch.where(streak > 0, kept_onset, -1)
    # ... and where the slowdown began, over the whole window: a rank stopped on a duty cycle is
    # slow in about two steps of three, so its window's majority comes steps after the start
    kept_began = watch.began if watch.began.numel() else torch.full_like(now, -1, dtype=torch.long)
    began = torch.where(streak > 0, kept_began, -1)
    # ... and the group's time since then (each step's slowest compute: the step waits for it)
    before_s = watch.slow_s if watch.slow_s.numel() else torch.zeros_like(now)
    slow_s = torch.where(slow, before_s + ordered[-1], 0.0)
    if (new := torch.nonzero(streak == 1).flatten()).numel():
        majority = policy.window // 2 + 1
        onset[new] = _onsets(steps[-majority:], ratios[-majority:, new], limit)
        began[new] = _onsets(steps, ratios[:, new], limit, gap=3)
        since = torch.tensor(steps)[:, None] >= began[new][None, :]
        slow_s[new] = (compute.amax(1)[:, None] * since).sum(0)
    # reported once it has lasted ``sustain_s`` (or ``sustain_steps``) since it began and is
    # still there: most of the last ``confirm`` steps slow (after a burst ends the window says
    # slow for half a window more)
    lasted = (slow_s >= policy.sustain_s) | (step - began + 1 >= policy.sustain_steps)
    still = torch.median(ratios[-policy.confirm :], dim=0).values >= limit
    sustained = (streak >= policy.confirm) & lasted & still
    judged = set(flagged) | set(torch.nonzero(sustained).flatten().tolist())
    verdicts: list[Verdict] = []
    for rank in sorted(judged):
        verdict = _judge(rank, int(onset[rank]), flagged.get(rank), float(typical[rank]),
                         _slowdown_since(steps, ratios[:, rank], int(onset[rank])),
                         bool(sustained[rank]), step, limit, policy)  # fmt: skip
        if verdict is None:
            continue
        verdicts.append(verdict)
        if verdict.kind == DETECTED:
            flagged[rank] = verdict.straggler
        else:
            del flagged[rank]
    out = Watch(
        compute=compute, ratio=ratios, steps=steps, flagged=flagged, slow_streak=streak,
        slow_s=slow_s, onset=onset, began=began, noise=noise, steps_seen=seen, waited_s=waited,
    )  # fmt: skip
    return out, verdicts


def _median(ordered: torch.Tensor) -> float:
    """The median of sorted values (the mean of the middle two for an even count)."""
    n = len(ordered)
    middle = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return float(middle)


def _medians_of_others(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` sorted, and for each one the median of all the others (one sort for all:
    without its own value, the k-th of the rest is the sorted k-th, or the next one where its
    own position is not after k)."""
    ordered, order = torch.sort(values)
    position = torch.empty_like(order)
    position[order] = torch.arange(len(values))
    rest = len(values) - 1
    k = rest // 2

    def without(j: int) -> torch.Tensor:
        return torch.where(position > j, ordered[j], ordered[min(j + 1, rest)])

    others = without(k) if rest % 2 else (without(k - 1) + without(k)) / 2
    return ordered, others


def _waited(straggler: Straggler, excess_s: float) -> Straggler:
    return replace(straggler, waited_s=straggler.waited_s + max(0.0, excess_s))


def _change(before: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """This step's noise (none at the first step)."""
    if not before.numel():
        return _EMPTY
    last = before[-1]
    changes = (now / last.where(last > 0, 1.0) - 1).abs()[last > 0]
    if not changes.numel():
        return _EMPTY
    return torch.tensor([_median(torch.sort(changes).values)], dtype=torch.float64)


def slow_limit(noise: torch.Tensor, policy: StragglerPolicy) -> float:
    """The ratio a window's median must reach: ``threshold``, or higher where the group's
    step-to-step noise would carry a healthy window's median that far. A median absolute
    deviation d is a standard deviation of about 1.48 d; a median of n steps varies about
    1.25 / sqrt(n) as much as one step."""
    if not noise.numel():
        return policy.threshold
    sigma = 1.48 * _median(torch.sort(noise).values) * 1.25 / policy.window**0.5
    return max(policy.threshold, 1 + policy.noise_z * sigma)


def _window_ratios(compute: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's typical compute (its window's low median: more than half its steps at
    least this slow; five spikes in ten are not a slowdown) over the others' typical
    compute, and the excess in seconds: medians before the ratio, so one noisy step of a
    peer does not make a rank look slow."""
    typical = torch.median(compute, dim=0).values  # the lower of the two middle ones
    _, others = _medians_of_others(typical)
    ratio = torch.where(others > 0, typical / others.where(others > 0, 1.0), 1.0)
    return ratio, typical - others


def _judge(
    rank: int,
    onset: int,
    flagged: Straggler | None,
    ratio: float,
    slowdown: float,
    sustained: bool,
    step: int,
    limit: float,
    policy: StragglerPolicy,
) -> Verdict | None:
    """``ratio``: the window's (what recovery is judged by); ``slowdown``: since the onset."""
    if flagged is not None:
        # on a noisy machine the bar to recover rises with the bar to detect
        recover = max(policy.recover_below, 1 + (limit - 1) * 0.5)
        if ratio < recover:
            return Verdict(RECOVERED, replace(flagged, slowdown=round(ratio, 3)), step)
        return None
    if not sustained:
        return None
    return Verdict(DETECTED, Straggler(rank, onset, step, round(slowdown, 3)), step)


def _slowdown_since(steps: tuple[int, ...], ratios: torch.Tensor, onset: int) -> float:
    """The median of one rank's step ratios from ``onset`` on: how much slower it is. Not the
    window's median: a window turns slow with just over half its steps slow, and its median is
    then the rank's slowest step *before* the onset over the others' (a 4x straggler named
    beside a busy neighbour read 1.23, under an eviction threshold of 1.3)."""
    since = torch.tensor(steps) >= onset
    return float(torch.median(ratios[since])) if bool(since.any()) else float(ratios[-1])


def _onsets(
    steps: tuple[int, ...], ratios: torch.Tensor, threshold: float, gap: int = 2
) -> torch.Tensor:
    """Each rank's first step of the slow run that ends the window (``ratios``: steps x ranks):
    back from the newest step until ``gap`` healthy steps in a row (one healthy step inside a
    slowdown is noise, an earlier slow blip apart from it is not its onset); the newest step
    where the run has no slow step. Tensor operations over all ranks at once."""
    n = len(steps)
    slow = ratios >= threshold
    start = torch.zeros(ratios.shape[1], dtype=torch.long)
    if n >= gap:
        # row j: steps j to j + gap - 1 all healthy
        healthy_run = (~slow).to(torch.long).unfold(0, gap, 1).sum(-1) == gap
        rows = torch.arange(n - gap + 1)[:, None]
        last_run = torch.where(healthy_run, rows, -1).amax(0)
        start = torch.where(last_run >= 0, last_run + gap, 0)
    rows = torch.arange(n)[:, None]
    first = torch.where(slow & (rows >= start), rows, n).amin(0)
    return torch.tensor(steps)[first.clamp(max=n - 1)]
