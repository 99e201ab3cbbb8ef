"""Pure parts of bench/ettr.py: effective training time (ETTR) from measured constants and a
failure process.

No files, no clocks, no processes. ETTR = the steps' failure-free compute time / wall time.
What a failure costs is a sum of named terms (detection, the survivors' just-in-time copy,
the re-form as a + b·nodes, the workers' start, the restore from node memory or storage, the
first step's extra, the work redone, the replacement node's join pause, the time a node
short); besides failures a job pays its start once and a snapshot stall every step. The
snapshot intervals are the product's own (``elastic_trainer.worker.interval``): the sharded
in-memory tier's ``auto`` and the storage interval (fixed, or ``auto``: Young–Daly).

Two ways to use it: ``ettr`` (failures as a Poisson process whose rate grows with the GPU
count: expected values, and which term dominates) and ``replay`` (a given list of failure
times, e.g. a trace or bench/goodput.py's schedule, walked step by step for a job of a fixed
number of steps). tests/bench/test_ettr.py checks both against hand-computed cases.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic_trainer.worker.interval import Interval

GPUS_PER_NODE = 8
DAY_S = 86_400.0
# Llama 3 405B pre-training ("The Llama 3 Herd of Models", 2024, section 3.3.4): 466 job
# interruptions in 54 days on 16,384 H100 (47 of them planned; all counted here)
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54.0
LLAMA3_INTERRUPTIONS = 466
LLAMA3_GPU_MTBF_S = LLAMA3_DAYS * DAY_S * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS

NODE_LOSS, WORKER_CRASH = "node_loss", "worker_crash"
KINDS = (NODE_LOSS, WORKER_CRASH)
# the terms of ETTR's loss, in the order tables print them
TERMS = ("start", "stall", "detect", "copy", "reform", "workers", "restore", "first_step",
         "redo", "join", "short")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """What recovering from one failure costs, as measured (seconds unless said)."""

    detect_s: float  # the fault -> the supervisor acts on it
    reform_base_s: float  # the re-form (the round closed after the fault is known): a + b·nodes
    reform_per_node_s: float
    workers_s: float  # the round closed -> every new worker has its process group
    restore_s: float  # the restore's fixed part (the bytes: *_read_s_per_gb)
    first_step_extra_s: float  # the new group's first step beyond a step's time
    join_pause_s: float  # the running group's pause when the replacement node joins
    copy_s_per_gb: float = 0.0  # the survivors' just-in-time copy into node memory
    memory_read_s_per_gb: float = 0.0  # restore from node memory
    storage_read_s_per_gb: float = 0.0  # restore from storage
    start_s: float = 0.0  # the launch -> the first step, once per job (the formation excluded)

    def reform_s(self, nodes: int) -> float:
        return self.reform_base_s + self.reform_per_node_s * nodes


@dataclass(frozen=True, kw_only=True)
class Job:
    """The job and its failure process."""

    gpus: int
    step_s: float  # a step's time without snapshot stalls
    state_gb_per_gpu: float = 0.0
    gpus_per_node: int = GPUS_PER_NODE
    gpu_mtbf_s: float = LLAMA3_GPU_MTBF_S  # failures arrive at gpus / gpu_mtbf_s per second
    wall_s: float = LLAMA3_DAYS * DAY_S  # the job's length (its start is paid once in it)
    # sharded state exists nowhere else: a failure resumes from the last periodic in-memory
    # copy; replicated state: from the survivors' just-in-time copy (nothing redone)
    sharded: bool = True
    memory_stall_s_per_gb: float = 0.0  # the loop's stall per GB of a periodic in-memory copy
    storage_stall_s_per_gb: float = 0.0  # the loop's stall per GB of a storage snapshot
    snapshot_every: int | str = 100  # --snapshot-every (the product's default), or "auto"
    storage_share: float = 0.0  # failures no node memory survives: resumed from storage
    node_loss_share: float = 1.0  # failures that take a node (the rest: a worker crash)
    replace_s: float = 0.0  # a lost node's replacement joins this long after the loss

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1 or self.step_s <= 0:
            raise ValueError(
                f"gpus {self.gpus}, gpus per node {self.gpus_per_node} and step time "
                f"{self.step_s} s must be positive"
            )
        for name in ("storage_share", "node_loss_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} {getattr(self, name)} must be within 0..1")

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def state_gb_per_node(self) -> float:
        return self.state_gb_per_gpu * min(self.gpus, self.gpus_per_node)

    @property
    def mtbf_s(self) -> float:
        return self.gpu_mtbf_s / self.gpus


@dataclass(frozen=True, kw_only=True)
class Intervals:
    """The snapshot intervals the product picks for a job, and the stall they cost per step."""

    memory_every: int | None  # None: no periodic in-memory copy (just in time instead)
    storage_every: int
    memory_stall_s: float  # one periodic in-memory copy's stall
    storage_stall_s: float  # one storage snapshot's stall

    @property
    def stall_per_step_s(self) -> float:
        memory = self.memory_stall_s / self.memory_every if self.memory_every else 0.0
        return memory + self.storage_stall_s / self.storage_every


def intervals(job: Job) -> Intervals:
    """The product's choices (``worker.interval``) once it has measured a step and a save."""
    memory_stall = job.memory_stall_s_per_gb * job.state_gb_per_gpu
    storage_stall = job.storage_stall_s_per_gb * job.state_gb_per_gpu
    memory_every = None
    if job.sharded:
        memory = Interval.memory().observed(cost_s=memory_stall, step_s=job.step_s)
        memory_every = memory.every
    storage = Interval.of(job.snapshot_every, job.mtbf_s)
    storage = storage.observed(cost_s=storage_stall, step_s=job.step_s)
    return Intervals(memory_every=memory_every, storage_every=storage.every,
                     memory_stall_s=memory_stall, storage_stall_s=storage_stall)  # fmt: skip


