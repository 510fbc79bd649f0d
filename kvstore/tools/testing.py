"""Real processes for tests, benchmarks and the demo: a `kvstore-server` and a `redis-server`,
each on a free loopback port, started, waited for and stopped. No mocks: what runs is what
ships.

Used by tests/conftest.py, bench/ and kvstore/tools/demo.py; not imported by the daemon or the
client.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A loopback port nothing listens on, chosen below the kernel's ephemeral range: a port
    the kernel hands out itself (bind to 0) is just as likely to be handed out again, as the
    source port of some outgoing connection, before the child process binds it."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after timeout_s; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@dataclass
class Daemon:
    """A running kvstore-server subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_path: Path
    #: The local path's socket (server.unix_socket), when its settings gave it one.
    unix_socket: Path | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 10.0) -> int:
        return stop_process(self.proc, timeout_s)


def wait_serving(target: str, proc: subprocess.Popen[bytes], log_path: Path | None = None,
                 timeout_s: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Return once the daemon's health says SERVING; raise (with its log, when it writes one)
    if it exits first or never gets there."""
    def log() -> str:
        return log_path.read_text() if log_path is not None else "(its output is above)"

    deadline = time.monotonic() + timeout_s
    # A refused first connection would put a shared channel into gRPC's reconnect backoff
    # (1 s, then longer); a short backoff makes the check answer as soon as the daemon does.
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
    with (grpc.secure_channel(target, credentials, options=options) if credentials else
          grpc.insecure_channel(target, options=options)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvstore-server exited with {proc.returncode}:\n{log()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0,
                                   wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.05)
    raise RuntimeError(f"kvstore-server not SERVING after {timeout_s}s:\n{log()}")


#: The L3 reserve of test daemons (nvme.reserve_bytes): room for a test's logs beside them.
#: Tests of the automatic reserve set nvme.reserve_bytes=0.
TEST_L3_RESERVE = "256MiB"
_BIND_RETRIES = 3  # a free port can be taken between free_port() and the child's bind


def _lost_port_race(log_text: str) -> bool:
    return "Address already in use" in log_text


def start_daemon(workdir: Path, *settings: str, env: dict[str, str] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> Daemon:
    """Start `kvstore-server` with `--set` settings (e.g. "dram.capacity_bytes=8MiB") and wait
    until it is SERVING (over TLS with credentials). Its output goes to a log file in
    workdir. A port taken by another process between choosing it and binding it (an outgoing
    connection's ephemeral port, say) is retried on fresh ports."""
    for attempt in range(_BIND_RETRIES):
        daemon = _launch_daemon(workdir, settings, env)
        try:
            wait_serving(daemon.target, daemon.proc, daemon.log_path, credentials=credentials)
        except Exception:
            daemon.stop()
            if attempt + 1 < _BIND_RETRIES and _lost_port_race(daemon.log()):
                continue
            raise
        return daemon
    raise AssertionError("unreachable")


def _launch_daemon(workdir: Path, settings: tuple[str, ...],
                   env: dict[str, str] | None) -> Daemon:
    port, metrics_port = free_port(), free_port()
    log_path = workdir / f"kvstore-server-{port}.log"
    args = [sys.executable, "-m", "kvstore.daemon.server", "--port", str(port),
            "--metrics-port", str(metrics_port)]
    # L3 lives in workdir and is small unless settings say otherwise (later --set wins), and
    # its reserve is fixed: the automatic one (10% of the filesystem) refused daemons, or
    # turned L3 admission off, on a CI host whose disk was 90% full. A stop skips the drain
    # notice (a second per daemon, hundreds of daemons per suite); the drain test sets its own.
    defaults = (f"nvme.dir={workdir / f'l3-{port}'}", "nvme.capacity_bytes=64MiB",
                f"nvme.reserve_bytes={TEST_L3_RESERVE}", "server.drain_notice_s=0")
    for setting in (*defaults, *settings):
        args += ["--set", setting]
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    sockets = [s.split("=", 1)[1] for s in settings if s.startswith("server.unix_socket=")]
    return Daemon(proc, port, metrics_port, log_path,
                  Path(sockets[-1]) if sockets and sockets[-1] else None)


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> int:
        return stop_process(self.proc)


def start_redis(workdir: Path, timeout_s: float = 10.0) -> RedisServer:
    """A real redis-server without persistence on a free port, accepting connections."""
    return start_redis_on(workdir, 0, timeout_s=timeout_s)


# --- more Redis shapes: any port, a password, TLS, a cluster (tests of the L4 tier) ---------


def _redis_binary(name: str = "redis-server") -> str:
    binary = shutil.which(name)
    if binary is None:
        raise RuntimeError(f"{name} is not installed (`make redis` installs it)")
    return binary


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log_path: Path,
                    timeout_s: float) -> None:
    """Return once port accepts connections; raise with the server's log if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    stop_process(proc)
    raise RuntimeError(f"redis-server did not start on port {port}:\n{log_path.read_text()}")


def start_redis_on(workdir: Path, port: int = 0, *extra_args: str, password: str = "",
                   timeout_s: float = 10.0) -> RedisServer:
    """Like start_redis, on a given port (0 = a free one; a fixed port lets a test restart
    Redis where its clients expect it), with `requirepass` when password is given and any
    extra redis-server arguments (e.g. "--maxmemory", "1mb"). Its log is in workdir."""
    if port == 0:
        for attempt in range(_BIND_RETRIES):
            try:
                return start_redis_on(workdir, free_port(), *extra_args, password=password,
                                      timeout_s=timeout_s)
            except RuntimeError as e:
                if attempt + 1 == _BIND_RETRIES or not _lost_port_race(str(e)):
                    raise
        raise AssertionError("unreachable")
    log_path = workdir / f"redis-{port}.log"
    args = [_redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--logfile", str(log_path)]
    if password:
        args += ["--requirepass", password]
    with log_path.open("a"):
        pass  # exists even if redis-server dies before it opens it
    proc = subprocess.Popen([*args, *extra_args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    _wait_listening(proc, port, log_path, timeout_s)
    return RedisServer(proc, port)


def start_redis_with_password(workdir: Path, password: str) -> RedisServer:
    """A redis-server that requires `password` (AUTH); its url carries no credentials."""
    return start_redis_on(workdir, 0, password=password)


@dataclass
class TlsRedisServer(RedisServer):
    """A redis-server that speaks only TLS; ca_file is the CA that signed its certificate."""

    ca_file: str

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"


def make_test_certs(workdir: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost signed by it, made
    with the openssl CLI: (ca.crt, server.crt, server.key)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl CLI is not installed; TLS tests need it")
    d = workdir / "tls"
    d.mkdir(exist_ok=True)
    ca_key, ca_crt = d / "ca.key", d / "ca.crt"
    key, csr, crt, ext = d / "server.key", d / "server.csr", d / "server.crt", d / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
                   "authorityKeyIdentifier=keyid,issuer\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca_crt),
         "-days", "2", "-subj", "/CN=kvstore test CA"],
        [openssl, "req", "-new", *ec, "-keyout", str(key), "-out", str(csr),
         "-subj", "/CN=localhost"],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
         "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext)],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step[:3])} failed:\n{done.stderr}")
    return ca_crt, crt, key


# How a redis-server built without TLS (BUILD_TLS=no) words its refusal of --tls-port.
_NO_TLS_WORDS = ("without", "not supported", "not compiled", "unsupported", "bad directive")


def start_redis_tls(workdir: Path, timeout_s: float = 10.0) -> TlsRedisServer:
    """A TLS-only redis-server on a free port (clients need not present certificates),
    with a fresh CA; RuntimeError when the local redis-server lacks TLS support."""
    ca_crt, crt, key = make_test_certs(workdir)
    port = free_port()
    log_path = workdir / f"redis-tls-{port}.log"
    log_path.touch()
    proc = subprocess.Popen(
        [_redis_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(crt), "--tls-key-file", str(key),
         "--tls-ca-cert-file", str(ca_crt), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(workdir), "--logfile", str(log_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, port, log_path, timeout_s)
    except RuntimeError as exc:
        out = f"{exc}\n{proc.stdout.read().decode(errors='replace') if proc.stdout else ''}"
        if "tls" in out.lower() and any(w in out.lower() for w in _NO_TLS_WORDS):
            raise RuntimeError(f"redis-server was built without TLS support:\n{out}") from None
        raise RuntimeError(out) from None
    return TlsRedisServer(proc, port, str(ca_crt))


@dataclass
class RedisClusterServers:
    """A Redis Cluster of len(ports) primaries (no replicas) on loopback."""

    procs: list[subprocess.Popen[bytes]]
    ports: list[int]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)


def _cluster_state_ok(cli: str, port: int) -> bool:
    done = subprocess.run([cli, "-p", str(port), "CLUSTER", "INFO"], capture_output=True,
                          text=True, timeout=10)
    return "cluster_state:ok" in done.stdout


def start_redis_cluster(workdir: Path, nodes: int = 3, timeout_s: float = 30.0
                        ) -> RedisClusterServers:
    """Start `nodes` (>= 3) cluster-enabled redis-servers, join them with
    `redis-cli --cluster create` (slots split evenly, no replicas) and wait until every node
    reports cluster_state:ok."""
    if nodes < 3:
        raise ValueError(f"a Redis Cluster needs at least 3 primaries, got {nodes}")
    cli = _redis_binary("redis-cli")
    servers: list[RedisServer] = []
    try:
        for _ in range(nodes):
            # The cluster bus defaults to port + 10000, which is refused above 55535 and may
            # be taken: name a free bus port too (cluster-port, Redis >= 7).
            port = free_port()
            servers.append(start_redis_on(
                workdir, port, "--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                "--cluster-config-file", str(workdir / f"nodes-{port}.conf")))
        cluster = RedisClusterServers([s.proc for s in servers], [s.port for s in servers])
        create = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout_s)
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout}"
                               f"{create.stderr}")
        deadline = time.monotonic() + timeout_s
        while not all(_cluster_state_ok(cli, p) for p in cluster.ports):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster on {cluster.ports} not ok after {timeout_s}s")
            time.sleep(0.1)
        return cluster
    except BaseException:
        for s in servers:
            s.stop()
        raise


# --- raw local-path and fuzzing helpers, shared by the attack tests and the soak --------------

_CODE_NAMES: dict[int, str] = {code.value[0]: code.name for code in grpc.StatusCode}


def code_name(status: int) -> str:
    """The gRPC status code's name for a local-path reply's status byte."""
    return _CODE_NAMES.get(status, f"status {status}")


def read_line(sock: socket.socket, limit: int = 65536) -> bytes:
    """One line, a byte at a time (nothing past the newline is consumed); b"" when the
    daemon closed first."""
    data = bytearray()
    while len(data) < limit:
        b = sock.recv(1)
        if not b or b == b"\n":
            return bytes(data) if b else b""
        data += b
    return bytes(data)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """data with 1-3 of: a bit flipped, a byte set, bytes inserted, deleted or duplicated, the
    tail cut, garbage appended."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op, i = rng.randrange(7), rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[i % len(b)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[i % len(b)] = rng.randrange(256)
        elif op == 2:
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del b[i : i + rng.randint(1, 8)]
        elif op == 4:
            b[i:i] = b[i : i + rng.randint(1, 16)]
        elif op == 5:
            del b[i:]
        else:
            b += rng.randbytes(rng.randint(1, 16))
    return bytes(b)
