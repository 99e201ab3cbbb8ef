"""Which rank is a straggler: a pure verdict from the group's per-step compute times.

Every rank of a ``TrainingSession`` puts its own compute time of a step (the step's wall time
less its waits in collectives, ``worker.step_timing``) into its slot of the step's all-reduce,
so every rank holds the same vector of the group's compute times after every step and runs
this function on it: every rank reaches the same verdict without another collective.

A rank is compared with the median of the *other* ranks (at two ranks the other one; at many
ranks the group's median). One step's ratio is noise on a shared machine (a scheduler tick,
a snapshot on rank 0); the verdict looks at the median ratio over the last ``window`` steps:
a slowdown is *detected* once more than half the window's steps are at least ``threshold``
times the others (and ``min_excess_s`` over them, so the jitter of tiny steps never counts)
for ``confirm`` steps in a row, and *recovered* once the window's median falls below
``recover_below`` (hysteresis: a rank hovering at the threshold does not flap). With a
window of 10 and 5 confirmations a slowdown that starts at step s is reported at step s + 10
(6 slow steps make the majority, 4 more confirm it), inside the 20 steps the issue asks for,
while a single spike, or five in ten, never makes the majority, and a burst of a few seconds
of a neighbour's load on a shared machine passes before it is confirmed.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, kw_only=True)
class StragglerPolicy:
    threshold: float = 1.10  # compute this many times the others' median: slow
    recover_below: float = 1.05  # ... and below this again: recovered
    window: int = 10  # steps whose median ratio decides
    confirm: int = 5  # steps in a row the window must say slow before it is reported
    min_excess_s: float = 0.002  # a smaller median excess over the others is jitter
    warmup_steps: int = 5  # an attempt's first steps (lazy start-up, DDP's bucket rebuild)
    # a slowdown must also stand this many standard deviations of a window's median above the
    # noise the group's ranks show step to step (a shared 2-core machine: +-25 % a step)
    noise_z: float = 4.0
    noise_steps: int = 100  # steps the noise is measured over

    def __post_init__(self) -> None:
        if not 1.0 < self.recover_below <= self.threshold:
            raise ValueError("StragglerPolicy: need 1 < recover_below <= threshold")
        if self.window < 1 or self.min_excess_s < 0 or self.warmup_steps < 0:
            raise ValueError("StragglerPolicy: window >= 1, min_excess_s >= 0, warmup >= 0")
        if self.noise_z < 0 or self.noise_steps < 1:
            raise ValueError("StragglerPolicy: noise_z >= 0, noise_steps >= 1")
        if self.confirm < 1:
            raise ValueError("StragglerPolicy: confirm >= 1")


@dataclass(frozen=True)
class Sample:
    """One rank at one step: its compute over the others' median, and the excess in seconds."""

    step: int
    ratio: float
    excess_s: float
    compute_s: float


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


@dataclass(frozen=True)
class Watch:
    """The verdict's state: each rank's last samples, the ongoing slowdowns, and the time the
    group spent waiting for its slowest rank (each step: the slowest compute less the median)."""

    samples: Mapping[int, tuple[Sample, ...]] = field(default_factory=dict)
    flagged: Mapping[int, Straggler] = field(default_factory=dict)
    slow_streak: Mapping[int, int] = field(default_factory=dict)  # steps the window said slow
    # each step's noise: the median over ranks of a rank's change since its previous step
    # (|c_t / c_t-1 - 1|: a steady straggler adds none, and at two ranks it still tells)
    noise: tuple[float, ...] = ()
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
    median = statistics.median(compute_s)
    waited = watch.waited_s + max(compute_s) - median
    samples = {
        rank: (*watch.samples.get(rank, ()), _sample(step, rank, compute_s))[-policy.window :]
        for rank in range(len(compute_s))
    }
    flagged = {r: _waited(s, compute_s[r] - median) for r, s in watch.flagged.items()}
    noise = (*watch.noise, *_change(watch.samples, compute_s))[-policy.noise_steps :]
    limit = slow_limit(noise, policy)
    streak = {
        r: watch.slow_streak.get(r, 0) + 1 for r in samples if _slow(samples[r], limit, policy)
    }
    verdicts: list[Verdict] = []
    for rank, window in samples.items():
        verdict = _judge(rank, window, flagged.get(rank), streak.get(rank, 0), step, limit, policy)
        if verdict is None:
            continue
        verdicts.append(verdict)
        if verdict.kind == DETECTED:
            flagged[rank] = verdict.straggler
        else:
            del flagged[rank]
    out = Watch(samples, flagged, streak, noise, steps_seen=seen, waited_s=waited)
    return out, verdicts


