"""The edge of the metrics: a ``prometheus_client`` registry fed with ``metrics.Change``
values, and a small HTTP server for ``/metrics`` (Prometheus text) and ``/health`` (JSON).

The registry is our own, never the process-wide default: nothing another library registers
shows up, and tests build as many as they like. The supervisor's own events reach it through
a logging handler (``EventFeed``), its workers' through the control directory
(``observer.py``); both end in ``SupervisorMetrics.event``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor.core import metrics as M


class _AgeCollector:
    """A gauge computed at scrape time: now minus a unix time another gauge holds."""

    def __init__(
        self, spec: M.MetricSpec, source: Callable[[], float | None], clock: Callable[[], float]
    ) -> None:
        self._spec, self._source, self._clock = spec, source, clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._spec.name, self._spec.help)
        when = self._source()
        if when is not None:
            family.add_metric([], max(0.0, self._clock() - when))
        yield family


def _build(spec: M.MetricSpec, registry: CollectorRegistry) -> Any:
    common = {"labelnames": spec.labels, "registry": registry}
    if spec.kind == M.Kind.COUNTER:
        return Counter(spec.name, spec.help, **common)
    if spec.kind == M.Kind.HISTOGRAM:
        return Histogram(spec.name, spec.help, buckets=spec.buckets, **common)
    return Gauge(spec.name, spec.help, **common)


class SupervisorMetrics:
    """The metrics of one supervisor and its health, updated from any thread."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Any] = {}
        self._latest: dict[str, float] = {}  # unlabelled gauges' values, for age_of
        for spec in M.METRICS.values():
            if spec.age_of is not None:
                source = self._latest_of(spec.age_of)
                self.registry.register(_AgeCollector(spec, source, clock))  # type: ignore[arg-type]
                continue
            self._metrics[spec.name] = _build(spec, self.registry)
            for label, values in spec.values.items():
                for value in values:  # closed vocabularies start at 0
                    self._metrics[spec.name].labels(**{label: value})
        self._lock = threading.Lock()
        self._health = M.Health()
        self._steps = M.StepCount()

    def _latest_of(self, name: str) -> Callable[[], float | None]:
        return lambda: self._latest.get(name)

    # ---- inputs --------------------------------------------------------------------------
    def apply(self, changes: Iterable[M.Change]) -> None:
        for change in changes:
            metric = self._metrics[change.metric]
            if change.labels:
                metric = metric.labels(**dict(change.labels))
            if change.op == M.Op.SET:
                metric.set(change.value)
                if not change.labels:
                    self._latest[change.metric] = change.value
            elif change.op == M.Op.INC:
                metric.inc(change.value)
            else:
                metric.observe(change.value)

    def event(self, event: Mapping[str, Any]) -> None:
        """One catalogued event (the supervisor's or a worker's)."""
        self.apply(M.changes_for(event))
        with self._lock:
            self._health = M.next_health(self._health, event)

    def attempt_started(self) -> None:
        with self._lock:
            self._steps = M.StepCount()

    def progress(self, reports: Mapping[int, Any]) -> None:
        """One tick's progress reports (``watchdog.Progress`` by local rank)."""
        with self._lock:
            self._steps, changes = M.progress_changes(self._steps, reports)
            if any(c.metric == "elastic_train_steps_total" for c in changes):
                self._health = M.progressed(self._health, self._steps.seen or 0)
        self.apply(changes)

    def goodput(self, ratio: float | None) -> None:
        self.apply(M.goodput_changes(ratio))

    # ---- outputs -------------------------------------------------------------------------
    def health(self) -> M.Health:
        with self._lock:
            return self._health

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EventFeed(logging.Handler):
    """Hands every structlog event of this process to ``sink`` (records of foreign loggers,
    torch's, are plain strings and skipped)."""

    def __init__(self, sink: Callable[[Mapping[str, Any]], None]) -> None:
        super().__init__()
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and "event" in record.msg:
            try:
                self._sink(record.msg)
            except Exception:  # a metric must never break the supervisor's logging
                self.handleError(record)


# ---- HTTP ---------------------------------------------------------------------------------
# Anyone on the host can connect: each connection costs a thread, so they are capped, and one
# that does not send its request in time is dropped. Prometheus scrapes one at a time.
MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 5.0
# the longest a new connection waits for an evicted reader's thread to end (the accept loop
# waits with it; a thread whose socket was shut ends as soon as it is scheduled)
EVICTED_EXIT_S = 1.0

