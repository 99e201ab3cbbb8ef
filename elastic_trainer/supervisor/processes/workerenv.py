"""What the supervisor hands its workers besides torchrun's variables: our environment and a
fresh control directory per attempt (stop file, progress files;
``elastic_trainer.contract.protocol``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from typing import Any

from elastic_trainer.contract import protocol
from elastic_trainer.contract.config import RunConfig
from elastic_trainer.contract.events import emit
from elastic_trainer.supervisor.processes import memory_folders

# Workers run their script through this module (see its docstring: a clean interpreter exit)
BOOTSTRAP_MODULE = "elastic_trainer.entrypoints.worker"


# glibc's malloc for the workers. A training step allocates and frees the same MB-sized
# tensors (activations, gradients) every step. With glibc's defaults a process falls, by the
# luck of its heap's layout, into one of several regimes: in one, every step gives MBs back
# to the kernel (heap trimming, or mmap'd chunks) and faults them in again, thousands of page
# faults and slower steps; in another, none. Which one a run gets varies from process to
# process (a snapshot job's extra allocations make the slow ones likelier), which adds noise
# to any comparison of two jobs. Fixed thresholds end the lottery: chunks up to 32 MiB
# (glibc's own dynamic maximum on 64-bit, accepted by every version) come from the heap, and
# up to 1 GiB free at its top is kept: no faults per step, every run. Both are needed:
# setting either alone turns off glibc's dynamic threshold, and trim_threshold alone maps
# every chunk over 128 KiB afresh (far more faults and slower steps than the defaults). The
# figures: docs/how-it-works.md, "Workers' malloc is tuned for training steps". An operator's own
# GLIBC_TUNABLES (even empty) is left as it is. Other C libraries ignore the variable.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def tune_malloc(environ: MutableMapping[str, str]) -> bool:
    """Give the workers ``MALLOC_TUNABLES`` unless GLIBC_TUNABLES is already set."""
    if "GLIBC_TUNABLES" in environ:
        return False
    environ["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    return True


def set_worker_env(cfg: RunConfig, control_dir: str, *, mtbf_s: float | None = None) -> None:
    """Put this attempt's settings into our environment, which torch hands to the workers."""
    memory = prepare_memory_dir(cfg) if cfg.memory_tier else None
    cfg.worker_settings(control_dir, memory, mtbf_s=mtbf_s).apply_to(os.environ)


def memory_base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _runtime_dir() -> str | None:
    return os.environ.get("XDG_RUNTIME_DIR") or None


@functools.cache
def memory_root(base: str, uid: int) -> str | None:
    """This user's private root for in-memory tiers in the shared ``base``
    (``memory_folders``): ``elastic-train-<uid>``, or, where that name is not ours (another
    user made it first), the fixed fallback every later run of ours finds too, and
    ``snapshot.memory_refused`` says which (``using``; None: no candidate is ours, the tier
    is off for this run): the job is not stopped by a name someone took."""
    choice = memory_folders.choose_root(base, uid, _runtime_dir())
    if choice.refused:
        reason = "; ".join(why for _path, why in choice.refused)[:2000]
        path = choice.refused[0][0]
        emit(
            "snapshot.memory_refused", level="warning", path=path, reason=reason, using=choice.path
        )
    return choice.path


def memory_dir(cfg: RunConfig, base: str | None = None) -> str | None:
    """This agent's in-memory tier folder: on tmpfs (/dev/shm) where there is one, inside
    this user's private root, named by the job and this supervisor's pid, so it outlives
    worker restarts on this agent, differs per agent (two on one machine too), and
    ``remove_memory_dir`` frees it at exit. None where no root is ours."""
    root = memory_root(base or memory_base(), os.geteuid())
    return None if root is None else memory_folders.node_folder(root, cfg.job_id, os.getpid())


# node folder -> the descriptor holding its owner.lock, for as long as this supervisor lives
_claims: dict[str, int] = {}


def prepare_memory_dir(cfg: RunConfig, base: str | None = None) -> str | None:
    """``memory_dir``, made (mode 0700), checked ours and claimed by this process
    (``memory_folders.claim``): no other supervisor's sweep removes it while we live."""
    path = memory_dir(cfg, base)
    if path is None:
        return None
    memory_folders.make_node_folder(path)
    held = _claims.get(path)
    if held is None or not memory_folders.still_claimed(path, held):  # first, or removed
        if held is not None:
            os.close(held)
        _claims[path] = memory_folders.claim(path)
    return path


def remove_stale_memory_dirs(cfg: RunConfig, base: str | None = None) -> memory_folders.Freed:
    """Free the folders that supervisors of ours on this machine left when they died
    (SIGKILL, a container's end), of any job (not only ``cfg``'s) and in every root of ours
    (``memory_folders.sweep``): their copies are of no use to anyone (a new agent never
    reads another agent's folder), and tmpfs is memory. ``snapshot.memory_freed`` counts
    them."""
    import psutil

    roots = memory_folders.our_roots(base or memory_base(), os.geteuid(), _runtime_dir())
    freed = memory_folders.sweep(roots, psutil.pid_exists)
    if freed.folders:
        emit("snapshot.memory_freed", folders=freed.folders, bytes=freed.bytes)
    return freed


