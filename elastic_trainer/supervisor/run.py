"""``elastic-train [options] [SCRIPT | -m MODULE] [args...]``: argv -> exit code.

Exit codes (``protocol``): 0 the job finished; 1 it failed (restart budget spent, rendezvous
timed out, store lost); 2 bad configuration, found before any worker starts; 143 this node
was preempted (SIGTERM/SIGUSR1) and stopped within its grace period.

Imports: torch, and every module of ours that loads it (the agent, the rendezvous handler,
the signed store, ``torch_compat``), are imported inside the functions that need them, on
purpose: a bad flag, ``--help`` or a finished job is answered before torch loads (seconds on
a loaded machine), and the warm pool imports torch meanwhile. Everything else is imported
here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import shutil
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from elastic_trainer.contract import protocol
from elastic_trainer.contract.config import RunConfig
from elastic_trainer.contract.endpoint import split_address
from elastic_trainer.contract.events import JobStatus, emit
from elastic_trainer.errors import (
    ConfigError,
    ElasticTrainError,
    StorageUnavailable,
    first_line,
)
from elastic_trainer.logging import (
    configure_logging,
    open_log_file,
    redact,
    resolve_format,
    route_torch_logs,
    static_fields,
)
from elastic_trainer.supervisor import finished, metrics_server
from elastic_trainer.supervisor.cli import args
from elastic_trainer.supervisor.cli import preflight as entrypoint_preflight
from elastic_trainer.supervisor.core.ledger import Ledger
from elastic_trainer.supervisor.core.outcome import (
    STATUS_CLOSED,
    STATUS_CONFIG_ERROR,
    STATUS_PREEMPTED,
    STATUS_STORE_LOST,
    STATUS_SUCCEEDED,
    AgentOutcome,
)
from elastic_trainer.supervisor.processes import fd_limit, procs, signals, stderr_router, workerenv
from elastic_trainer.supervisor.processes.signals import StopRequested
from elastic_trainer.supervisor.rendezvous import endpoint, static_host, store_record
from elastic_trainer.supervisor.rendezvous.endpoint import (
    STORE_SILENCE_LIMIT_S,
    EndpointError,
    StoreUnreachable,
    bound_silent_connections,
)
from elastic_trainer.supervisor.rendezvous.failover import StoreMoveFailed
from elastic_trainer.supervisor.rendezvous.secret import job_key
from elastic_trainer.supervisor.warm import launcher
from elastic_trainer.supervisor.warm.launcher import WarmPool
from snapshots.format.manifest import now_iso
from snapshots.storage import open_storage
from snapshots.storage.retry import RetryPolicy, is_transient

# torch's C++ warnings (c10d's TCPStore retries, with stack traces) are noise in a job whose
# failures we report as events; errors still show. Set before torch loads; workers inherit it.
# TORCH_CPP_LOG_LEVEL=WARNING brings them back (as output.stderr events in JSON mode).
_CPP_LOG_LEVEL = "ERROR"
_RENDEZVOUS_TIMEOUT = JobStatus.RENDEZVOUS_TIMEOUT.value


def main(argv: Sequence[str] | None = None) -> int:
    # First of all, before any heavy import: SIGTERM/SIGINT in the first second is a stop
    # (exit 143), not a death by signal; until the supervisor runs, it interrupts at once.

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", _CPP_LOG_LEVEL)
    fd_limit.raise_soft_limit()  # the store's connections are unbounded (fd_limit.py)

    stop, previous = signals.install_early()
    argv = list(sys.argv[1:] if argv is None else argv)
    pool = None
    try:
        cfg = args.parse(argv)
        _check_log_file(cfg.worker)
        configure_logging(
            fmt=cfg.worker.log_format,  # type: ignore[arg-type]
            log_file=cfg.worker.log_file,
            group_access=cfg.worker.snapshot_group_access,
            static_fields={
                "job_id": cfg.job_id,
                "node": cfg.node,
                "pid": os.getpid(),
                # one per supervisor start: report/status tell apart two commands writing
                # into one events-<node>.jsonl (a stray second start, a rerun)
                "supervisor_run": uuid.uuid4().hex[:16],
            },
        )
        _check_entrypoint(cfg)  # a typo in the script's name: one line at once, no pool
        fd_limit.check_for_nodes(cfg.max_nodes)  # a warning: the limit was raised at start
        if (done := _already_finished(cfg)) is not None:  # the end of a job is final
            return _nothing_to_run(cfg, done, previous)
        pool = prepare_node(cfg)
        claimed = claim_store_port(cfg)
        warn_untested_torch()  # our own import of torch, while the pool imports its own
        preflight(cfg, pool)  # forked from the pool once it is ready
        stop.interruptible = False  # from here on the supervisor stops its workers gracefully
        serving = _start_metrics(cfg)  # a taken port is bad input: found before any worker
    except signals.StopRequested:
        _close(pool, at_once=True)
        signals.restore(previous)
        return protocol.SUPERVISOR_EXIT_PREEMPTED
    except ElasticTrainError as exc:  # config, dataset, storage: found before any worker starts
        _close(pool, at_once=True)
        signals.restore(previous)
        print(f"elastic-train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except SystemExit as exc:  # --help
        _close(pool, at_once=True)
        signals.restore(previous)
        return int(exc.code or 0)
    router = None
    if resolve_format(cfg.worker.log_format) == "json":  # type: ignore[arg-type]
        router = stderr_router.install(static_fields)
    try:
        return Supervisor(cfg, serving=serving, claimed=claimed, pool=pool).run()
    finally:
        _close(pool)
        if router is not None:
            router.close()


def _already_finished(cfg: RunConfig) -> str | None:
    """The one line of a command whose job has finished (``supervisor/finished.py``); None
    to run. Storage that cannot be read now is the preflight's to report."""
    if not cfg.worker.snapshot_dir:
        return None

    try:
        storage = open_storage(
            cfg.worker.snapshot_dir, storage_options=cfg.worker.snapshot_storage_options()
        )
        return finished.already_finished(
            storage.single_attempt(),
            redact(cfg.worker.snapshot_dir),
            cfg.job_id,
            list(cfg.entrypoint.argv()),
            resume=cfg.resume_finished,
        )
    except Exception:  # not reachable (yet): the preflight waits for it and says why
        return None


