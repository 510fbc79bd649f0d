"""The Prometheus exporter: tier stats per scrape, RPC latency, a failing stats source."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest

from kvstore.daemon.collectors import LOADS_COALESCED, CountCollector, TierCollector, TierStatsLike
from kvstore.daemon.metrics import Metrics


def _metrics(stats_fn: Callable[[], Sequence[TierStatsLike]],
             coalesced_fn: Callable[[], int] | None = None) -> Metrics:
    """Metrics over fake tier stats (and a coalesced-loads count), as watch_store wires a
    store's."""
    metrics = Metrics()
    metrics.registry.register(TierCollector(stats_fn))
    if coalesced_fn is not None:
        metrics.registry.register(CountCollector(LOADS_COALESCED, "loads", coalesced_fn))
    return metrics


@dataclass(frozen=True)
class _Stats:
    tier: str
    enabled: bool = True
    capacity_bytes: int = 1 << 30
    used_bytes: int = 4096
    objects: int = 2
    hits: int = 7
    misses: int = 3
    bytes_in: int = 8192
    bytes_out: int = 16384
    evictions: int = 1
    queue_depth: int = 2
    promotions: int = 4
    demotions: int = 5
    admissions_refused: int = 6
    checksum_failures: int = 8
    io_errors: int = 9
    read_seconds: float = 0.5
    write_seconds: float = 0.25
    available: bool = True


Served = tuple[Metrics, list[Sequence[TierStatsLike]]]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


@pytest.fixture
def served() -> Iterator[Served]:
    # The collector reads whatever the list's last element is at scrape time.
    current: list[Sequence[TierStatsLike]] = [[_Stats("dram"), _Stats("nvme", enabled=False)]]
    metrics = _metrics(lambda: current[-1])
    metrics.start_http("127.0.0.1", 0)
    yield metrics, current
    metrics.stop()


def test_start_http_on_port_zero_returns_the_bound_port(served: Served) -> None:
    metrics, _ = served
    assert metrics.port is not None and metrics.port > 0


def test_scrape_has_tier_metrics(served: Served) -> None:
    metrics, _ = served
    assert metrics.port is not None
    text = _scrape(metrics.port)
    assert 'kvstore_tier_capacity_bytes{tier="dram"} 1.073741824e+09' in text
    assert 'kvstore_tier_used_bytes{tier="dram"} 4096.0' in text
    assert 'kvstore_tier_objects{tier="dram"} 2.0' in text
    assert 'kvstore_tier_hits_total{tier="dram"} 7.0' in text
    assert 'kvstore_tier_misses_total{tier="dram"} 3.0' in text
    assert 'kvstore_tier_bytes_in_total{tier="dram"} 8192.0' in text
    assert 'kvstore_tier_bytes_out_total{tier="dram"} 16384.0' in text
    assert 'kvstore_tier_evictions_total{tier="dram"} 1.0' in text
    assert 'kvstore_tier_queue_depth{tier="dram"} 2.0' in text
    assert 'kvstore_tier_available{tier="dram"} 1.0' in text
    assert 'kvstore_tier_promotions_total{tier="dram"} 4.0' in text
    assert 'kvstore_tier_demotions_total{tier="dram"} 5.0' in text
    assert 'kvstore_tier_admissions_refused_total{tier="dram"} 6.0' in text
    assert 'kvstore_tier_checksum_failures_total{tier="dram"} 8.0' in text
    assert 'kvstore_tier_io_errors_total{tier="dram"} 9.0' in text
    assert 'kvstore_tier_read_seconds_total{tier="dram"} 0.5' in text
    assert 'kvstore_tier_write_seconds_total{tier="dram"} 0.25' in text
    assert 'kvstore_tier_enabled{tier="nvme"} 0.0' in text
    assert "# TYPE kvstore_tier_hits_total counter" in text
    assert "# TYPE kvstore_tier_used_bytes gauge" in text


def test_each_scrape_reads_fresh_stats(served: Served) -> None:
    metrics, current = served
    assert metrics.port is not None
    current.append([_Stats("dram", hits=100)])
    text = _scrape(metrics.port)
    assert 'kvstore_tier_hits_total{tier="dram"} 100.0' in text
    assert 'tier="nvme"' not in text