def _sample(step: int, rank: int, compute_s: Sequence[float]) -> Sample:
    others = statistics.median([c for r, c in enumerate(compute_s) if r != rank])
    own = compute_s[rank]
    ratio = own / others if others > 0 else 1.0
    return Sample(step=step, ratio=ratio, excess_s=own - others, compute_s=own)


def _waited(straggler: Straggler, excess_s: float) -> Straggler:
    return replace(straggler, waited_s=straggler.waited_s + max(0.0, excess_s))


def _change(before: Mapping[int, tuple[Sample, ...]], compute_s: Sequence[float]) -> list[float]:
    """This step's noise (none at the first step of a rank)."""
    changes = [
        abs(compute_s[rank] / window[-1].compute_s - 1)
        for rank, window in before.items()
        if window and rank < len(compute_s) and window[-1].compute_s > 0
    ]
    return [statistics.median(changes)] if changes else []


def slow_limit(noise: tuple[float, ...], policy: StragglerPolicy) -> float:
    """The ratio a window's median must reach: ``threshold``, or higher where the group's
    step-to-step noise would carry a healthy window's median that far. A median absolute
    deviation d is a standard deviation of about 1.48 d; a median of n steps varies about
    1.25 / sqrt(n) as much as one step."""
    if not noise:
        return policy.threshold
    sigma = 1.48 * statistics.median(noise) * 1.25 / policy.window**0.5
    return max(policy.threshold, 1 + policy.noise_z * sigma)


def _slow(window: tuple[Sample, ...], limit: float, policy: StragglerPolicy) -> bool:
    """The window says slow: full, and more than half its steps slow by both measures (the
    low median: five spikes in ten are not a slowdown)."""
    if len(window) < policy.window:
        return False
    ratio = statistics.median_low(s.ratio for s in window)
    excess = statistics.median_low(s.excess_s for s in window)
    return ratio >= limit and excess >= policy.min_excess_s


def _judge(
    rank: int,
    window: tuple[Sample, ...],
    flagged: Straggler | None,
    streak: int,
    step: int,
    limit: float,
    policy: StragglerPolicy,
) -> Verdict | None:
    if flagged is not None:
        ratio = statistics.median(s.ratio for s in window)
        # on a noisy machine the bar to recover rises with the bar to detect
        recover = max(policy.recover_below, 1 + (limit - 1) * 0.5)
        if ratio < recover:
            return Verdict(RECOVERED, replace(flagged, slowdown=round(ratio, 3)), step)
        return None
    if streak < policy.confirm:
        return None
    onset = _onset(window, limit)
    # the window's older half may predate the onset: the factor is the slow steps' own
    slowdown = statistics.median(s.ratio for s in window if s.step >= onset)
    return Verdict(DETECTED, Straggler(rank, onset, step, round(slowdown, 3)), step)


def _onset(window: tuple[Sample, ...], threshold: float) -> int:
    """The first step of the slow run that ends the window: back from the newest step until
    two healthy steps in a row (one healthy step inside a slowdown is noise, an earlier slow
    blip apart from it is not its onset)."""
    onset, healthy = window[-1].step, 0
    for sample in reversed(window):
        if sample.ratio >= threshold:
            onset, healthy = sample.step, 0
        else:
            healthy += 1
            if healthy == 2:
                break
    return onset