def _nothing_to_run(cfg: RunConfig, line: str, previous: Any) -> int:
    """Exit 0 with ``line``: the job finished before this command started."""

    signals.restore(previous)
    emit("job.finished", status=STATUS_CLOSED, exit_code=protocol.SUPERVISOR_EXIT_OK,
         restarts=0, wall_s=0.0, goodput=None, goodput_estimated=False, error=None,
         reason=line)  # fmt: skip
    return protocol.SUPERVISOR_EXIT_OK


def prepare_node(cfg: RunConfig) -> WarmPool | None:
    """What every process this supervisor starts inherits -- the workers' environment and
    the guards that make them die with us -- then the warm pool, first thing: it imports
    torch while this process imports its own, binds the store and runs the preflight
    (seconds each on a loaded machine), instead of after them."""

    # Workers must not reuse the agent's store across rounds: a restarted rank would read
    # the dead rank 0's address and dial it, and scale-up deadlocks (torchrun shares it,
    # and its worker-crash and node-join recoveries never finish: docs/command-line.md,
    # "Recovery defaults").
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1" if cfg.nproc_per_node > 1 else "")
    if not os.environ["OMP_NUM_THREADS"]:
        del os.environ["OMP_NUM_THREADS"]
    workerenv.tune_malloc(os.environ)  # read when a process starts: before the pool's
    procs.guard_node()
    return launcher.start_pool(cfg)


def _close(pool: WarmPool | None, *, at_once: bool = False) -> None:
    """``at_once``: a start that ends before any worker: the pool, likely still importing
    torch and deaf to its socket, is killed instead of given its grace, and so is the node
    sentinel."""
    if pool is not None:
        pool.close(grace_s=0 if at_once else None)
    if at_once:
        procs.end_node_sentinel()


def _start_metrics(cfg: RunConfig) -> Any:

    return metrics_server.start(cfg.metrics_host, cfg.metrics_port)


