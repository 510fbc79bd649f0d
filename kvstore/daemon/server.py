"""kvstore-server: bind its ports, open the store, serve it over gRPC, stop cleanly.

Start-up binds the gRPC port first, then the metrics port, and only then opens the store
(shared memory, the L3 file, Redis): a port that is taken stops the start at once, with one
line naming server.port or metrics.port, before anything is made on disk or in /dev/shm.
Whatever start-up made is undone if it fails, the ports included.

A thread-pool server was chosen over grpc.aio by measurement (bench/server_model_bench.py,
docs/operations.md): lower Lookup latency, equal streaming bandwidth. The store is
thread-safe (one lock). The servicer itself is kvstore/daemon/servicer.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from kvstore import __version__
from kvstore.core.errors import StartupError, Unavailable
from kvstore.daemon.attach import AttachSocket
from kvstore.daemon.auth import server_credentials
from kvstore.daemon.config import Config, ConfigError, add_arguments, config_from_args
from kvstore.daemon.datasocket import DataSocket, bind_data_port
from kvstore.daemon.methods import SERVICE_NAME, handlers
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.reflection import Reflection, commented_files
from kvstore.daemon.servicer import KVStoreServicer
from kvstore.daemon.store import Store
from kvstore.memory import keep_freed_buffers
from kvstore.units import format_size

log = logging.getLogger("kvstore.daemon.server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
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


def _set_health(health_servicer: health.HealthServicer, metrics: Metrics, status: int) -> None:
    """Health for every service name, mirrored in kvstore_serving."""
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, status)
    metrics.set_serving(status == SERVING)


# --- the ports, bound before the store is opened ---------------------------------------------

_BUSY = (errno.EADDRINUSE, errno.EACCES)  # the port's fault; other errors are the host's


def _port_error(setting: str, flag: str, host: str, port: int, what: str,
                exc: OSError) -> StartupError:
    """One line naming the setting to change: the port when it is taken (or privileged), the
    host when it is not an address of this machine."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, socket.gaierror) or exc.errno not in _BUSY:
        host_setting = setting.replace(".port", ".host")
        return StartupError(f"{host_setting} {host!r}: cannot {what} on {host}:{port}: "
                            f"{reason}; use an address of this host, e.g. 127.0.0.1 or 0.0.0.0")
    hint = ("ports below 1024 need privileges" if exc.errno == errno.EACCES
            else "another process listens there")
    return StartupError(f"{setting} {port}: cannot {what} on {host}:{port}: {reason} ({hint}); "
                        f"stop it or choose another port ({flag}, or 0 for any free port)")


def check_port(host: str, port: int) -> None:
    """Raise OSError (socket.gaierror for a host that does not resolve) unless host:port can
    be bound the way grpc binds it (SO_REUSEADDR, no SO_REUSEPORT; the start succeeds if one
    resolved address binds). Checked before grpc tries, because grpc's own failure is a
    C-core log line on stderr and a message without the reason."""
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    failure: OSError | None = None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # grpc listens dual-stack on [::]
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind(address)
                return
            except OSError as exc:
                if failure is None or exc.errno == errno.EADDRINUSE:
                    failure = exc
    raise failure or OSError(errno.EADDRNOTAVAIL, f"{host} resolves to no address")


@dataclass
class Listener:
    """The gRPC server with its port bound and its health and reflection services, not yet
    started: the KVStore service is added once the store is open."""

    server: grpc.Server
    pool: futures.ThreadPoolExecutor
    health_servicer: health.HealthServicer
    health_pool: futures.ThreadPoolExecutor
    port: int
    tls: bool
    started: bool = False

    def start(self) -> None:
        self.server.start()
        self.started = True

    def close(self) -> None:
        """Stop the server and free its port; again is a no-op. grpc frees the port of a
        server that never started only once it is started and stopped (a call that arrives
        in between is cancelled: no grace)."""
        if not self.started:
            self.start()
        self.server.stop(None).wait()
        self.pool.shutdown()
        self.health_pool.shutdown()


