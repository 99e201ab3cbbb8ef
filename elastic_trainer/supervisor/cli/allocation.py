"""How many workers ``--nproc-per-node auto|gpu|cpu`` starts: what this node was *allocated*.

``os.cpu_count()`` is the host's CPU count. Under Slurm without ``--cpus-per-task``, or in a
pod limited to ``cpu: "2"``, that is many times what the job may use: one worker per host CPU
then thrashes and runs out of memory. So the count follows the allocation, in this order:

1. GPUs (``auto``, ``gpu``): one worker per visible CUDA device. The device count comes from
   torch, which honours ``CUDA_VISIBLE_DEVICES`` (Slurm and the Kubernetes device plugin set
   it to the allocated GPUs); the variable also caps a count taken another way.
2. CPUs (``cpu``, or ``auto`` with no GPU): one worker per *allocated* CPU, the smallest of
   ``SLURM_CPUS_PER_TASK`` (one supervisor is one task), ``SLURM_CPUS_ON_NODE``, the cgroup
   CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``; rounded down, at
   least 1), the CPU affinity mask (``taskset``, Slurm's and Kubernetes' static CPU manager
   pinning) and the host's CPUs. Whatever is not set does not limit.

Why one worker per allocated CPU rather than a single worker: it is what torchrun's ``auto``
and ``cpu`` mean (one per CPU), so a script keeps its world size when moved from torchrun; and
torchrun, our deploy files and most CPU recipes set ``OMP_NUM_THREADS=1`` per worker, so a
single worker would leave every other allocated CPU idle. What made the old count unsafe was
counting the host instead of the allocation, which the bounds above fix. Memory is not a CPU
bound: give each worker its share (pod ``memory`` limit, Slurm ``--mem``) or pass a number.

``local_workers`` is pure (tested with synthetic inputs); the ``read_*`` functions are the thin
I/O around it and ``detect_local_workers`` wires the two for the supervisor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from elastic_trainer.errors import ConfigError

KINDS = ("auto", "gpu", "cpu")
CGROUP_ROOT = "/sys/fs/cgroup"
_SLURM_CPU_VARS = ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE")


def local_workers(
    kind: str,
    *,
    cuda_devices: int,
    env: Mapping[str, str],
    cpu_quota: float | None,
    affinity: int,
    host_cpus: int,
) -> int:
    """Workers for ``--nproc-per-node KIND`` on a node with these resources (see module doc).

    ``cuda_devices`` is ignored for ``cpu``; ``cpu_quota`` is in CPUs (None = no quota).
    Raises ConfigError for an unknown kind and for ``gpu`` without a visible GPU.
    """
    if kind not in KINDS:
        raise ConfigError(f"--nproc-per-node={kind!r} is invalid: use a number, auto, gpu or cpu")
    if kind != "cpu":
        gpus = visible_gpus(cuda_devices, env)
        if gpus > 0:
            return gpus
        if kind == "gpu":
            raise ConfigError("--nproc-per-node=gpu is invalid: no CUDA device; use N or auto")
    return allocated_cpus(env=env, cpu_quota=cpu_quota, affinity=affinity, host_cpus=host_cpus)


def visible_gpus(cuda_devices: int, env: Mapping[str, str]) -> int:
    """``cuda_devices`` capped by ``CUDA_VISIBLE_DEVICES`` when it is set.

    CUDA reads the list up to its first invalid entry, so ``""`` and ``"-1"`` hide every GPU.
    """
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return max(cuda_devices, 0)
    count = 0
    for entry in listed.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return max(min(cuda_devices, count), 0)


def allocated_cpus(
    *, env: Mapping[str, str], cpu_quota: float | None, affinity: int, host_cpus: int
) -> int:
    """The smallest CPU bound that is set: Slurm, the cgroup quota, the affinity mask, the host."""
    bounds = [host_cpus, affinity]
    bounds += [n for n in (_positive_int(env.get(name)) for name in _SLURM_CPU_VARS) if n]
    if cpu_quota is not None and cpu_quota > 0:
        bounds.append(max(math.floor(cpu_quota), 1))  # 0.5 CPU still runs one worker
    return max(min(b for b in bounds if b > 0), 1)


def _positive_int(text: str | None) -> int | None:
    """``"8"`` -> 8. Slurm may write ``"8(x2)"`` for a count repeated over nodes: take 8."""
    head = (text or "").split("(")[0].strip()
    return int(head) if head.isdigit() and int(head) > 0 else None


# --- readers: the I/O around local_workers ---------------------------------------------------


def read_cpu_quota(root: str = CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """This process's cgroup CPU quota in CPUs (the tightest along its cgroup path), or None.

    ``self_cgroup`` is the text of /proc/self/cgroup (read when None). cgroup v2 is tried
    first, then v1's cpu controller; any unreadable or malformed file counts as "no quota".
    """
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    v2, v1 = _cgroup_paths(self_cgroup)
    quotas = []
    if Path(root, "cgroup.controllers").exists():
        quotas = [_v2_quota(d) for d in _ancestors(Path(root), v2 or "/")]
    else:
        for controller in ("cpu,cpuacct", "cpu"):
            mount = Path(root, controller)
            if mount.is_dir():
                quotas = [_v1_quota(d) for d in _ancestors(mount, v1 or "/")]
                break
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _cgroup_paths(self_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 cpu controller path) from /proc/self/cgroup lines ``ID:CONTROLLERS:PATH``."""
    v2 = v1 = None
    for line in self_cgroup.splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(mount: Path, cgroup_path: str) -> list[Path]:
    """The cgroup's folder and each parent up to the mount. Inside a container the mount is
    often the container's own cgroup while the path is the host's: then the mount alone."""
    here = mount / cgroup_path.strip("/")
    if not here.is_dir():
        return [mount]
    chain = [here]
    while chain[-1] != mount:
        chain.append(chain[-1].parent)
    return chain


def _v2_quota(folder: Path) -> float | None:
    """``cpu.max`` is ``"QUOTA PERIOD"`` or ``"max PERIOD"`` (no limit)."""
    words = _read_words(folder / "cpu.max")
    if len(words) != 2 or words[0] == "max":
        return None
    return _ratio(words[0], words[1])


def _v1_quota(folder: Path) -> float | None:
    """``cpu.cfs_quota_us`` is -1 when unlimited."""
    quota = _read_words(folder / "cpu.cfs_quota_us")
    period = _read_words(folder / "cpu.cfs_period_us")
    if len(quota) != 1 or len(period) != 1:
        return None
    return _ratio(quota[0], period[0])


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read_words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def read_affinity(host_cpus: int) -> int:
    """CPUs this process may run on (``sched_getaffinity``; the host's where unsupported)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity else host_cpus


def read_cuda_devices() -> int:
    """Visible CUDA devices according to torch (imported only here: it is slow)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def detect_local_workers(kind: str, env: Mapping[str, str] | None = None) -> int:
    """``local_workers`` for this process, with every input read from the machine."""
    env = os.environ if env is None else env
    host = os.cpu_count() or 1
    return local_workers(
        kind,
        cuda_devices=read_cuda_devices() if kind in ("auto", "gpu") else 0,
        env=env,
        cpu_quota=read_cpu_quota(),
        affinity=read_affinity(host),
        host_cpus=host,
    )