def redo_steps(every: int | None) -> float:
    """Whole steps redone on average by a failure at a random moment, resuming from a copy
    taken every ``every`` steps (None: the step the failure interrupted): the steps since the
    copy are uniform on 0..every-1; the interrupted step itself is counted apart (half)."""
    return 0.0 if every is None else (every - 1) / 2


def failure_terms(job: Job, rec: Recovery) -> dict[str, float]:
    """One failure's expected cost, in seconds of wall time, term by term."""
    iv = intervals(job)
    gb, share = job.state_gb_per_node, job.storage_share
    step = job.step_s + iv.stall_per_step_s
    memory_redo = redo_steps(iv.memory_every)
    redo = 0.5 + (1 - share) * memory_redo + share * redo_steps(iv.storage_every)
    read = (1 - share) * rec.memory_read_s_per_gb + share * rec.storage_read_s_per_gb
    return {
        "detect": rec.detect_s,
        "copy": 0.0 if job.sharded else rec.copy_s_per_gb * gb,
        "reform": rec.reform_s(job.nodes),
        "workers": rec.workers_s,
        "restore": rec.restore_s + read * gb,
        "first_step": rec.first_step_extra_s,
        "redo": redo * step,
        "join": job.node_loss_share * rec.join_pause_s,
        # a node short: its share of the throughput until the replacement joins
        "short": job.node_loss_share * job.replace_s / job.nodes,
    }


@dataclass(frozen=True, kw_only=True)
class Estimate:
    ettr: float
    losses: dict[str, float]  # each term's share of the wall time (ettr + sum = 1)
    per_failure_s: float
    failures: float  # expected failures in the job's wall time
    intervals: Intervals

    @property
    def dominant(self) -> str:
        return max(self.losses, key=self.losses.__getitem__)


def ettr(job: Job, rec: Recovery) -> Estimate:
    """Expected ETTR of ``job`` under Poisson failures (rate gpus / gpu_mtbf_s).

    In the wall time W: the start, then failures at rate λ (they arrive in downtime too: a
    failure during a recovery costs another), each costing its terms; what is left trains,
    of which the stall's share is lost: ETTR = (1 - start/W - λ·cost) · step / (step + stall).
    """
    iv = intervals(job)
    terms = failure_terms(job, rec)
    rate = 1 / job.mtbf_s
    start = rec.start_s + rec.reform_s(job.nodes)  # the first formation is a re-form's work
    losses = {"start": start / job.wall_s}
    losses |= {name: rate * cost for name, cost in terms.items()}
    training = 1 - sum(losses.values())
    stall_share = iv.stall_per_step_s / (job.step_s + iv.stall_per_step_s)
    losses["stall"] = max(training, 0.0) * stall_share
    losses = {name: losses[name] for name in TERMS}
    return Estimate(ettr=max(training, 0.0) * (1 - stall_share), losses=losses,
                    per_failure_s=sum(terms.values()), failures=job.wall_s * rate,
                    intervals=iv)  # fmt: skip


