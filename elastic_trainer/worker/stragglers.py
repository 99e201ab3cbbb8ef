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
row, and *recovered* once it falls below ``recover_below`` (hysteresis: a rank hovering at
the threshold does not flap). On a noisy machine both bars rise: the ratio must also stand
``noise_z`` standard deviations of a window's median above 1, from the step-to-step noise
the ranks show (measured over ``noise_steps``, at least two windows before any verdict).

With a window of 14 and 3 confirmations a slowdown that starts at step s is reported at step
s + 10 on a quiet machine (8 slow steps make the majority, 2 more confirm it), a little later
where the noise raises the bar, inside the 20 steps the issue asks for; a single spike, or
seven in fourteen, never makes the majority. (A window of 10 reported 3 episodes of a few
seconds of contention in a healthy 30-minute run on the shared 2-core machine; 14, none.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, kw_only=True)
class StragglerPolicy:
    threshold: float = 1.10  # compute this many times the others' median: slow
    recover_below: float = 1.05  # ... and below this again: recovered
    window: int = 14  # steps whose median ratio decides
    confirm: int = 3  # steps in a row the window must say slow before it is reported
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
    ordered = sorted(compute_s)
    median = _median(ordered)
    waited = watch.waited_s + ordered[-1] - median
    others = _medians_of_others(compute_s, ordered)
    samples = {
        rank: (*watch.samples.get(rank, ()), _sample(step, own, others[rank]))[-policy.window :]
        for rank, own in enumerate(compute_s)
    }
    flagged = {r: _waited(s, compute_s[r] - median) for r, s in watch.flagged.items()}
    noise = (*watch.noise, *_change(watch.samples, compute_s))[-policy.noise_steps :]
    limit = slow_limit(noise, policy)
    typical = _window_ratios(samples)
    streak = {
        r: watch.slow_streak.get(r, 0) + 1
        for r in samples
        if _slow(samples[r], typical[r], limit, len(noise), policy)
    }
    verdicts: list[Verdict] = []
    for rank, window in samples.items():
        judged = (typical[rank][0], streak.get(rank, 0), step, limit)
        verdict = _judge(rank, window, flagged.get(rank), *judged, policy)
        if verdict is None:
            continue
        verdicts.append(verdict)
        if verdict.kind == DETECTED:
            flagged[rank] = verdict.straggler
        else:
            del flagged[rank]
    out = Watch(samples, flagged, streak, noise, steps_seen=seen, waited_s=waited)
    return out, verdicts


def _median(ordered: Sequence[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _median_low(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def _medians_of_others(compute_s: Sequence[float], ordered: list[float]) -> list[float]:
    """Each rank's others' median, from the group's sorted times (one sort, not one a rank)."""
    position = {value: i for i, value in enumerate(ordered)}  # any equal value will do
    rest = len(ordered) - 1

    def without(i: int, k: int) -> float:  # the k-th of ``ordered`` less its i-th
        return ordered[k] if k < i else ordered[k + 1]

    out = []
    for own in compute_s:
        i = position[own]
        k = rest // 2
        out.append(without(i, k) if rest % 2 else (without(i, k - 1) + without(i, k)) / 2)
    return out


def _sample(step: int, own: float, others: float) -> Sample:
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
    return [_median(sorted(changes))] if changes else []


def slow_limit(noise: tuple[float, ...], policy: StragglerPolicy) -> float:
    """The ratio a window's median must reach: ``threshold``, or higher where the group's
    step-to-step noise would carry a healthy window's median that far. A median absolute
    deviation d is a standard deviation of about 1.48 d; a median of n steps varies about
    1.25 / sqrt(n) as much as one step."""
    if not noise:
        return policy.threshold
    sigma = 1.48 * _median(sorted(noise)) * 1.25 / policy.window**0.5
    return max(policy.threshold, 1 + policy.noise_z * sigma)


def _window_ratios(samples: Mapping[int, tuple[Sample, ...]]) -> list[tuple[float, float]]:
    """Each rank's typical compute (its window's low median: more than half its steps at
    least this slow; five spikes in ten are not a slowdown) over the others' typical
    compute, and the excess in seconds: medians before the ratio, so one noisy step of a
    peer does not make a rank look slow."""
    typical = [_median_low([s.compute_s for s in samples[r]]) for r in range(len(samples))]
    others = _medians_of_others(typical, sorted(typical))
    return [
        (own / other if other > 0 else 1.0, own - other)
        for own, other in zip(typical, others, strict=True)
    ]


def _slow(
    window: tuple[Sample, ...],
    typical: tuple[float, float],
    limit: float,
    noise_steps: int,
    policy: StragglerPolicy,
) -> bool:
    """The window says slow: full, the noise measured over two windows at least, and the
    rank's typical compute ``limit`` times the others' (and ``min_excess_s`` above)."""
    if len(window) < policy.window or noise_steps < 2 * policy.window:
        return False
    ratio, excess = typical
    return ratio >= limit and excess >= policy.min_excess_s


def _judge(
    rank: int,
    window: tuple[Sample, ...],
    flagged: Straggler | None,
    ratio: float,
    streak: int,
    step: int,
    limit: float,
    policy: StragglerPolicy,
) -> Verdict | None:
    if flagged is not None:
        # on a noisy machine the bar to recover rises with the bar to detect
        recover = max(policy.recover_below, 1 + (limit - 1) * 0.5)
        if ratio < recover:
            return Verdict(RECOVERED, replace(flagged, slowdown=round(ratio, 3)), step)
        return None
    if streak < policy.confirm:
        return None
    onset = _onset(window, limit)
    return Verdict(DETECTED, Straggler(rank, onset, step, round(ratio, 3)), step)


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
