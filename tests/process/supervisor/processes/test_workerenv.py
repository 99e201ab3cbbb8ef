"""The supervisor's malloc tuning for its workers (``workerenv.tune_malloc``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from elastic_trainer.supervisor.processes.workerenv import MALLOC_TUNABLES, tune_malloc


def test_workers_get_our_tunables_unless_the_operator_set_their_own() -> None:
    env: dict[str, str] = {}
    assert tune_malloc(env) and env == {"GLIBC_TUNABLES": MALLOC_TUNABLES}
    for theirs in ("", "glibc.pthread.rseq=0"):
        env = {"GLIBC_TUNABLES": theirs}
        assert not tune_malloc(env) and env == {"GLIBC_TUNABLES": theirs}


# One "training step" of glibc allocations: three 20 MiB chunks allocated, written, freed (as
# a step's activations are). Prints the page faults of the third step. With glibc's defaults
# the first free of an mmap'd chunk sets the mmap threshold to its size and the trim threshold
# to twice that, so the 60 MiB freed at the heap's top each step is given back to the kernel
# and faulted in again the next.
_ROUNDS = textwrap.dedent("""
    import ctypes, ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def faults():
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    def step(size=20 << 20):
        chunks = [libc.malloc(size) for _ in range(3)]
        for p in chunks:
            ctypes.memset(p, 1, size)
        for p in chunks:
            libc.free(p)
    step(); step()
    before = faults()
    step()
    print(faults() - before)
""")


def _third_round_faults(tunables: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    done = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_with_our_tunables_a_repeated_step_faults_in_no_pages_again() -> None:
    pages = (60 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _third_round_faults(MALLOC_TUNABLES) < pages // 20
    assert _third_round_faults(None) >= pages * 9 // 10  # glibc's defaults: all of it again
    # trim_threshold alone turns glibc's dynamic mmap threshold off: every chunk mmap'd anew
    # (why both are set)
    assert _third_round_faults("glibc.malloc.trim_threshold=1073741824") >= pages * 9 // 10


def test_stale_control_folders_of_dead_supervisors_go_and_nothing_else(tmp_path) -> None:
    """A SIGKILLed supervisor leaves its control folder in /tmp; the next start removes it,
    but only a private folder of ours whose supervisor is gone: a live one's, a link, a folder
    mode 0755 or another user's (in a shared /tmp, someone else's) stay."""
    from elastic_trainer.supervisor.processes.workerenv import remove_stale_control_roots

    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    dead = gone.pid
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").touch()
    base = tmp_path / "tmp"
    base.mkdir()

    def folder(name: str, mode: int = 0o700) -> os.PathLike:
        path = base / name
        path.mkdir()
        (path / "attempt-1").mkdir()
        path.chmod(mode)
        return path

    stale = folder(f"elastic-train-{dead}-abc123")
    kept = [
        folder(f"elastic-train-{os.getpid()}-live"),
        folder(f"elastic-train-{dead}-open", 0o755),
    ]
    link = base / f"elastic-train-{dead}-link"
    link.symlink_to(target)
    pidfile = base / "elastic-train-1.0.pid"
    pidfile.touch()
    # elastic-train-<uid>, the in-memory tier's root where there is no /dev/shm, and its
    # fallbacks elastic-train-<uid>.N, named by a number that may be no running PID: they
    # were taken for stale control folders
    memory_roots = [folder(f"elastic-train-{dead}"), folder(f"elastic-train-{dead}.1")]
    kept += [link, pidfile, *memory_roots]
    if os.getuid() == 0:  # as root, a folder of another user's in the same place
        theirs = folder(f"elastic-train-{dead}-theirs")
        os.chown(theirs, 65534, 65534)
        kept.append(theirs)
    assert remove_stale_control_roots(str(base)) == [str(stale)]
    assert not stale.exists()
    assert all(os.path.lexists(path) for path in kept)
    assert (target / "keep").exists()