_log = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    metrics: SupervisorMetrics  # set on the per-server subclass
    server: _Server
    timeout = REQUEST_TIMEOUT_S  # on each read of the request (StreamRequestHandler.setup)

    def parse_request(self) -> bool:
        return super().parse_request() and self.server.request_read(self.connection)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, CONTENT_TYPE_LATEST, self.metrics.exposition())
        elif path == "/health":
            health = self.metrics.health()
            body = json.dumps(health.to_dict()).encode()
            self._reply(200 if health.ok else 503, "application/json", body)
        else:
            self._reply(404, "text/plain", b"not found: try /metrics or /health\n")

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.server.served()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the event log

    def log_error(self, format: str, *args: Any) -> None:
        self.server.client_error()  # a timed-out or malformed request: the client's doing


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them: when full, the oldest
    connection still sending its request makes room (a scrape sends it at once), else the
    new one is closed. Client errors are counted, never printed."""

    daemon_threads = True
    request_queue_size = 64  # a burst of connections is accepted and sorted out, not refused

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], max_connections: int
    ) -> None:
        self.max_connections = max_connections
        self._state = threading.Condition()
        self._live: set[Any] = set()  # connections with a thread
        self._reading: dict[Any, None] = {}  # of those, still reading their request; oldest first
        self.accepted = self.rejected = self.evicted = 0
        self.client_errors = self.handler_errors = 0
        self._clients_failing = False
        self._failing = False  # a handler error was logged; the next ones are only counted
        super().__init__(address, handler)

    @property
    def connections(self) -> int:
        with self._state:
            return len(self._live)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate`` (reading this server's counters) holds; False on timeout."""
        with self._state:
            return self._state.wait_for(predicate, timeout)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._state:
            self.accepted += 1
            self._state.notify_all()
            # at twice the cap the rest are evicted readers on their way out (their sockets
            # shut): a moment for one to end, so that a scrape in a flood is answered
            self._state.wait_for(
                lambda: len(self._live) < 2 * self.max_connections, timeout=EVICTED_EXIT_S
            )
            admitted = self._admit(request)
            self._state.notify_all()
        if not admitted:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def _admit(self, request: Any) -> bool:
        # evicted threads are on their way out: 2x the cap bounds them all the same
        if len(self._live) >= self.max_connections:
            if not self._reading or len(self._live) >= 2 * self.max_connections:
                self.rejected += 1
                return False
            oldest = next(iter(self._reading))
            del self._reading[oldest]
            with contextlib.suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)  # its blocked read returns: the thread ends
            self.evicted += 1
        self._live.add(request)
        self._reading[request] = None
        return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: Any) -> None:
        with self._state:
            self._live.discard(request)
            self._reading.pop(request, None)
            self._state.notify_all()

    def request_read(self, request: Any) -> bool:
        """The request is in: no longer evictable. False if it was evicted meanwhile."""
        with self._state:
            return self._reading.pop(request, False) is None

    def served(self) -> None:
        self._failing = self._clients_failing = False

    def client_error(self) -> None:
        with self._state:
            self.client_errors += 1
            first, self._clients_failing = not self._clients_failing, True
            self._state.notify_all()
        if first:  # a flood is one line, not one per connection
            _log.warning(
                "metrics clients went away before their answer (timeouts, resets): counted, "
                "not logged again until a request is served"
            )

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # broken pipe, reset, timeout: the client went away
            self.client_error()
            return
        with self._state:
            self.handler_errors += 1
            first, self._failing = not self._failing, True
            self._state.notify_all()
        if first:  # a bug fails every scrape alike: one line until a scrape succeeds again
            _log.warning("metrics request failed: %r (until one succeeds, not logged again)", error)


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve(
    metrics: SupervisorMetrics,
    host: str,
    port: int,
    *,
    max_connections: int = MAX_CONNECTIONS,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
) -> _Server:
    """Bind and serve in a daemon thread; ConfigError (one line) if the port is taken."""
    fields = {"metrics": metrics, "timeout": request_timeout_s}
    handler = type("MetricsHandler", (_Handler,), fields)
    server_class = _Server6 if ":" in host else _Server
    try:
        server = server_class((host.strip("[]"), port), handler, max_connections)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-port={port} on --metrics-host={host} cannot be served "
            f"({exc.strerror or exc}): pick a free port, or leave --metrics-port out"
        ) from exc
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


class Serving:
    """The metrics server of this process, from ``start`` until ``close`` (a context
    manager); ``metrics`` is None when no port was asked for."""

    def __init__(self, metrics: SupervisorMetrics | None, server: Any = None) -> None:
        self.metrics, self._server = metrics, server
        self._feed = EventFeed(metrics.event) if metrics is not None else None
        if self._feed is not None:
            logging.getLogger().addHandler(self._feed)

    def close(self) -> None:
        if self._feed is not None:
            logging.getLogger().removeHandler(self._feed)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> SupervisorMetrics | None:
        return self.metrics

    def __exit__(self, *_: Any) -> None:
        self.close()


def start(host: str, port: int | None) -> Serving:
    """Bind now (ConfigError if the port is taken) and serve this process's events."""
    if port is None:
        return Serving(None)
    # the *_created series double every counter's lines and no alert uses them
    disable_created_metrics()
    metrics = SupervisorMetrics()
    return Serving(metrics, serve(metrics, host, port))
