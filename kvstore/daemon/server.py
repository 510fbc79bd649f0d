"""kvstore-server: start the store, serve it over gRPC, stop cleanly.

A thread-pool server was chosen over grpc.aio by measurement (bench/server_model_bench.py,
docs/operations.md): lower Lookup latency, equal streaming bandwidth. The store is
thread-safe (one lock). The servicer itself is kvstore/daemon/servicer.py.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from kvstore import __version__
from kvstore.core.errors import StartupError
from kvstore.daemon.attach import AttachSocket
from kvstore.daemon.auth import server_credentials
from kvstore.daemon.config import Config, ConfigError, add_arguments, config_from_args
from kvstore.daemon.methods import SERVICE_NAME, handlers
from kvstore.daemon.metrics import Metrics, store_metrics
from kvstore.daemon.servicer import KVStoreServicer
from kvstore.daemon.store import Store
from kvstore.memory import keep_freed_buffers

log = logging.getLogger("kvstore.daemon.server")


HEALTH_THREADS = 2  # Check runs on these, never behind the data calls on server.workers


def health_handlers(health_servicer: health.HealthServicer,
                    pool: futures.ThreadPoolExecutor) -> grpc.GenericRpcHandler:
    """grpc.health.v1, with Check on its own threads (grpc's experimental_thread_pool hook
    on a method): a probe is answered however many data calls hold or wait for the
    server's workers. Watch is grpc-health's own, and holds no thread while it waits."""
    def check(request: health_pb2.HealthCheckRequest,
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        response: health_pb2.HealthCheckResponse = health_servicer.Check(request, context)
        return response

    check.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return grpc.method_handlers_generic_handler(health.SERVICE_NAME, {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            health_servicer.Watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
    })


def _set_health(health_servicer: health.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, status)


def _sweep_forever(store: Store, interval_s: float, stop: threading.Event,
                   health_servicer: health.HealthServicer) -> None:
    """Expire leases, reservations and pins. If this ever fails the daemon says so through
    health (NOT_SERVING) and the log; it never dies silently."""
    while not stop.wait(interval_s):
        try:
            leases, reservations, pins = store.sweep()
        except Exception:
            log.exception("lease sweeper failed; marking NOT_SERVING")
            _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
            return
        if leases or reservations or pins:
            log.info("expired %d leases, %d reservations and %d pins (clients.max_pin_s)",
                     leases, reservations, pins)


def serve(config: Config, stop: threading.Event,
          reload: threading.Event | None = None) -> None:
    """Run the daemon until stop is set; re-read the tenants file each time reload is set
    (SIGHUP). Whatever startup made is undone if it fails."""
    store = Store(config)  # its Auth reads the tenants file
    metrics = store_metrics(store)
    drain_began: list[float] = []  # set by _serve once the drain begins
    try:
        _serve(config, store, metrics, stop, reload or threading.Event(), drain_began)
    finally:
        metrics.stop()
        # The L4 write-through queue gets what is left of server.grace_s (5 s at startup).
        left_s = config.server.grace_s - (time.monotonic() - drain_began[0]) if drain_began \
            else 5.0
        store.close(l4_flush_s=max(0.5, left_s))


def _serve(config: Config, store: Store, metrics: Metrics, stop: threading.Event,
           reload: threading.Event, drain_began: list[float]) -> None:
    metrics_port = 0
    if config.metrics.enabled:
        try:
            metrics_port = metrics.start_http(config.metrics.host, config.metrics.port)
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {config.metrics.host}:{config.metrics.port}: {exc} "
                "(metrics.port)"
            ) from exc
    options = [
        ("grpc.max_send_message_length", config.server.max_message_bytes),
        ("grpc.max_receive_message_length", config.server.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    pool = futures.ThreadPoolExecutor(config.server.workers, thread_name_prefix="rpc")
    server = grpc.server(pool, options=options)
    servicer = KVStoreServicer(store, metrics, drain=stop.set)  # Drain: as SIGTERM
    server.add_generic_rpc_handlers((handlers(servicer),))
    health_servicer = health.HealthServicer()
    health_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, thread_name_prefix="health")
    server.add_generic_rpc_handlers((health_handlers(health_servicer, health_pool),))
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{config.server.host}:{config.server.port}"
    credentials = server_credentials(config)
    try:
        port = server.add_secure_port(address, credentials) if credentials else \
            server.add_insecure_port(address)
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {address}: {exc} (server.port)") from exc
    attach = _attach_socket(config, store, servicer)
    server.start()

    def worker_failed(reason: str) -> None:
        log.error("a background worker stopped (%s); health is NOT_SERVING", reason)
        _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)

    store.start(worker_failed)
    if store.remote is not None and config.remote.prewarm_bytes:
        for _ in store.prewarm(config.remote.prewarm_bytes):  # logs its progress
            if stop.is_set():
                break
    _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    sweeper = threading.Thread(
        target=_sweep_forever, name="lease-sweeper", daemon=True,
        args=(store, config.leases.sweep_interval_s, stop, health_servicer),
    )
    sweeper.start()
    reaper_stop = threading.Event()  # the reaper outlives stop: it also ends idle streams
    reaper = threading.Thread(target=servicer.slots.reap_forever, name="stream-reaper",
                              daemon=True, args=(reaper_stop,))  # while the server drains
    reaper.start()
    shm = (store.dram.shm_name or "per-tenant arenas") if store.dram else "off"
    tls = "TLS" if credentials else "plaintext"
    print(f"kvstore-server {__version__} listening on {config.server.host}:{port} "
          f"({tls}, auth {config.auth.mode}, metrics port {metrics_port or 'off'}, L2 shm {shm}"
          f"{', unix socket ' + attach.path if attach else ''}, {store.describe_l3()})",
          flush=True)
    try:
        # Poll, not wait(): the kernel may hand SIGTERM to any thread, and CPython runs the
        # handler only when the main thread runs bytecode again; a wait without a timeout
        # would then never wake, and the daemon would ignore the signal.
        while not stop.wait(0.1):
            if reload.is_set():
                reload.clear()
                store.auth.reload()
    finally:
        stop.set()
        drain_began.append(time.monotonic())
        _drain(config, servicer, health_servicer)
        server.stop(config.server.grace_s - config.server.drain_notice_s).wait()
        reaper_stop.set()
        if attach is not None:
            attach.close()
            servicer.local.close()
        sweeper.join()
        reaper.join()
        pool.shutdown()
        health_pool.shutdown()


def _attach_socket(config: Config, store: Store,
                   servicer: KVStoreServicer) -> AttachSocket | None:
    """The Unix socket (a path set, L2 on): it hands tenants their arenas (auth on) and
    serves co-located clients' local sessions (kvstore.daemon.localpath)."""
    path = config.server.unix_socket
    if not path:
        return None
    if store.dram is None:
        log.warning("server.unix_socket is unused: it serves shared-memory clients, and "
                    "dram.enabled is false")
        return None
    attach = AttachSocket(path, servicer.tickets,
                          store.dram.arena_fds if store.auth.on else None,
                          servicer.local.open)
    attach.start()
    return attach


def _drain(config: Config, servicer: KVStoreServicer,
           health_servicer: health.HealthServicer) -> None:
    """Say so before stopping: health turns NOT_SERVING and new data calls get UNAVAILABLE,
    while the server still answers, for server.drain_notice_s; Kubernetes and clients see a
    draining replica instead of a refused connection. In-flight calls go on meanwhile."""
    notice_s = config.server.drain_notice_s
    log.info("shutting down: NOT_SERVING for %.1fs, then up to %.1fs for calls in flight",
             notice_s, config.server.grace_s - notice_s)
    servicer.draining.set()
    _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    time.sleep(notice_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-server", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_buffers()
    stop = threading.Event()
    reload = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload.set())  # re-read auth.tenants_file
    try:
        serve(config, stop, reload)
    except (StartupError, OSError) as exc:
        print(f"kvstore-server: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
