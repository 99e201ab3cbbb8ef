"""The metrics' edge: the prometheus registry, the logging feed, HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ConfigError
from elastic_trainer.logging import configure_logging
from elastic_trainer.supervisor import metrics_server as S
from elastic_trainer.supervisor.core import metrics as M
from elastic_trainer.supervisor.core.watchdog import Progress


def _samples(metrics: S.SupervisorMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_declared_metric_is_registered_and_closed_labels_start_at_zero() -> None:
    metrics = S.SupervisorMetrics()
    names = {f.name for f in text_string_to_metric_families(metrics.exposition().decode())}
    for spec in M.METRICS.values():
        family = spec.name.removesuffix("_total") if spec.kind == M.Kind.COUNTER else spec.name
        assert family in names, spec.name
    samples = _samples(metrics)
    assert samples[("elastic_train_restarts_total", (("cause", "hang"),))] == 0


def test_events_and_progress_update_the_registry_and_the_snapshot_age() -> None:
    metrics = S.SupervisorMetrics(clock=lambda: 1000.0)
    assert not any(n == "elastic_train_last_snapshot_age_seconds" for n, _ in _samples(metrics))
    metrics.event({"event": "rendezvous.completed", "world_size": 4})
    metrics.event(
        {"event": "snapshot.saved", "step": 20, "timestamp": 990.0, "stall_ms": 30, "write_ms": 400}
    )
    metrics.attempt_started()
    metrics.progress({0: Progress(step=23, restored_step=20, time=999.0)})
    samples = _samples(metrics)
    assert samples[("elastic_train_world_size", ())] == 4
    assert samples[("elastic_train_last_snapshot_age_seconds", ())] == 10.0
    assert samples[("elastic_train_steps_total", ())] == 3
    assert samples[("elastic_train_snapshot_stall_seconds_count", ())] == 1
    assert samples[("elastic_train_snapshot_write_seconds_sum", ())] == pytest.approx(0.4)
    assert metrics.health().phase == M.Phase.RUNNING


def test_the_supervisors_own_events_reach_the_metrics_through_logging(tmp_path) -> None:
    configure_logging(fmt="json", log_file=str(tmp_path / "log.jsonl"))
    serving = S.Serving(S.SupervisorMetrics())
    try:
        emit("group.restarting", reason="failure", restart_count=1, restarts_left=2, backoff_s=0)
        logging.getLogger("torch.distributed").warning("a foreign %s", "record")
    finally:
        serving.close()
    emit("group.restarting", reason="failure", restart_count=2, restarts_left=1, backoff_s=0)
    assert serving.metrics is not None
    assert _samples(serving.metrics)[("elastic_train_restarts_total", (("cause", "failure"),))] == 1


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_http_serves_metrics_and_health_503_with_the_reason() -> None:
    metrics = S.SupervisorMetrics()
    server = S.serve(metrics, "127.0.0.1", 0)
    port = server.server_address[1]
    try:
        code, body = _get(port, "/metrics")
        assert code == 200 and b"elastic_train_world_size" in body
        assert _get(port, "/health")[0] == 200
        metrics.event({"event": "worker.hung", "rank": 0, "last_step": 5, "stalled_s": 12.0})
        code, body = _get(port, "/health")
        assert code == 503
        assert json.loads(body) == {
            "status": "unhealthy",
            "phase": "hung",
            "reason": "no progress for 12.0s (rank 0, step 5)",
        }
        assert _get(port, "/nope")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_a_taken_port_is_one_line_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^--metrics-port={port} .*pick a free port") as err:
            S.start("127.0.0.1", port)
    assert "\n" not in str(err.value)


def test_no_port_serves_nothing() -> None:
    with S.start("127.0.0.1", None) as metrics:
        assert metrics is None


def test_the_flags_reach_the_config_and_bad_ports_are_one_line() -> None:
    from elastic_trainer.supervisor.cli import args

    cfg = args.parse(["--metrics-port", "9400", "--metrics-host", "::1", "train.py"], env={})
    assert (cfg.metrics_port, cfg.metrics_host) == (9400, "::1")
    assert args.parse(["train.py"], env={}).metrics_port is None
    with pytest.raises(ConfigError, match=r"^--metrics-port=70000 is invalid: use a TCP port"):
        args.parse(["--metrics-port", "70000", "train.py"], env={})


HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: flood\r\n"  # no blank line: never finished


def test_a_flood_of_half_requests_is_bounded_and_a_scrape_still_answers(capfd) -> None:
    server = S.serve(S.SupervisorMetrics(), "127.0.0.1", 0, max_connections=8)
    port = server.server_address[1]
    before = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(100)]
    try:
        for sock in flood:
            sock.sendall(HALF_REQUEST)
        assert server.wait_for(lambda: server.accepted == 100, timeout=30)
        assert threading.active_count() <= before + 2 * 8
        code, body = _get(port, "/metrics")  # while the flood is held
        assert code == 200 and b"elastic_train_world_size" in body
        # the scrape evicted a reader, whose thread may still be on its way out
        assert server.connections <= 2 * 8
        assert server.wait_for(lambda: server.connections <= 8, timeout=10)
    finally:
        for sock in flood:
            sock.close()
    try:
        assert server.wait_for(lambda: server.connections == 0, timeout=30)
        assert server.handler_errors == 0
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_scrape_while_evicted_readers_are_still_on_their_way_out_is_answered() -> None:
    """At twice the cap every connection beyond it is an evicted reader whose thread has not
    ended yet (on a busy machine it may take a moment to be scheduled). A scrape then waits for
    one to end instead of being closed unanswered (CI: a scrape in a flood got no answer)."""
    server = S.serve(S.SupervisorMetrics(), "127.0.0.1", 0, max_connections=2)
    port = server.server_address[1]
    # the cap's two readers still sending their requests, and two evicted threads not yet gone
    pairs = [socket.socketpair() for _ in range(2)]
    readers = [ours for ours, _ in pairs]
    leaving = [object() for _ in range(2)]
    try:
        with server._state:
            server._live.update([*readers, *leaving])
            server._reading.update(dict.fromkeys(readers))
        replies: list = []
        scrape = threading.Thread(target=lambda: replies.append(_get(port, "/metrics")))
        scrape.start()
        assert server.wait_for(lambda: server.accepted == 1, timeout=10)
        server._release(leaving[0])  # one of them ends: room for the scrape
        scrape.join(20)
        assert replies and replies[0][0] == 200
        assert server.rejected == 0
        assert server.evicted == 1  # the oldest reader made room, as in any flood
    finally:
        for gone in [*readers, *leaving]:
            server._release(gone)
        for pair in pairs:
            for end in pair:
                end.close()
        server.shutdown()
        server.server_close()


def test_a_request_not_sent_in_time_is_dropped_and_counted(capfd) -> None:
    server = S.serve(S.SupervisorMetrics(), "127.0.0.1", 0, request_timeout_s=0.2)
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as sock:
            sock.sendall(HALF_REQUEST)
            assert sock.recv(1) == b""  # closed by the server, well before our own timeout
        assert server.wait_for(lambda: server.client_errors == 1, timeout=10)
        assert server.wait_for(lambda: server.connections == 0, timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_handler_bug_is_one_line_per_streak_not_a_traceback(capfd, caplog) -> None:
    metrics = S.SupervisorMetrics()
    server = S.serve(metrics, "127.0.0.1", 0)
    port = server.server_address[1]
    try:
        metrics.exposition = lambda: 1 / 0  # type: ignore[method-assign]
        for _ in range(3):
            with pytest.raises(OSError):  # closed without a reply
                _get(port, "/metrics")
        assert server.wait_for(lambda: server.handler_errors == 3, timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["metrics request failed"]
    assert "Traceback" not in capfd.readouterr().err


def test_clients_that_go_away_are_one_line_per_streak(capfd, caplog) -> None:
    server = S.serve(S.SupervisorMetrics(), "127.0.0.1", 0, request_timeout_s=0.2)
    port = server.server_address[1]
    try:
        for _ in range(3):  # three clients that never finish their request
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(HALF_REQUEST)
                assert sock.recv(1) == b""
        assert server.wait_for(lambda: server.client_errors == 3, timeout=10)
        assert _get(port, "/metrics")[0] == 200  # a served request ends the streak
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(HALF_REQUEST)
            assert sock.recv(1) == b""
        assert server.wait_for(lambda: server.client_errors == 4, timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    went_away = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(went_away) == 2  # one per streak, not one per connection
    assert "Traceback" not in capfd.readouterr().err