# ---- checks before any worker starts ----------------------------------------------------
def preflight(cfg: RunConfig, pool: WarmPool | None = None) -> None:
    # the script's own flags and data, at every world size it may run at: a typo is one line
    # and exit 2 here, not a crash in every worker (supervisor/cli/preflight.py; forked from
    # the warm pool where there is one)
    world_sizes = [cfg.nproc_per_node * n for n in range(cfg.min_nodes, cfg.max_nodes + 1)]
    for warning in entrypoint_preflight.run(cfg.entrypoint, world_sizes, pool=pool):
        emit("preflight.warning", level="warning", warning=warning)

    if cfg.worker.snapshot_dir:
        storage = check_snapshot_dir(
            cfg.worker.snapshot_dir,
            storage_timeout=cfg.worker.storage_timeout_s,
            storage_options=cfg.worker.snapshot_storage_options(),
        )
        del storage  # reachable and writable; a finished job was dealt with in main
    if not hosts_store(cfg):
        check_endpoint(cfg.rdzv_host, cfg.rdzv_port, read_timeout_s=cfg.rdzv.read_timeout)


def warn_untested_torch() -> None:
    """GPU images often carry an older torch than pip would install: a user who keeps it
    hears so once, before a failure that may be the release's."""
    import torch

    from elastic_trainer.supervisor import torch_compat

    if (untested := torch_compat.untested_torch(torch.__version__)) is not None:
        emit("preflight.warning", level="warning", warning=untested)


def _check_log_file(settings: protocol.WorkerSettings) -> None:
    """The event log, created here before anything writes it, of the modes the settings ask
    for (``logging.open_log_file``)."""
    path = settings.log_file
    if not path:
        return
    try:
        os.close(open_log_file(path, group_access=settings.snapshot_group_access))
    except OSError as exc:
        raise ConfigError(
            f"--log-file={path!r} is not writable ({exc.strerror}): pick a writable path"
        ) from exc


def _check_entrypoint(cfg: RunConfig) -> None:
    entry = cfg.entrypoint
    if entry.script and entry.no_python:
        if not (os.path.isfile(entry.script) or shutil.which(entry.script)):
            raise ConfigError(
                f"SCRIPT={entry.script!r} (--no-python) is neither a file nor on PATH"
            )
        return
    if entry.script:
        if not os.path.isfile(entry.script):
            raise ConfigError(f"SCRIPT={entry.script!r} does not exist: check the path")
        return
    module = entry.effective_module or ""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"-m {module!r}: no such module; check the name and the PYTHONPATH")


