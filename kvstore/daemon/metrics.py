"""Prometheus metrics of the daemon: the registry, RPC latency and streams, the local path's
sessions, health, build info, and the HTTP exporter.

The exporter answers two paths and refuses every other one with 404, so a scraper or a probe
pointed at a wrong path fails loudly instead of reading a 200:

    GET /metrics   the Prometheus text exposition
    GET /healthz   200 "SERVING" while the daemon's health is SERVING; 503 "NOT_SERVING" while
                   it is not (starting or pre-warming, draining, or a background worker
                   stopped): the same answer as grpc.health.v1 for the whole server, over
                   plain HTTP (for probes and load balancers that cannot speak gRPC or TLS)

Everything lives on a CollectorRegistry owned by one Metrics instance (never the process-wide
default), so tests and embedded daemons can hold several. The store's figures are read on each
scrape by the collectors of kvstore.daemon.collectors, which `watch_store` registers once the
store is open (the daemon binds its ports, this exporter's included, before it opens the store).
Every metric is listed in docs/operations.md.
"""

from __future__ import annotations

import logging
import platform
import socket
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

from kvstore import __version__
from kvstore.daemon.collectors import (
    LOADS_COALESCED,
    CountCollector,
    HoldingsCollector,
    L3AdmissionCollector,
    StoreCollector,
    TierCollector,
)

if TYPE_CHECKING:
    from kvstore.daemon.store import Store

logger = logging.getLogger(__name__)
# No `<counter>_created` series: they would show up as gauge families of their own, and
# Prometheus derives a counter's resets without them.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: RPC latency buckets in seconds: 50 µs (a shared-memory Lookup) up to 10 s (a large Prefetch).
RPC_LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
#: Buckets of a stream's longest wait on its client, up to past server.stream_idle_s.
STREAM_WAIT_BUCKETS_S = (0.001, 0.01, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: The exporter's paths (module docstring); every other path is 404.
METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"

_StartResponse = Callable[..., Any]
_Environ = dict[str, Any]


class _QuietHandler(WSGIRequestHandler):
    """No access log line per request: Prometheus scrapes and kubelet probes every few
    seconds would drown the daemon's own log."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        return


def _text(start_response: _StartResponse, status: str, body: str) -> list[bytes]:
    """A plain-text answer of one line."""
    data = f"{body}\n".encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(data)))])
    return [data]


class Metrics:
    """The daemon's metrics registry and its optional HTTP exporter."""

    def __init__(self) -> None:
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
        Info("kvstore_build", "The daemon's version and what it runs on (value 1).",
             registry=self.registry).info({
                 "version": __version__, "python": platform.python_version(),
                 "grpc": grpc.__version__})
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, fds
        self._serving = Gauge(
            "kvstore_serving", "1 while the daemon's health is SERVING; 0 while it is "
            "NOT_SERVING (starting, draining, or a background worker stopped).",
            registry=self.registry,
        )
        self.serving = False  # what /healthz answers; set_serving keeps it
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
        """Serve /metrics and /healthz on host:port in a daemon thread; return the bound port
        (port 0 = any). An address in use raises OSError, as bind does."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"metrics exporter already serving on port {self.port}")
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            server_class = type("MetricsServer", (ThreadingWSGIServer,),
                                {"address_family": family})
            server: WSGIServer = make_server(host, port, self.wsgi_app(), server_class,
                                             _QuietHandler)
            thread = threading.Thread(target=server.serve_forever, name="metrics-http",
                                      daemon=True)
            thread.start()
            self._server, self._thread = server, thread
            self.port = int(server.server_port)
            logger.info("metrics exporter listening on %s:%d (%s, %s)", host, self.port,
                        METRICS_PATH, HEALTH_PATH)
            return self.port

    def wsgi_app(self) -> Callable[[_Environ, _StartResponse], Iterable[bytes]]:
        """The exporter as a WSGI application: /metrics, /healthz, 404 elsewhere."""
        exposition = make_wsgi_app(self.registry)

        def app(environ: _Environ, start_response: _StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == METRICS_PATH:
                return exposition(environ, start_response)  # type: ignore[no-any-return]
            if path != HEALTH_PATH:
                return _text(start_response, "404 Not Found", f"no such path {path!r}: the "
                             f"exporter serves {METRICS_PATH} and {HEALTH_PATH}")
            if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
                return _text(start_response, "405 Method Not Allowed", f"{HEALTH_PATH} "
                             "answers GET")
            if self.serving:
                return _text(start_response, "200 OK", "SERVING")
            return _text(start_response, "503 Service Unavailable", "NOT_SERVING")

        return app

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

    def set_serving(self, serving: bool) -> None:
        """What the daemon's health says now (kvstore_serving, and /healthz)."""
        self.serving = serving
        self._serving.set(float(serving))

    def watch_store(self, store: Store) -> None:
        """Export store's figures from now on: its tier stats, its coalesced loads, what each
        client holds and its L3 admission, read on each scrape. Called once the store is
        open; the exporter may already be serving (the daemon binds its ports first)."""
        gate = store.tiering.l3_admission
        for collector in (
            TierCollector(lambda: store.stats().tiers),
            CountCollector(LOADS_COALESCED, "Loads of a block (L3 -> L2, L2 -> L1) that a "
                           "reader joined instead of starting another: concurrent readers "
                           "share one read.", lambda: store.tiering.loads_coalesced),
            HoldingsCollector(store.holdings),
            L3AdmissionCollector(lambda: gate.state if gate.folder is not None else None),
            StoreCollector(store),
        ):
            self.registry.register(collector)
