"""Prometheus metrics of the daemon: per-tier gauges and counters, coalesced loads, RPC latency,
the HTTP exporter.

Everything lives on a CollectorRegistry owned by one Metrics instance (never the process-wide
default), so tests and embedded daemons can hold several. Store figures are not mirrored into
metric objects: a collector asks the store for fresh ones on every scrape (`store_metrics`
wires a store's).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from kvstore.daemon.l3room import REASONS, AdmissionState

if TYPE_CHECKING:
    from kvstore.core.holdings import Holding
    from kvstore.daemon.store import Store

logger = logging.getLogger(__name__)

LOADS_COALESCED = "kvstore_loads_coalesced_total"
L3_ADMISSION_ENABLED = "kvstore_l3_admission_enabled"
L3_ADMISSION_OFF = "kvstore_l3_admission_off"
L3_FREE = "kvstore_l3_filesystem_free_bytes"
L3_RESERVE = "kvstore_l3_filesystem_reserve_bytes"

#: RPC latency buckets in seconds: 50 µs (a shared-memory Lookup) up to 10 s (a large Prefetch).
RPC_LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
#: Buckets of a stream's longest wait on its client, up to past server.stream_idle_s.
STREAM_WAIT_BUCKETS_S = (0.001, 0.01, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TierStatsLike(Protocol):
    """What the collector reads from one tier's stats (read-only, so frozen dataclasses fit)."""

    @property
    def tier(self) -> str: ...  # "dram", "hbm", "nvme", "remote"
    @property
    def enabled(self) -> bool: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def objects(self) -> int: ...
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def bytes_in(self) -> int: ...
    @property
    def bytes_out(self) -> int: ...
    @property
    def evictions(self) -> int: ...
    @property
    def available(self) -> bool: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def promotions(self) -> int: ...
    @property
    def demotions(self) -> int: ...
    @property
    def admissions_refused(self) -> int: ...
    @property
    def checksum_failures(self) -> int: ...
    @property
    def io_errors(self) -> int: ...
    @property
    def read_seconds(self) -> float: ...
    @property
    def write_seconds(self) -> float: ...


# (metric name, help, attribute of TierStatsLike)
_TIER_GAUGES = (
    ("kvstore_tier_enabled", "1 if the tier is enabled, else 0.", "enabled"),
    ("kvstore_tier_available", "1 if enabled and reachable (L4: Redis up), else 0.",
     "available"),
    ("kvstore_tier_capacity_bytes", "Bytes the tier can hold.", "capacity_bytes"),
    ("kvstore_tier_used_bytes", "Bytes the tier holds now.", "used_bytes"),
    ("kvstore_tier_objects", "Blocks the tier holds now.", "objects"),
    ("kvstore_tier_queue_depth", "Transfers in flight to or from the tier now.", "queue_depth"),
)
_TIER_COUNTERS = (
    ("kvstore_tier_hits_total", "Reads served by the tier.", "hits"),
    ("kvstore_tier_misses_total", "Reads the tier could not serve.", "misses"),
    ("kvstore_tier_bytes_in_total", "Bytes written into the tier.", "bytes_in"),
    ("kvstore_tier_bytes_out_total", "Bytes read out of the tier.", "bytes_out"),
    ("kvstore_tier_evictions_total", "Blocks evicted from the tier (gone from it, not moved).",
     "evictions"),
    ("kvstore_tier_promotions_total", "Blocks copied up into the tier from a slower one.",
     "promotions"),
    ("kvstore_tier_demotions_total", "Blocks moved down out of the tier under pressure.",
     "demotions"),
    ("kvstore_tier_admissions_refused_total",
     "Blocks not admitted (admission policy, no room, write error).", "admissions_refused"),
    ("kvstore_tier_checksum_failures_total", "Blocks read back damaged; dropped, a miss.",
     "checksum_failures"),
    ("kvstore_tier_io_errors_total", "Reads or writes of the tier that failed.", "io_errors"),
    ("kvstore_tier_read_seconds_total",
     "Wall time the tier was busy reading; rate(bytes_out) / rate(this) = read bandwidth.",
     "read_seconds"),
    ("kvstore_tier_write_seconds_total", "Wall time the tier was busy writing.",
     "write_seconds"),
)


