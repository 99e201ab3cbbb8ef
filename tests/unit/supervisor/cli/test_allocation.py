"""elastic_trainer.supervisor.cli.allocation: ``--nproc-per-node auto`` follows the allocation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor.cli.allocation import (
    detect_local_workers,
    local_workers,
    read_affinity,
    read_cpu_quota,
)

HOST = 64  # a big host; every test below is about using less of it


def workers(kind: str = "auto", *, gpus: int = 0, quota: float | None = None, affinity: int = HOST,
            **env: str) -> int:  # fmt: skip
    return local_workers(
        kind, cuda_devices=gpus, env=env, cpu_quota=quota, affinity=affinity, host_cpus=HOST
    )


# --- the pure decision -----------------------------------------------------------------------


def test_gpus_win_one_worker_each() -> None:
    assert workers(gpus=4, SLURM_CPUS_ON_NODE="2", quota=1.0) == 4
    assert workers("gpu", gpus=2) == 2


def test_cuda_visible_devices_caps_the_gpu_count() -> None:
    assert workers(gpus=8, CUDA_VISIBLE_DEVICES="2,5") == 2
    assert workers(gpus=8, CUDA_VISIBLE_DEVICES="GPU-1a2b,GPU-3c4d,GPU-5e6f") == 3
    # CUDA stops at the first invalid entry: "" and "-1" hide every GPU, so CPUs count.
    assert workers(gpus=8, CUDA_VISIBLE_DEVICES="", SLURM_CPUS_ON_NODE="3") == 3
    assert workers(gpus=8, CUDA_VISIBLE_DEVICES="-1", SLURM_CPUS_ON_NODE="3") == 3
    assert workers(gpus=8, CUDA_VISIBLE_DEVICES="0,-1,2") == 1


def test_cpu_kind_ignores_gpus() -> None:
    assert workers("cpu", gpus=4, SLURM_CPUS_ON_NODE="6") == 6


def test_gpu_kind_without_a_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="gpu is invalid: no CUDA device"):
        workers("gpu", gpus=0)
    with pytest.raises(ConfigError, match="gpu is invalid"):
        workers("gpu", gpus=2, CUDA_VISIBLE_DEVICES="")


def test_without_any_bound_it_is_the_host() -> None:
    assert workers() == HOST


@pytest.mark.parametrize(
    ("env", "quota", "affinity", "expected"),
    [
        ({"SLURM_CPUS_ON_NODE": "4"}, None, HOST, 4),  # Slurm, no cgroup limit
        ({"SLURM_CPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "2"}, None, HOST, 2),
        ({"SLURM_CPUS_ON_NODE": "8(x2)"}, None, HOST, 8),  # Slurm's per-node repeat syntax
        ({}, 2.0, HOST, 2),  # a pod with limits cpu: "2"
        ({}, 2.5, HOST, 2),  # 2500m: rounded down
        ({}, 0.5, HOST, 1),  # 500m: still one worker
        ({}, None, 3, 3),  # taskset / static CPU manager pinning
        ({"SLURM_CPUS_ON_NODE": "16"}, 6.0, 12, 6),  # the smallest bound wins
        ({"SLURM_CPUS_ON_NODE": "16"}, 6.0, 4, 4),
        ({"SLURM_CPUS_ON_NODE": "junk", "SLURM_CPUS_PER_TASK": "0"}, None, HOST, HOST),
    ],
)
def test_cpu_workers_follow_the_tightest_allocation(
    env: dict[str, str], quota: float | None, affinity: int, expected: int
) -> None:
    assert workers(quota=quota, affinity=affinity, **env) == expected


def test_unknown_kind_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="use a number, auto, gpu or cpu"):
        workers("tpu")


# --- cgroup files ----------------------------------------------------------------------------


def v2_tree(root: Path, limits: dict[str, str]) -> Path:
    """A fake cgroup v2 mount: folder (relative to root) -> cpu.max text."""
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for folder, cpu_max in limits.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(cpu_max + "\n")
    return root


def test_cgroup_v2_quota_of_a_pod(tmp_path: Path) -> None:
    # In a container with a cgroup namespace the mount is the pod's own cgroup: path "/".
    root = v2_tree(tmp_path, {".": "200000 100000"})
    assert read_cpu_quota(str(root), "0::/\n") == 2.0


def test_cgroup_v2_unlimited_is_no_quota(tmp_path: Path) -> None:
    root = v2_tree(tmp_path, {".": "max 100000"})
    assert read_cpu_quota(str(root), "0::/\n") is None


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    root = v2_tree(
        tmp_path,
        {"kubepods": "800000 100000", "kubepods/pod1": "150000 100000", "kubepods/pod1/c": "max 1"},
    )
    assert read_cpu_quota(str(root), "0::/kubepods/pod1/c\n") == 1.5


def test_cgroup_v2_path_from_the_host_falls_back_to_the_mount(tmp_path: Path) -> None:
    root = v2_tree(tmp_path, {".": "300000 100000"})
    assert read_cpu_quota(str(root), "0::/system.slice/docker-abc.scope\n") == 3.0


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu,cpuacct" / "slurm" / "job_7"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("400000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (cpu.parent / "cpu.cfs_quota_us").write_text("-1\n")
    (cpu.parent / "cpu.cfs_period_us").write_text("100000\n")
    self_cgroup = "12:memory:/slurm/job_7\n4:cpu,cpuacct:/slurm/job_7\n0::/\n"
    assert read_cpu_quota(str(tmp_path), self_cgroup) == 4.0


@pytest.mark.parametrize("cpu_max", ["", "garbage", "0 100000", "100000 0", "a b"])
def test_malformed_cgroup_files_mean_no_quota(tmp_path: Path, cpu_max: str) -> None:
    root = v2_tree(tmp_path, {".": cpu_max})
    assert read_cpu_quota(str(root), "0::/\n") is None


def test_no_cgroup_mount_means_no_quota(tmp_path: Path) -> None:
    assert read_cpu_quota(str(tmp_path / "absent"), "") is None


# --- the wiring on this machine --------------------------------------------------------------


def test_affinity_is_this_process_mask() -> None:
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 7
    assert read_affinity(7) == expected


def test_detect_cpu_never_exceeds_what_this_process_may_use() -> None:
    env = {"SLURM_CPUS_ON_NODE": "1"}
    assert detect_local_workers("cpu", env) == 1
    assert 1 <= detect_local_workers("cpu", {}) <= read_affinity(os.cpu_count() or 1)
