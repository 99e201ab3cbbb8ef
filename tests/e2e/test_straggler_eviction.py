"""``--evict-stragglers``: a slow node of a 3-node job leaves, the other two train on, and it
joins again after its cool-down.

Node b's forward sleeps from step 40 while a file exists (the worker's seam). b's supervisor
reads its rank's ``straggler.detected``, finds that leaving pays (the steps left times the
time a step would save, against two re-forms measured from this job's own start) and leaves
as a preempted node does: the group stops together at a step's end and saves, a and c
re-form at world size 2 and go on. The test ends the slowness while b is out; after
``--evict-cooldown`` b joins again, the group grows back to 3 and the job finishes on all
three nodes at its last step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.workers.harness import (
    HERE,
    env_with,
    free_port,
    listening,
    start_agent,
    wait_for,
    wait_new,
)

pytestmark = [pytest.mark.integration, pytest.mark.alone, pytest.mark.timeout(300)]

WORKER = str(HERE / "straggler_worker.py")
STEPS, ONSET = 240, 40


def test_a_slow_node_leaves_the_others_go_on_and_it_rejoins(tmp_path, worker_env, agents):
    slow = tmp_path / "b-is-slow"
    slow.touch()
    port = free_port()
    # a step sleeps 0.15 s / world size on every rank: b is back before the others finish
    argv = [
        "--min-nodes", "2", "--max-nodes", "3", "--snapshot-dir", str(tmp_path / "snap"),
        "--evict-stragglers", "1.3", "--evict-cooldown", "2",
        WORKER, "--steps", str(STEPS), "--slow-node", "b", "--slow-from", str(ONSET),
        "--slow-s", "0.3", "--slow-while", str(slow), "--base-s", "0.15",
    ]  # fmt: skip
    started = []
    for name in "abc":
        agent = start_agent(tmp_path, name, [*argv, "--trace", str(tmp_path / name)],
                            env_with(worker_env), port=port)  # fmt: skip
        agents.append(agent)
        started.append(agent)
        if name == "a":
            wait_for(lambda: listening(port), 60, "a to host the store")
    a, b, c = started
    for x in started:  # each has logged its round of 3 before its rounds are counted
        x.wait_event("rendezvous.completed", 120, lambda e: e["world_size"] == 3)
    rounds = {x.name: len(x.events("rendezvous.completed")) for x in (a, c)}

    evicted = b.wait_event("straggler.evicted", 150)
    assert evicted["node"] == "b" and evicted["slowdown"] >= 1.3
    assert evicted["projected_gain_s"] > 0 and "1.3" in evicted["reason"]
    assert evicted["rejoin_after_s"] == 2 and evicted["evictions"] == 1
    (detected,) = b.events("straggler.detected")
    assert detected["slowest"] is True and 0 < detected["steps_left"] < STEPS - ONSET
    slow.unlink()  # b cools down healthy

    for x in (a, c):  # the other two re-form without b, say why, and go on
        formed = wait_new(x, "rendezvous.completed", rounds[x.name], 90)
        assert formed["world_size"] == 2, formed
        shrunk = x.wait_event("membership.changed", 30, lambda e: e["new_world_size"] == 2)
        assert shrunk["reason"] == "straggler_evicted", shrunk
    rejoining = b.wait_event("straggler.rejoining", 90)
    assert rejoining["cooled_s"] >= 2
    regrown = wait_new(a, "membership.changed", 0, 120, lambda e: e["new_world_size"] == 3
                       and e["old_world_size"] == 2)  # fmt: skip
    assert regrown["reason"] == "node_joined"

    for x in started:
        assert x.wait(200) == 0, x.stderr_file.read_text()[-3000:]
        assert x.events("job.finished")[-1]["status"] == "succeeded"
    assert not [e for x in (a, c) for e in x.events("straggler.evicted")]
    final = [_last_step(tmp_path / x.name) for x in started]
    assert final == [STEPS] * 3


def _last_step(trace: Path) -> int:
    return int(trace.read_text().split("\n")[-2].split()[0])