def test_observe_rpc_shows_in_histogram(served: Served) -> None:
    metrics, _ = served
    assert metrics.port is not None
    metrics.observe_rpc("Get", "OK", 0.0003)
    metrics.observe_rpc("Get", "OK", 0.002)
    metrics.observe_rpc("Put", "RESOURCE_EXHAUSTED", 20.0)
    text = _scrape(metrics.port)
    assert 'kvstore_rpc_latency_seconds_count{code="OK",method="Get"} 2.0' in text
    assert 'kvstore_rpc_latency_seconds_bucket{code="OK",le="5e-05",method="Get"} 0.0' in text
    assert 'kvstore_rpc_latency_seconds_bucket{code="OK",le="0.0005",method="Get"} 1.0' in text
    assert 'kvstore_rpc_latency_seconds_bucket{code="OK",le="10.0",method="Get"} 2.0' in text
    assert (
        'kvstore_rpc_latency_seconds_bucket{code="RESOURCE_EXHAUSTED",le="10.0",method="Put"} 0.0'
        in text
    )
    assert 'kvstore_rpc_latency_seconds_sum{code="RESOURCE_EXHAUSTED",method="Put"} 20.0' in text


def test_failing_stats_fn_is_logged_and_the_scrape_still_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> Sequence[TierStatsLike]:
        raise RuntimeError("index lock poisoned")

    metrics = _metrics(broken)
    port = metrics.start_http("127.0.0.1", 0)
    try:
        metrics.observe_rpc("Lookup", "OK", 0.001)
        with caplog.at_level(logging.ERROR, logger="kvstore.daemon.collectors"):
            text = _scrape(port)
        assert 'kvstore_rpc_latency_seconds_count{code="OK",method="Lookup"} 1.0' in text
        assert "kvstore_tier_used_bytes{" not in text
        assert "kvstore_metrics_stats_errors_total 1.0" in text
        assert any("index lock poisoned" in (r.exc_text or "") for r in caplog.records)
    finally:
        metrics.stop()


def test_coalesced_loads_are_a_counter_read_on_each_scrape() -> None:
    coalesced = [3]
    metrics = _metrics(lambda: [_Stats("dram")], lambda: coalesced[-1])
    text = metrics.render().decode()
    assert "# TYPE kvstore_loads_coalesced_total counter" in text
    assert "kvstore_loads_coalesced_total 3.0" in text
    coalesced.append(5)
    assert b"kvstore_loads_coalesced_total 5.0" in metrics.render()
    assert b"kvstore_loads_coalesced" not in _metrics(lambda: []).render()  # not given: absent


def test_registries_are_independent() -> None:
    a, b = _metrics(lambda: [_Stats("dram")]), _metrics(lambda: [])
    a.observe_rpc("Get", "OK", 0.01)
    assert b'method="Get"' in a.render()
    assert b'method="Get"' not in b.render()
    assert b"kvstore_tier_objects{" not in b.render()


def test_stop_frees_the_port_and_is_idempotent() -> None:
    metrics = Metrics()
    port = metrics.start_http("127.0.0.1", 0)
    with pytest.raises(RuntimeError, match="already serving"):
        metrics.start_http("127.0.0.1", 0)
    metrics.stop()
    metrics.stop()
    assert metrics.port is None
    with pytest.raises(OSError):
        _scrape(port)
    # and it can serve again after a stop
    assert metrics.start_http("127.0.0.1", 0) > 0
    metrics.stop()


def _get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    """The status and body of one request to the exporter (an HTTP error's too)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_healthz_follows_set_serving_and_starts_not_serving(served: Served) -> None:
    """Before the daemon says SERVING (starting, pre-warming) /healthz is 503; SERVING makes
    it 200, and NOT_SERVING again (a drain, a stopped worker) makes it 503 again."""
    metrics, _ = served
    assert metrics.port is not None
    assert _get(metrics.port, "/healthz") == (503, "NOT_SERVING\n")
    metrics.set_serving(True)
    assert _get(metrics.port, "/healthz") == (200, "SERVING\n")
    metrics.set_serving(False)
    assert _get(metrics.port, "/healthz") == (503, "NOT_SERVING\n")


@pytest.mark.parametrize("path", ["/", "/metric", "/metrics/x", "/favicon.ico", "/health"])
def test_other_paths_are_404_naming_the_two_served(served: Served, path: str) -> None:
    """Only /metrics and /healthz answer: a probe or a scraper pointed at a wrong path fails
    instead of reading a 200 (prometheus_client's own exporter answers 200 on every path)."""
    metrics, _ = served
    assert metrics.port is not None
    status, body = _get(metrics.port, path)
    assert status == 404
    assert body == f"no such path {path!r}: the exporter serves /metrics and /healthz\n"


def test_healthz_refuses_other_methods(served: Served) -> None:
    metrics, _ = served
    assert metrics.port is not None
    assert _get(metrics.port, "/healthz", "POST") == (405, "/healthz answers GET\n")