class _TierCollector(Collector):
    """Asks stats_fn on each scrape; a failing stats_fn costs the tier metrics, not the scrape."""

    def __init__(self, stats_fn: Callable[[], Sequence[TierStatsLike]]) -> None:
        self._stats_fn = stats_fn
        self._failures = 0  # scrapes whose stats_fn raised; exported so alerts can see it
        self._failures_lock = threading.Lock()  # the exporter serves scrapes on many threads

    def _failures_family(self) -> Metric:
        family = CounterMetricFamily(
            "kvstore_metrics_stats_errors_total",
            "Scrapes whose tier stats could not be read (see the daemon log).",
        )
        family.add_metric([], float(self._failures))
        return family

    def describe(self) -> Iterator[Metric]:
        # Names only, so the registry can refuse duplicates without calling stats_fn.
        for name, doc, _ in _TIER_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["tier"])
        for name, doc, _ in _TIER_COUNTERS:
            yield CounterMetricFamily(name, doc, labels=["tier"])
        yield self._failures_family()

    def collect(self) -> Iterator[Metric]:
        try:
            families = self._families(list(self._stats_fn()))
        except Exception:
            logger.exception("tier stats failed; this scrape has no kvstore_tier_* metrics")
            with self._failures_lock:
                self._failures += 1
            yield self._failures_family()
            return
        yield from families
        yield self._failures_family()

    @staticmethod
    def _families(stats: Sequence[TierStatsLike]) -> list[Metric]:
        families: list[Metric] = []
        kinds = ((GaugeMetricFamily, _TIER_GAUGES), (CounterMetricFamily, _TIER_COUNTERS))
        for kind, table in kinds:
            for name, doc, attr in table:
                family = kind(name, doc, labels=["tier"])
                for tier in stats:
                    family.add_metric([tier.tier], float(getattr(tier, attr)))
                families.append(family)
        return families


class _CountCollector(Collector):
    """One counter without labels, read from count_fn on each scrape."""

    def __init__(self, name: str, doc: str, count_fn: Callable[[], int]) -> None:
        self._name, self._doc, self._count_fn = name, doc, count_fn

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._doc)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._doc)
        family.add_metric([], float(self._count_fn()))
        yield family


#: (metric name, help, attribute of kvstore.core.holdings.Holding)
_CLIENT_GAUGES = (
    ("kvstore_client_leases", "Read leases the client holds (cap: clients.max_leases).",
     "leases"),
    ("kvstore_client_reservations", "Reservations and Puts in flight of the client "
     "(cap: clients.max_reservations).", "reservations"),
    ("kvstore_client_reserved_bytes", "Their bytes (cap: clients.max_reserved_share of L2).",
     "reserved_bytes"),
    ("kvstore_client_pins", "Blocks the client pinned (each ends after clients.max_pin_s).",
     "pins"),
    ("kvstore_client_pinned_bytes", "Their bytes (cap: clients.max_pinned_share of L2).",
     "pinned_bytes"),
)


class _HoldingsCollector(Collector):
    """What each client holds, by client ("" = the daemon's own work), read on each scrape;
    a client that holds nothing has no series."""

    def __init__(self, holdings_fn: Callable[[], Mapping[str, Holding]]) -> None:
        self._holdings_fn = holdings_fn

    def describe(self) -> Iterator[Metric]:
        for name, doc, _ in _CLIENT_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["client"])

    def collect(self) -> Iterator[Metric]:
        held = self._holdings_fn()
        for name, doc, attr in _CLIENT_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["client"])
            for client, holding in held.items():
                family.add_metric([client], float(getattr(holding, attr)))
            yield family


class _L3AdmissionCollector(Collector):
    """Whether L3 takes new blocks and why not, and the room on its filesystem, read from
    state_fn on each scrape; nothing while state_fn says None (no L3)."""

    _DOCS = {
        L3_ADMISSION_ENABLED: "1 while new blocks may go into L3; 0 while its filesystem is "
        "short of room (kvstore_l3_admission_off says why).",
        L3_ADMISSION_OFF: "1 for the reason L3 admission is off: low_space (free space under "
        "the reserve) or no_room (an L3 write found no space); else 0.",
        L3_FREE: "Bytes free on the L3 filesystem at the mover's last check (about every "
        "second).",
        L3_RESERVE: "Bytes the daemon leaves free on the L3 filesystem; L3 admission goes "
        "off below it.",
    }

    def __init__(self, state_fn: Callable[[], AdmissionState | None]) -> None:
        self._state_fn = state_fn

    def describe(self) -> Iterator[Metric]:
        for name, doc in self._DOCS.items():
            yield GaugeMetricFamily(name, doc, labels=["reason"] if name == L3_ADMISSION_OFF
                                    else None)

    def collect(self) -> Iterator[Metric]:
        state = self._state_fn()
        if state is None:
            return
        docs = self._DOCS
        yield GaugeMetricFamily(L3_ADMISSION_ENABLED, docs[L3_ADMISSION_ENABLED],
                                value=float(state.enabled))
        off = GaugeMetricFamily(L3_ADMISSION_OFF, docs[L3_ADMISSION_OFF], labels=["reason"])
        for reason in REASONS:
            off.add_metric([reason], float(state.reason == reason))
        yield off
        yield GaugeMetricFamily(L3_FREE, docs[L3_FREE], value=float(max(state.free_bytes, 0)))
        yield GaugeMetricFamily(L3_RESERVE, docs[L3_RESERVE], value=float(state.reserve_bytes))