def check_snapshot_dir(
    url: str,
    *,
    storage_timeout: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Write and delete a probe file through the snapshot store's own storage layer, within
    its deadline (``--storage-timeout``). A permanent problem (permissions, a missing bucket,
    no backend) is ConfigError (exit 2); storage that stays unreachable through the deadline
    is StorageUnavailable (exit 1): it may come up, so a restart policy should retry."""

    safe = redact(url)
    try:
        storage = open_storage(
            url,
            storage_options=storage_options,
            retry=RetryPolicy().with_timeout(storage_timeout),
        )
        storage.check(create=True)
        probe = f".elastic-train-probe-{uuid.uuid4().hex}"
        storage.write(probe, b"probe")
        storage.delete(probe)
        return storage
    except Exception as exc:
        cause = exc.__cause__ or exc
        reason = _scrub(first_line(str(cause)) or type(cause).__name__, url)
        if is_transient(cause):
            raise StorageUnavailable(
                f"--snapshot-dir={safe!r} did not answer within the storage timeout ({reason}): "
                "check the endpoint and network, or raise --storage-timeout"
            ) from exc
        raise ConfigError(
            f"--snapshot-dir={safe!r} is not writable ({reason}): "
            "fix the path, permissions or credentials"
        ) from exc


def _scrub(text: str, url: str) -> str:
    """Redact URLs in ``text`` and the URL's own credentials wherever they were echoed."""

    text = redact(text)
    parts = urlsplit(url)
    for secret in (parts.password, parts.username):
        if secret:
            text = text.replace(secret, "***")
    return text


def claim_store_port(cfg: RunConfig) -> Any:
    """An agent that may host the store binds its port first thing (``endpoint.claim_port``):
    on one machine the agent started first hosts it. A port that is taken is left to the
    rendezvous, which reports it as before (bad input only when asked to host)."""
    if not hosts_store(cfg):
        return None

    return endpoint.claim_port(cfg.rdzv_host, cfg.rdzv_port)


def hosts_store(cfg: RunConfig) -> bool:
    if cfg.is_host is not None:
        return cfg.is_host
    if is_loopback(cfg.rdzv_host):  # torch's answer too, without importing torch (seconds)
        return True  # before the port is claimed: the agent started first must win it
    # an address of one of this machine's interfaces: torch only compares the addresses the
    # hostname resolves to, which on Debian and Ubuntu is 127.0.1.1, so a machine given its
    # own IP as the endpoint would wait for a store nobody hosts
    if static_host.is_local_address(cfg.rdzv_host):
        return True
    from elastic_trainer.supervisor import torch_compat

    return torch_compat.matches_machine_hostname(cfg.rdzv_host)


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address: this machine, whatever its name."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_endpoint(host: str, port: int, *, read_timeout_s: float) -> None:
    """Exit 2 now for a name that does not resolve or a port that is not a c10d store; a
    store that is not up yet is not an error: ``create_handler`` waits for it."""

    endpoint.check(host, port, read_timeout_s=read_timeout_s)


def _static_host_hint(cfg: RunConfig) -> str:
    """Static mode's node rank 0 hosts the store: a second node given --node-rank 0 on the
    same host finds the port taken (the rendezvous' own check never sees it)."""
    if cfg.torchrun.node_rank != 0:
        return ""
    return " (static mode: if another node was also given --node-rank 0, give each its own)"


def _route_torch_logs() -> None:
    """torch gives its loggers their own stderr handlers; send them through ours."""
    import torch.distributed.elastic  # noqa: F401  # installs torch's handlers first

    route_torch_logs()


# ---- the run ------------------------------------------------------------------------------
class Supervisor:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        serving: Any = None,
        claimed: Any = None,
        pool: WarmPool | None = None,
    ) -> None:
        self.cfg = cfg
        self.serving = serving  # metrics_server.Serving, started by main (None: started here)
        self.claimed = claimed  # the store's port, bound by main (``claim_store_port``)
        self.pool = pool  # the warm pool, started by main (``prepare_node``); None: no pool
        self.goodput_estimated = False  # the agent's goodput came from worker run times
        self.ledger = Ledger()  # the agent's, once it ran: what restarts cost (job.finished)

    def run(self) -> int:
        started = time.monotonic()

        _route_torch_logs()

        stop = signals.process_stop()
        signals.install(stop)
        with self.serving or _start_metrics(self.cfg) as metrics:
            return self._supervise(stop, metrics, started)

    def _supervise(self, stop: object, metrics: object, started: float) -> int:

        emit("supervisor.started", **self.cfg.summary())
        started_at = time.time()
        outcome = self._finished_meanwhile(self._run_agent(stop, metrics), started_at)
        _close(self.pool)  # the agent closed it, unless it never started
        procs.reap_strays(keep=set())
        code, error, goodput = outcome.exit_code, outcome.error, outcome.goodput
        # exit 0 with a line: not an error (the job had finished when this node arrived)
        reason, error = (error, None) if code == protocol.SUPERVISOR_EXIT_OK else (None, error)
        if error and resolve_format(self.cfg.worker.log_format) == "console":  # type: ignore[arg-type]
            # why this node cannot go on, for a person; JSON mode has it in job.finished.error
            print(f"elastic-train: error: {error}", file=sys.stderr, flush=True)
        if outcome.status == JobStatus.SUCCEEDED:
            self._record_finished()
        emit(
            "job.finished",
            level="info" if code in (0, protocol.SUPERVISOR_EXIT_PREEMPTED) else "error",
            status=outcome.status,
            exit_code=code,
            restarts=outcome.restarts,
            wall_s=round(time.monotonic() - started, 3),
            goodput=None if goodput is None else round(goodput, 4),
            goodput_estimated=self.goodput_estimated,  # also where goodput is unknown (null)
            error=error,
            reason=reason,
            **self.ledger.finished_fields(time.monotonic() - started),
        )
        return code

    def _finished_meanwhile(self, outcome: AgentOutcome, started_at: float) -> AgentOutcome:
        """A node that arrived as the job ended: its rendezvous failed because the job's
        nodes left (the store host with them), which the folder's record shows. Exit 0 and
        say so, not "store lost, restart the job"."""

        cfg = self.cfg
        joining = {STATUS_STORE_LOST, _RENDEZVOUS_TIMEOUT}
        if outcome.status not in joining or outcome.restarts or not cfg.worker.snapshot_dir:
            return outcome

        with contextlib.suppress(Exception):
            storage = open_storage(
                cfg.worker.snapshot_dir, storage_options=cfg.worker.snapshot_storage_options()
            ).single_attempt()
            recorded = finished.read(storage, cfg.job_id)
            if finished.finished_while_joining(recorded, started_at=started_at):
                line = finished.done_line(redact(cfg.worker.snapshot_dir), recorded or {})
                return _ended(STATUS_CLOSED, protocol.SUPERVISOR_EXIT_OK, line)
        return outcome

    def _record_finished(self) -> None:
        """``finished.json`` in the run folder (see ``supervisor/finished.py``); best effort:
        a folder that cannot take it only loses the next run's warning."""
        cfg = self.cfg
        if not cfg.worker.snapshot_dir:
            return

        body = finished.record(cfg.job_id, list(cfg.entrypoint.argv()), now_iso())
        with contextlib.suppress(Exception):
            open_storage(
                cfg.worker.snapshot_dir, storage_options=cfg.worker.snapshot_storage_options()
            ).write(finished.FINISHED_NAME, body)

    def _run_agent(self, stop: object, metrics: object = None) -> AgentOutcome:
        from torch.distributed import DistNetworkError, DistStoreError
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousClosedError,
            RendezvousError,
            RendezvousTimeoutError,
        )

        from elastic_trainer.supervisor import agent as agent_mod
        from elastic_trainer.supervisor.rendezvous.handler import create_handler

        cfg = self.cfg
        stop.interruptible = True  # type: ignore[attr-defined]  # nothing to stop gracefully yet
        try:
            if stop.requested:  # type: ignore[attr-defined]
                raise StopRequested("stop")
            key = job_key(
                secret_file=cfg.rdzv_secret_file,
                snapshot_dir=cfg.worker.snapshot_dir,
                job_id=cfg.job_id,
            )
            if moved := self._moved_store(key):  # the job's store failed over elsewhere
                found, where = moved
                handler = create_handler(
                    cfg, key=key, serve=False, store=found, store_endpoint=where
                )
                probe = None
                host, port = split_address(where)
                bound_silent_connections(host, port, timeout_s=STORE_SILENCE_LIMIT_S)
            else:
                serving = hosts_store(cfg)  # a name lookup and a bind: asked once
                handler = create_handler(cfg, key=key, serve=serving, claimed=self.claimed)
                probe = static_host.start_probe(cfg, handler.store, serving=serving)
                if not serving:  # a partition must not block us past its bound
                    bound_silent_connections(
                        cfg.rdzv_host, cfg.rdzv_port, timeout_s=STORE_SILENCE_LIMIT_S
                    )
        except StopRequested:
            return _ended(STATUS_PREEMPTED, protocol.SUPERVISOR_EXIT_PREEMPTED)
        except EndpointError as exc:  # bad input found only now (the port was taken, ...)
            line = str(exc) + _static_host_hint(cfg)
            return _ended(STATUS_CONFIG_ERROR, protocol.SUPERVISOR_EXIT_CONFIG, line)
        except ConfigError as exc:  # the job's secret: unreadable, or not the others'
            return _ended(STATUS_CONFIG_ERROR, protocol.SUPERVISOR_EXIT_CONFIG, str(exc))
        except StoreUnreachable as exc:  # waited the join timeout (one warning said so)
            return _ended(_RENDEZVOUS_TIMEOUT, protocol.SUPERVISOR_EXIT_FAILED, str(exc))
        except Exception as exc:
            self._store_unreachable(exc)
            return _ended(STATUS_STORE_LOST, protocol.SUPERVISOR_EXIT_FAILED)
        finally:
            stop.interruptible = False  # type: ignore[attr-defined]
        workerenv.point_gloo_at(cfg.local_addr, os.environ)  # the workers inherit it
        control_root = workerenv.make_control_root(cfg)
        workerenv.remove_stale_memory_dirs(cfg)
        spec = WorkerSpec(
            role=cfg.torchrun.role,
            local_world_size=cfg.nproc_per_node,
            entrypoint=workerenv.worker_entrypoint(cfg),
            args=workerenv.worker_args(cfg),
            rdzv_handler=handler,
            max_restarts=cfg.max_restarts,
            monitor_interval=cfg.monitor_interval,
            local_addr=cfg.local_addr,
        )
        console = resolve_format(cfg.worker.log_format) == "console"  # type: ignore[arg-type]
        logs = workerenv.logs_specs(cfg, control_root, console=console, fields=static_fields())
        agent = agent_mod.ElasticTrainAgent(
            spec=spec,
            logs_specs=logs,
            cfg=cfg,
            stop=stop,  # type: ignore[arg-type]
            control_root=control_root,
            metrics=metrics,
            pool=self.pool,
        )
        try:
            outcome = agent.supervise()
            self.goodput_estimated = agent.ledger.goodput_estimated
            self.ledger = agent.ledger
        except RendezvousClosedError:
            return _ended(STATUS_CLOSED, protocol.SUPERVISOR_EXIT_OK)
        except ConfigError as exc:  # found once the round closed (static: a node rank twice)
            return _ended(STATUS_CONFIG_ERROR, protocol.SUPERVISOR_EXIT_CONFIG, str(exc))
        except RendezvousTimeoutError:
            # too few nodes within --rdzv-conf join_timeout
            return _ended(_RENDEZVOUS_TIMEOUT, protocol.SUPERVISOR_EXIT_FAILED)
        # The store is gone: the rendezvous' own connection/state errors, or c10d's store
        # errors from a direct read or write. Any other RuntimeError is a bug and propagates.
        except (RendezvousError, DistNetworkError, DistStoreError) as exc:
            self._store_unreachable(exc)
            return _ended(STATUS_STORE_LOST, protocol.SUPERVISOR_EXIT_FAILED)
        except StoreMoveFailed as exc:  # its host silent, or gone and no new store came up
            self._store_unreachable(exc)
            return _ended(STATUS_STORE_LOST, protocol.SUPERVISOR_EXIT_FAILED, str(exc))
        finally:
            if probe is not None:
                probe.stop()
            workerenv.close_logs(logs)
            shutil.rmtree(control_root, ignore_errors=True)
            workerenv.remove_memory_dir(cfg)
        if outcome.status == STATUS_SUCCEEDED:
            # close the rendezvous so that a node arriving now exits instead of waiting
            with contextlib.suppress(Exception):
                handler.shutdown()
        return outcome

    def _moved_store(self, key: Any) -> tuple[Any, str] | None:
        """The job's store where the snapshot folder says it moved (``store_record``), if it
        answers there: joined instead of the configured endpoint, which this node would
        otherwise host again (a second store) or wait at in vain."""
        from elastic_trainer.supervisor.rendezvous.signed_store import signed

        cfg = self.cfg
        if cfg.torchrun.node_rank is not None:  # static mode: the store never moves
            return None
        found = store_record.find(
            cfg.worker.snapshot_dir,
            cfg.job_id,
            key=key,
            configured=cfg.rdzv_endpoint,
            connect=lambda host, port: signed(
                endpoint.try_job_store(host, port, cfg.rdzv.read_timeout), key
            ),
        )
        if found is None:
            return None
        if self.claimed is not None:  # not ours to host after all
            self.claimed.close()
            self.claimed = None
        emit("store.found", endpoint=found[1], configured_endpoint=cfg.rdzv_endpoint)
        return found

    def _store_unreachable(self, exc: BaseException) -> None:
        cause = exc.__cause__ or exc
        emit(
            "store.unreachable",
            level="error",
            endpoint=self.cfg.rdzv_endpoint,
            error=redact(first_line(str(cause)) or type(cause).__name__),
            consequence="this node stops; restart the job (it resumes from the last snapshot)",
        )


def _ended(status: str, exit_code: int, error: str | None = None) -> AgentOutcome:
    """The outcome of a run the agent could not report on itself (it never started, or its
    rendezvous ended it): no restarts counted, no goodput."""
    return AgentOutcome(status=status, exit_code=exit_code, restarts=0, goodput=None, error=error)