def remove_memory_dir(cfg: RunConfig, base: str | None = None) -> None:
    """Free this agent's folder (removed before its claim ends), its job's once empty, and
    those of agents here that died and never came back (a clean end leaves nothing)."""
    path = memory_dir(cfg, base)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        held = _claims.pop(path, None)
        if held is not None:
            os.close(held)
        with contextlib.suppress(OSError):  # the job's folder, once no agent of it is left
            os.rmdir(os.path.dirname(path))
    remove_stale_memory_dirs(cfg, base)


def interface_of(address: str) -> str | None:
    """The network interface that carries ``address`` on this machine, if any."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == address for a in addrs):
            return name
    return None


def point_gloo_at(local_addr: str | None, environ: dict[str, str] | Any) -> None:
    """gloo picks its interface from the hostname, which can resolve to loopback or not at
    all (pods, namespaces): with ``--local-addr`` it uses that address's interface instead.
    A GLOO_SOCKET_IFNAME the operator set is kept."""
    if not local_addr or environ.get("GLOO_SOCKET_IFNAME"):
        return
    interface = interface_of(local_addr)
    if interface is not None:
        environ["GLOO_SOCKET_IFNAME"] = interface


def worker_entrypoint(cfg: RunConfig) -> str:
    """The program each worker runs: Python, or the executable itself (``--no-python``)."""
    entry = cfg.entrypoint
    return entry.script if entry.no_python and entry.script else sys.executable


def worker_args(cfg: RunConfig) -> tuple[str, ...]:
    """Arguments after the entrypoint: unbuffered Python through the bootstrap, or the
    executable's own arguments (``--no-python``)."""
    if cfg.entrypoint.no_python:
        return cfg.entrypoint.args
    return ("-u", "-m", BOOTSTRAP_MODULE, *cfg.entrypoint.argv())


def logs_specs(
    cfg: RunConfig, control_root: str, *, console: bool, fields: Mapping[str, Any]
) -> Any:
    """torch's per-rank log files, as torchrun's --log-dir/--redirects/--tee ask for them;
    the streams left on the console are relayed (``supervisor/processes/console.py``): on a
    ``console`` with a ``[rank0]:`` prefix, in JSON mode stderr as events with ``fields``
    and the rank. Close it (``close_logs``) once the workers are gone."""
    from torch.distributed.elastic.multiprocessing import Std

    from elastic_trainer.supervisor.processes.console import RelayedLogsSpecs

    options = cfg.torchrun
    torch_options = {
        "log_dir": options.log_dir or os.path.join(control_root, "logs"),
        "redirects": Std.from_str(options.redirects),
        "tee": Std.from_str(options.tee),
        "local_ranks_filter": set(options.local_ranks_filter)
        if options.local_ranks_filter
        else None,
    }
    return RelayedLogsSpecs(
        template=options.log_line_prefix_template,
        json_fields=None if console else fields,
        **torch_options,
    )


def close_logs(specs: Any) -> None:
    """Relay the workers' last console output (a no-op for torch's own LogsSpecs)."""
    close = getattr(specs, "close", None)
    if close is not None:
        close()


CONTROL_ROOT_PREFIX = "elastic-train-"


def make_control_root(cfg: RunConfig) -> str:
    base = cfg.control_root or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    remove_stale_control_roots(base)
    return tempfile.mkdtemp(prefix=f"{CONTROL_ROOT_PREFIX}{os.getpid()}-", dir=base)


def remove_stale_control_roots(base: str) -> list[str]:
    """Control folders (``elastic-train-PID-*``) left in ``base`` by supervisors of ours that
    died without removing them (SIGKILL): their workers are gone with them. Only real
    folders owned by this user, private as ``mkdtemp`` made them, whose PID is not running:
    anything else in a shared place is not ours to touch. The paths removed."""
    import psutil

    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            # mkdtemp's name: the PID, a dash and a random part; not elastic-train-<uid> (the
            # in-memory tier's root where there is no /dev/shm)
            pid, _dash, random_part = name[len(CONTROL_ROOT_PREFIX) :].partition("-")
            if not name.startswith(CONTROL_ROOT_PREFIX) or not pid.isdigit() or not random_part:
                continue
            path = os.path.join(base, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            ours = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            if ours and stat.S_IMODE(st.st_mode) == 0o700 and not psutil.pid_exists(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def new_control_dir(root: str, attempt: int, *, handoff: bool = False) -> str:
    """An empty ``attempt-N`` folder; the previous attempt's is removed (stale stop files),
    except with ``handoff``: its workers still run, and this folder is marked
    (``protocol.HANDOFF_FILE``) until they have stopped (``remove_control_dir`` then)."""
    path = os.path.join(root, f"attempt-{attempt}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    if handoff:
        open(os.path.join(path, protocol.HANDOFF_FILE), "w").close()
    else:
        remove_control_dir(os.path.join(root, f"attempt-{attempt - 1}"))
    return path


def remove_control_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