def bind_grpc(config: Config) -> Listener:
    """The gRPC server bound to server.host:server.port; StartupError naming the setting if
    it cannot be."""
    host, want = config.server.host, config.server.port
    try:
        check_port(host, want)
    except OSError as exc:
        raise _port_error("server.port", "--port", host, want, "listen", exc) from None
    credentials = server_credentials(config)  # reads the TLS files: before anything is made
    options = [
        ("grpc.max_send_message_length", config.server.max_message_bytes),
        ("grpc.max_receive_message_length", config.server.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    pool = futures.ThreadPoolExecutor(config.server.workers, thread_name_prefix="rpc")
    server = grpc.server(pool, options=options)
    health_servicer = health.HealthServicer()
    health_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, thread_name_prefix="health")
    server.add_generic_rpc_handlers((health_handlers(health_servicer, health_pool),))
    server.add_generic_rpc_handlers(Reflection(commented_files()).handlers())
    address = f"{host}:{want}"
    try:
        port = server.add_secure_port(address, credentials) if credentials else \
            server.add_insecure_port(address)
    except RuntimeError as exc:  # taken since check_port: grpc logged why
        pool.shutdown()
        health_pool.shutdown()
        raise StartupError(f"server.port {want}: cannot listen on {address}: {exc}; choose "
                           "another port (--port, or 0 for any free port)") from exc
    return Listener(server, pool, health_servicer, health_pool, port, credentials is not None)


def start_metrics(config: Config, metrics: Metrics) -> int:
    """The exporter on metrics.host:metrics.port (0 when metrics are off): its bound port."""
    m = config.metrics
    if not m.enabled:
        return 0
    try:
        return metrics.start_http(m.host, m.port)
    except OSError as exc:
        raise _port_error("metrics.port", "--metrics-port", m.host, m.port, "serve metrics",
                          exc) from None


# --- serving ---------------------------------------------------------------------------------


def _sweep_forever(store: Store, interval_s: float, stop: threading.Event,
                   set_health: Callable[[int], None]) -> None:
    """Expire leases, reservations and pins. If this ever fails the daemon says so through
    health (NOT_SERVING) and the log; it never dies silently."""
    while not stop.wait(interval_s):
        try:
            leases, reservations, pins = store.sweep()
        except Exception:
            log.exception("lease sweeper failed; marking NOT_SERVING")
            set_health(NOT_SERVING)
            return
        if leases or reservations or pins:
            log.info("expired %d leases, %d reservations and %d pins (clients.max_pin_s)",
                     leases, reservations, pins)


def _prewarm(store: Store, target_bytes: int, stop: threading.Event) -> None:
    """Pull target_bytes (remote.prewarm_bytes) of L4's hottest blocks in before the daemon
    turns SERVING; with L4 down the daemon serves cold instead of not at all."""
    try:
        for _ in store.prewarm(target_bytes):  # logs its progress
            if stop.is_set():
                return
    except Unavailable as exc:
        log.warning("pre-warm skipped, serving cold: %s", exc)


def serve(config: Config, stop: threading.Event,
          reload: threading.Event | None = None) -> None:
    """Run the daemon until stop is set; re-read the tenants file each time reload is set
    (SIGHUP). Binds the gRPC port, then the metrics port, then opens the store; whatever
    start-up made is undone if it fails, and everything when the daemon stops."""
    drain_began: list[float] = []  # set by _serve once the drain begins
    with ExitStack() as undo:
        listener = bind_grpc(config)
        undo.callback(listener.close)
        config = resolved(config, listener.port)
        metrics = Metrics()
        undo.callback(metrics.stop)
        metrics_port = start_metrics(config, metrics)
        data_sock = bind_data_port(config)  # server.data_port: -1 = none
        if data_sock is not None:
            undo.callback(data_sock.close)
            server = dataclasses.replace(config.server, data_port=data_sock.getsockname()[1])
            config = dataclasses.replace(config, server=server)
        store = Store(config)  # shared memory, the L3 file, Redis; its Auth reads the tenants

        def close_store() -> None:
            listener.close()  # no call and no scrape reaches a closing store
            metrics.stop()
            # The L4 write-through queue gets what is left of server.grace_s (5 s at startup).
            left_s = config.server.grace_s - (time.monotonic() - drain_began[0]) \
                if drain_began else 5.0
            store.close(l4_flush_s=max(0.5, left_s))

        undo.callback(close_store)
        metrics.watch_store(store)
        _serve(config, listener, store, metrics, metrics_port, stop,
               reload or threading.Event(), drain_began, data_sock)


# --- what the settings leave to the daemon: the port it got, the Unix socket ---------------

#: server.unix_socket's value that asks for no socket even with auth on.
NO_SOCKET = "off"
#: The longest path a Unix socket may have (sun_path is 108 bytes with its NUL on Linux).
MAX_SOCKET_PATH = 107
#: Where the default socket's folder (kvstore-<uid>) is made without $XDG_RUNTIME_DIR.
SOCKET_FALLBACK_ROOT = Path("/tmp")


def resolved(config: Config, port: int) -> Config:
    """config with what start-up settles: server.port as bound (so that port 0 names its
    segment, its scratch L3 folder and its socket after the port it got) and
    server.unix_socket ("" with auth on: default_socket_path; "off": none)."""
    path = config.server.unix_socket
    if path == NO_SOCKET:
        path = ""
    elif not path and config.auth.mode != "off" and config.dram.enabled:
        path = default_socket_path(port)
    server = dataclasses.replace(config.server, port=port, unix_socket=path)
    return dataclasses.replace(config, server=server)


def default_socket_path(port: int) -> str:
    """The Unix socket a daemon with auth on serves when server.unix_socket is unset, so its
    tenants' clients on this host get shared memory with no setting (they learn the path
    from Stats): kvstore-<port>.sock in $XDG_RUNTIME_DIR (the user's own 0700 folder), else
    in /tmp/kvstore-<uid>, made 0700. One per port, so daemons on one host never meet.
    Only this user's processes reach it there; a daemon serving other users' engines sets
    server.unix_socket to a folder they can reach. "" (with a warning naming the setting)
    when neither folder is usable: clients then move data inline."""
    name = f"kvstore-{port}.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and Path(runtime).is_dir() and len(f"{runtime}/{name}") <= MAX_SOCKET_PATH:
        return str(Path(runtime) / name)
    folder = SOCKET_FALLBACK_ROOT / f"kvstore-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError as exc:
        return _no_default_socket(f"cannot make {folder}: {exc.strerror}")
    # Another user may have made the folder first (/tmp is everyone's): never serve in it.
    if not folder.is_dir() or folder.is_symlink() or st.st_uid != os.getuid() \
            or st.st_mode & 0o077:
        return _no_default_socket(f"{folder} is not a folder of this user's alone")
    return str(folder / name)


def _no_default_socket(why: str) -> str:
    log.warning("no Unix socket (%s): with auth on, clients on this host move data inline "
                "instead of through shared memory; set server.unix_socket to a path", why)
    return ""


def banner(config: Config, port: int, tls: bool, metrics_port: int, store: Store,
           socket_path: str, data_port: int = 0) -> str:
    """The line printed once the daemon listens: the version, where it listens and how,
    and where each tier keeps how much (an operator sees what a bare start takes)."""
    dram = store.state.dram
    if dram is None:
        l2 = "L2 off"
    else:
        l2 = (f"L2 shm {dram.shm_name or 'per-tenant arenas'}, "
              f"{format_size(dram.capacity_bytes)}")
    l3 = store.describe_l3()
    if config.nvme.enabled and not config.nvme.dir and l3 != "L3 off":
        l3 += "; scratch: removed at stop, set nvme.dir to keep it"
    return (f"kvstore-server {__version__} listening on {config.server.host}:{port} "
            f"({'TLS' if tls else 'plaintext'}, auth {config.auth.mode}, metrics port "
            f"{metrics_port or 'off'}, {l2}, "
            f"{'unix socket ' + socket_path if socket_path else 'no unix socket'}, "
            f"{f'data port {data_port}, ' if data_port else ''}{l3})")


def _serve(config: Config, listener: Listener, store: Store, metrics: Metrics,
           metrics_port: int, stop: threading.Event, reload: threading.Event,
           drain_began: list[float], data_sock: socket.socket | None = None) -> None:
    health_servicer = listener.health_servicer

    def set_health(status: int) -> None:
        _set_health(health_servicer, metrics, status)

    set_health(NOT_SERVING)  # until the store's workers run (and L4 prewarm is done)
    servicer = KVStoreServicer(store, metrics, drain=stop.set)  # Drain: as SIGTERM
    listener.server.add_generic_rpc_handlers((handlers(servicer),))
    attach = _attach_socket(config, store, servicer)
    data = _data_socket(config, store, servicer, data_sock)
    reaper_stop = threading.Event()  # the reaper outlives stop: it also ends idle streams
    threads: list[threading.Thread] = []
    try:
        listener.start()

        def worker_failed(reason: str) -> None:
            log.error("a background worker stopped (%s); health is NOT_SERVING", reason)
            set_health(NOT_SERVING)

        store.start(worker_failed)
        if store.state.remote is not None and config.remote.prewarm_bytes:
            _prewarm(store, config.remote.prewarm_bytes, stop)
        # The banner first: whoever sees SERVING finds it in the log already.
        print(banner(config, listener.port, listener.tls, metrics_port, store,
                     attach.path if attach else "", data.port if data else 0), flush=True)
        set_health(SERVING)
        threads = [
            threading.Thread(target=_sweep_forever, name="lease-sweeper", daemon=True,
                             args=(store, config.leases.sweep_interval_s, stop, set_health)),
            threading.Thread(target=servicer.slots.reap_forever, name="stream-reaper",
                             daemon=True, args=(reaper_stop,)),  # while the server drains
        ]
        for thread in threads:
            thread.start()
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
        if listener.started:
            _drain(config, servicer, set_health)
            listener.server.stop(config.server.grace_s - config.server.drain_notice_s).wait()
        reaper_stop.set()
        if attach is not None:
            attach.close()
            servicer.local.close()
        if data is not None:
            data.close()
            servicer.data.close()
        for thread in threads:
            thread.join()
        listener.close()  # the pools; the server is stopped


def _attach_socket(config: Config, store: Store,
                   servicer: KVStoreServicer) -> AttachSocket | None:
    """The Unix socket (a path set, L2 on): it hands tenants their arenas (auth on) and
    serves co-located clients' local sessions (kvstore.daemon.localpath)."""
    path = config.server.unix_socket
    if not path:
        return None
    dram = store.state.dram
    if dram is None:
        log.warning("server.unix_socket is unused: it serves shared-memory clients, and "
                    "dram.enabled is false")
        return None
    attach = AttachSocket(path, servicer.tickets,
                          dram.arena_fds if store.auth.on else None,
                          servicer.local.open)
    attach.start()
    return attach


def _data_socket(config: Config, store: Store, servicer: KVStoreServicer,
                 sock: socket.socket | None) -> DataSocket | None:
    """The data socket (server.data_port, L2 on): INLINE Gets and Puts over TCP for
    engines on other hosts (kvstore.daemon.datasocket), started."""
    if sock is None:
        return None
    if store.state.dram is None:
        log.warning("server.data_port is unused: the data socket moves blocks in and out of "
                    "L2, and dram.enabled is false")
        return None
    data = DataSocket(config, servicer.data, sock)
    servicer.data_port = data.port
    data.start()
    return data


def _drain(config: Config, servicer: KVStoreServicer,
           set_health: Callable[[int], None]) -> None:
    """Say so before stopping: health turns NOT_SERVING and new data calls get UNAVAILABLE,
    while the server still answers, for server.drain_notice_s; Kubernetes and clients see a
    draining replica instead of a refused connection. In-flight calls go on meanwhile."""
    notice_s = config.server.drain_notice_s
    log.info("shutting down: NOT_SERVING for %.1fs, then up to %.1fs for calls in flight",
             notice_s, config.server.grace_s - notice_s)
    servicer.draining.set()
    set_health(NOT_SERVING)
    time.sleep(notice_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-server", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvstore-server {__version__}")
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