class Metrics:
    """The daemon's metrics registry and its optional HTTP exporter; with loads_coalesced_fn,
    also the count of loads joined instead of started, with holdings_fn what each client
    holds, and with l3_admission_fn whether L3 takes new blocks."""

    def __init__(self, stats_fn: Callable[[], Sequence[TierStatsLike]],
                 loads_coalesced_fn: Callable[[], int] | None = None,
                 holdings_fn: Callable[[], Mapping[str, Holding]] | None = None,
                 l3_admission_fn: Callable[[], AdmissionState | None] | None = None) -> None:
        self.registry = CollectorRegistry()
        self._rpc_latency = Histogram(
            "kvstore_rpc_latency_seconds",
            "Server-side RPC latency by method and gRPC status code.",
            labelnames=("method", "code"),
            buckets=RPC_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._stream_wait = Histogram(
            "kvstore_stream_longest_wait_seconds",
            "Per finished streaming call: the longest it waited on its client for the next "
            "message or to take one (server.stream_idle_s aborts past it).",
            labelnames=("method",),
            buckets=STREAM_WAIT_BUCKETS_S,
            registry=self.registry,
        )
        self._streams_aborted_idle = Counter(
            "kvstore_streams_aborted_idle",
            "Streaming calls aborted because their client sent or took nothing for "
            "server.stream_idle_s.",
            labelnames=("method",),
            registry=self.registry,
        )
        self._local_requests = Counter(
            "kvstore_local_requests",
            "Requests served on local sessions (the hot verbs on the Unix socket, "
            "kvstore.daemon.localpath), by method; also counted in kvstore_rpc_latency_seconds.",
            labelnames=("method",),
            registry=self.registry,
        )
        self.local_sessions = Gauge(
            "kvstore_local_sessions", "Local sessions open on the Unix socket.",
            registry=self.registry,
        )
        self.registry.register(_TierCollector(stats_fn))
        if loads_coalesced_fn is not None:
            self.registry.register(_CountCollector(
                LOADS_COALESCED, "Loads of a block (L3 -> L2, L2 -> L1) that a reader joined "
                "instead of starting another: concurrent readers share one read.",
                loads_coalesced_fn))
        if holdings_fn is not None:
            self.registry.register(_HoldingsCollector(holdings_fn))
        if l3_admission_fn is not None:
            self.registry.register(_L3AdmissionCollector(l3_admission_fn))
        self._lock = threading.Lock()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def observe_rpc(self, method: str, code: str, latency_s: float) -> None:
        """Record one finished RPC, e.g. observe_rpc("Get", "OK", 0.0003)."""
        self._rpc_latency.labels(method=method, code=code).observe(latency_s)

    def observe_local(self, method: str, code: str, latency_s: float) -> None:
        """Record one request of a local session (as an RPC, and as a local one)."""
        self.observe_rpc(method, code, latency_s)
        self._local_requests.labels(method=method).inc()

    def observe_stream(self, method: str, longest_wait_s: float, aborted_idle: bool) -> None:
        """Record one finished streaming call: its longest wait on its client, and whether
        the idle reaper ended it."""
        self._stream_wait.labels(method=method).observe(longest_wait_s)
        if aborted_idle:
            self._streams_aborted_idle.labels(method=method).inc()

    def render(self) -> bytes:
        """The text exposition of everything, as an HTTP scrape would return it."""
        return generate_latest(self.registry)

    def start_http(self, host: str, port: int) -> int:
        """Serve /metrics on host:port in a daemon thread; return the bound port (port 0 = any)."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"metrics exporter already serving on port {self.port}")
            started = start_http_server(port, addr=host, registry=self.registry)
            if started is None:  # prometheus_client < 0.21 returned nothing to stop it with
                raise RuntimeError("prometheus_client >= 0.21 is needed to run the exporter")
            server, thread = started
            self._server, self._thread = server, thread
            self.port = int(server.server_port)
            logger.info("metrics exporter listening on %s:%d", host, self.port)
            return self.port

    def stop(self) -> None:
        """Stop the exporter and free its port; a no-op when it is not running."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
            self.port = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)


def store_metrics(store: Store) -> Metrics:
    """The metrics of a store: its tier stats, its coalesced loads, what each client holds
    and its L3 admission, read on each scrape."""
    gate = store.tiering.l3_admission
    return Metrics(lambda: store.stats().tiers, lambda: store.tiering.loads_coalesced,
                   store.holdings, lambda: gate.state if gate.folder is not None else None)