# --- a given failure trace, walked step by step --------------------------------------------
@dataclass(frozen=True, order=True)
class Failure:
    at_s: float  # from the job's launch
    kind: str = NODE_LOSS


@dataclass(frozen=True, kw_only=True)
class KindCost:
    """What a failure of one kind costs in a replay."""

    downtime_s: float  # the fault -> the new group's first step begins
    every: int | None = None  # it resumes from a copy taken every this many steps (None: the
    # last step completed before the fault, the just-in-time copy)
    redo_steps: float = 0.0  # and this many steps before that (as measured)


@dataclass(frozen=True, kw_only=True)
class Replay:
    wall_s: float
    goodput: float  # steps × step_s / wall_s
    failures: int  # failures that hit the job (those after its end do not)
    redone_steps: float  # work redone, in steps (the interrupted steps' parts included)


def replay(
    *,
    steps: int,
    step_s: float,
    start_s: float,
    failures: Sequence[Failure],
    costs: Mapping[str, KindCost],
    stall_s: float = 0.0,
) -> Replay:
    """A job of ``steps`` steps of ``step_s`` (+ ``stall_s`` each) launched at 0, starting to
    train at ``start_s``, under ``failures``: each stops the group at its time (a failure
    during a recovery starts the recovery again from then), resumes from the copy its kind
    resumes from, and costs its downtime before the next step begins."""
    if unknown := sorted({f.kind for f in failures} - set(costs)):
        raise ValueError(f"failure kinds {unknown} have no cost: give them one of {sorted(costs)}")
    each = step_s + stall_s
    t, done, hit, redone = start_s, 0.0, 0, 0.0
    for f in sorted(failures):
        if t + (steps - done) * each <= f.at_s:
            break  # the job finished first
        done += max(0.0, f.at_s - t) / each
        cost = costs[f.kind]
        completed = math.floor(done + 1e-9)
        resume = completed if cost.every is None else completed // cost.every * cost.every
        resume = max(0.0, resume - cost.redo_steps)
        redone += max(0.0, done - resume)
        done, t, hit = float(resume), max(t, f.at_s + cost.downtime_s), hit + 1
    wall = t + (steps - done) * each
    return Replay(wall_s=wall, goodput=steps * step_s / wall, failures=hit, redone_steps=redone)


def kind_costs(job: Job, rec: Recovery) -> dict[str, KindCost]:
    """``failure_terms`` per kind, for ``replay``: every failure resumes from node memory (a
    trace says nothing of which copies survived); a node loss also pays the replacement's join
    pause and the time a node short."""
    terms = failure_terms(Job(**{**job.__dict__, "storage_share": 0.0}), rec)
    down = sum(terms[name] for name in ("detect", "copy", "reform", "workers", "restore",
                                        "first_step"))  # fmt: skip
    every = intervals(job).memory_every
    lost_node = rec.join_pause_s + job.replace_s / job.nodes
    return {NODE_LOSS: KindCost(downtime_s=down + lost_node, every=every),
            WORKER_CRASH: KindCost(downtime_s=down, every=every)}  # fmt: skip


def poisson_failures(
    *, rate_per_s: float, horizon_s: float, seed: int, node_loss_share: float = 1.0
) -> list[Failure]:
    """Failure times with exponential gaps (mean 1 / ``rate_per_s``) up to ``horizon_s``."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate_per_s)
        if t > horizon_s:
            return out
        kind = NODE_LOSS if rng.random() < node_loss_share else WORKER_CRASH
        out.append(Failure(at_s=t, kind=kind))


def parse_trace(text: str) -> list[Failure]:
    """A trace CSV: one failure a line, ``seconds from the launch[,kind]``; a header line and
    ``#`` comments are skipped. Bad lines raise ValueError naming the line."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.split("#", 1)[0].split(",")]
        if not cells[0] or (n == 1 and not _is_number(cells[0])):
            continue
        kind = cells[1] if len(cells) > 1 and cells[1] else NODE_LOSS
        if not _is_number(cells[0]) or float(cells[0]) < 0 or kind not in KINDS:
            raise ValueError(
                f"trace line {n} {line!r}: want 'seconds>=0[,kind]' with kind one of {KINDS}"
            )
        out.append(Failure(at_s=float(cells[0]), kind=kind))
    return sorted(out)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
