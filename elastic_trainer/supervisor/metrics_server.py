"""The edge of the metrics: a ``prometheus_client`` registry fed with ``metrics.Change``
values, and a small HTTP server for ``/metrics`` (Prometheus text) and ``/health`` (JSON).

The registry is our own, never the process-wide default: nothing another library registers
shows up, and tests build as many as they like. The supervisor's own events reach it through
a logging handler (``EventFeed``), its workers' through the control directory
(``observer.py``); both end in ``SupervisorMetrics.event``.
"""

from __future__ import annotations

import json
import logging
import socket
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
from elastic_trainer.supervisor import metrics as M


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
class _Handler(BaseHTTPRequestHandler):
    metrics: SupervisorMetrics  # set on the per-server subclass

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

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the event log


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve(metrics: SupervisorMetrics, host: str, port: int) -> ThreadingHTTPServer:
    """Bind and serve in a daemon thread; ConfigError (one line) if the port is taken."""
    handler = type("MetricsHandler", (_Handler,), {"metrics": metrics})
    server_class = _Server6 if ":" in host else _Server
    try:
        server = server_class((host.strip("[]"), port), handler)
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
