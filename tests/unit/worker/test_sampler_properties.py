"""Property tests: exactly-once coverage and world-size independent steps.

A simulated job runs every rank's ElasticSampler in one process: at random step boundaries
the world size changes, and the new world's samplers load rank 0's ``state_dict()`` (as a
restore from a snapshot would). What each rank reads is taken from ``iter(sampler)`` (what a
DataLoader sees); what it trains is what ``complete_step`` returns.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_trainer.worker.plan import epoch_permutation
from elastic_trainer.worker.sampler import ElasticSampler

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _divisors(value: int, limit: int) -> list[int]:
    return [d for d in range(1, min(value, limit) + 1) if value % d == 0]


class World:
    """All ranks of one attempt, built from a saved state."""

    def __init__(self, size, state, **kwargs):
        self.samplers = [
            ElasticSampler(range(kwargs["n"]), num_replicas=size, rank=r, **kwargs["opts"])
            for r in range(size)
        ]
        for sampler in self.samplers:
            if state is not None:
                sampler.load_state_dict(state)
        self._refresh()

    def _refresh(self):
        self.streams = [iter(s) for s in self.samplers]

    def next_epoch(self):
        for sampler in self.samplers:
            sampler.set_epoch(sampler.epoch + 1)
        self._refresh()


def _run_global(n, seed, batch, drop_last, shuffle, max_micro, changes, total_steps):
    """Returns {(epoch, step_in_epoch): sorted indices of the step}, per-epoch Counters."""
    opts = dict(
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
        global_batch_size=batch,
        max_micro_batch_size=max_micro,
    )
    steps, per_epoch = {}, defaultdict(Counter)
    state, done = None, 0
    for size, count in [*changes, (1, total_steps)]:
        world = World(size, state, n=n, opts=opts)
        for _ in range(count):
            if done == total_steps:
                break
            if world.samplers[0].epoch_done:
                world.next_epoch()
            epoch = world.samplers[0].epoch
            step_indices = []
            for sampler, stream in zip(world.samplers, world.streams, strict=True):
                share = sampler.current_share()
                # The DataLoader reads share.micro_batches batches of micro_batch_size
                # (the last one may be short) and exactly the share's samples.
                read = [next(stream) for _ in range(len(share.positions))]
                assert -(-len(read) // sampler.micro_batch_size) == share.micro_batches
                trained = sampler.complete_step()
                assert trained == ([] if share.padding else read)
                step_indices += trained
            steps[(epoch, world.samplers[0].cursor)] = sorted(step_indices)
            per_epoch[epoch].update(step_indices)
            done += 1
        state = world.samplers[0].state_dict()
        assert all(s.state_dict() == state for s in world.samplers)
    return steps, per_epoch


@st.composite
def global_jobs(draw):
    batch = draw(st.integers(1, 24))
    drop_last = draw(st.booleans())
    # drop_last with fewer samples than a global batch is rejected (tested in the unit tests)
    n = draw(st.integers(batch if drop_last else 1, 120))
    sizes = st.sampled_from(_divisors(batch, 6))
    changes = draw(st.lists(st.tuples(sizes, st.integers(0, 8)), max_size=5))
    return dict(
        n=n,
        seed=draw(st.integers(0, 2**40)),
        batch=batch,
        drop_last=drop_last,
        shuffle=draw(st.booleans()),
        max_micro=draw(st.one_of(st.none(), st.integers(1, 8))),
        changes=changes,
        total_steps=draw(st.integers(1, 30)),
    )


@SETTINGS
@given(job=global_jobs())
def test_each_epoch_trains_every_sample_once_whatever_the_world_sizes(job):
    _steps, per_epoch = _run_global(**job)
    n, batch = job["n"], job["batch"]
    expected_size = n - n % batch if job["drop_last"] else n
    epochs = sorted(per_epoch)
    for epoch in epochs:
        counts = per_epoch[epoch]
        assert all(c == 1 for c in counts.values()), f"duplicates in epoch {epoch}"
        if epoch != epochs[-1]:
            perm = epoch_permutation(n, seed=job["seed"], epoch=epoch, shuffle=job["shuffle"])
            assert set(counts) == set(perm[:expected_size].tolist())


@SETTINGS
@given(job=global_jobs())
def test_each_step_trains_the_same_samples_as_an_uninterrupted_single_rank_run(job):
    steps, _ = _run_global(**job)
    reference, _ = _run_global(**{**job, "changes": []})
    assert steps == reference


@st.composite
def plain_jobs(draw):
    changes = draw(
        st.lists(st.tuples(st.integers(1, 5), st.integers(0, 6)), min_size=1, max_size=5)
    )
    return dict(
        n=draw(st.integers(1, 80)),
        seed=draw(st.integers(0, 2**40)),
        per_rank=draw(st.integers(1, 7)),
        drop_last=draw(st.booleans()),
        changes=changes,
    )


@SETTINGS
@given(job=plain_jobs())
def test_without_global_batch_the_remainder_is_split_without_padding(job):
    n = job["n"]
    opts = dict(seed=job["seed"], drop_last=job["drop_last"])
    state, trained, epoch_ends = None, Counter(), []
    for size, count in job["changes"] + [(1, 10 * n + 1)]:
        world = World(size, state, n=n, opts=opts)
        for _ in range(count):
            if world.samplers[0].epoch_done:
                epoch_ends.append(world.samplers[0].end)
                break
            reads = [
                [x for _, x in zip(range(job["per_rank"]), stream, strict=False)]
                for stream in world.streams
            ]
            total = sum(len(r) for r in reads)
            for sampler, read in zip(world.samplers, reads, strict=True):
                got = sampler.complete_step(local_samples=len(read), global_samples=total)
                assert got == read
                trained.update(got)
        state = world.samplers[0].state_dict()
        if epoch_ends:
            break
    assert epoch_ends, "the epoch never finished"
    assert all(c == 1 for c in trained.values())
    perm = epoch_permutation(n, seed=job["seed"], epoch=0, shuffle=True)
    assert set(trained) == set(perm[: epoch_ends[0]].tolist())
    # drop_last drops fewer samples than one world's worth; without it, nothing.
    dropped = n - epoch_ends[0]
    assert dropped == 0 if not job["drop_last"] else dropped < max(s for s, _ in job["changes"])
