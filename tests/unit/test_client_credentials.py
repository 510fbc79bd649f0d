"""The client's side of authenticated tenants, without the real daemon: where the token and
the TLS settings come from and how they fail; the bearer token on every call of both
clients; UNAUTHENTICATED and PERMISSION_DENIED surfacing once, unretried; TLS and mutual TLS
against an in-process server; the Unix socket exchange against a tiny in-test socket server
passing real memfd descriptors; and the arena path end to end, through a fake daemon that
serves Stats, Attach, Reserve, Put and Get out of one memfd arena; and what kvstore-admin
shows of the daemon's auth and passes on of its flags.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import mmap
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash
from grpc_health.v1 import health, health_pb2_grpc
from rich.console import Console

from kvstore import shm
from kvstore.client import (
    TLS,
    AsyncKVStoreClient,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    KVStoreClient,
    KVStoreError,
    NoBackoff,
    PermissionDenied,
    Retry,
    Unauthenticated,
)
from kvstore.client import credentials as cred
from kvstore.client import results as res
from kvstore.client._attach import receive_arenas
from kvstore.client._shm import ShmState, same_kernel
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.tools import admin
from kvstore.tools.tables import AUTH_OFF_WARNING, stats_view

K = [bytes([i]) * 32 for i in range(1, 5)]
NO_RETRY = Retry(NoBackoff(), attempts=3)


@pytest.fixture(autouse=True)
def _no_credentials_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (cred.ENV_TOKEN, cred.ENV_TOKEN_FILE, cred.ENV_TLS_CA_FILE,
                 cred.ENV_TLS_CERT_FILE, cred.ENV_TLS_KEY_FILE, cred.ENV_TLS_SERVER_NAME,
                 cred.ENV_UNIX_SOCKET):
        monkeypatch.delenv(name, raising=False)

# --- where credentials come from ------------------------------------------------------------


def test_the_argument_wins_then_the_variable_then_the_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  from-file\n")
    env = {cred.ENV_TOKEN: "from-env", cred.ENV_TOKEN_FILE: str(token_file)}
    assert cred.resolve_token("explicit", env) == "explicit"
    assert cred.resolve_token(None, env) == "from-env"
    assert cred.resolve_token(None, {cred.ENV_TOKEN_FILE: str(token_file)}) == "from-file"
    assert cred.resolve_token(None, {cred.ENV_TOKEN: ""}) is None  # an empty variable is unset


@pytest.mark.parametrize("bad", ["", "   ", "two words", "line\nbreak", "tab\there", "é"])
def test_a_malformed_token_is_invalid_argument_naming_token(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="^token"):
        cred.resolve_token(bad, {})
    with pytest.raises(InvalidArgument, match="token"):
        KVStoreClient("127.0.0.1:1", "ns", token=bad)


def test_an_empty_or_missing_token_file_names_the_variable_and_the_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(InvalidArgument, match=f"KVSTORE_TOKEN_FILE.*{empty}.*empty"):
        cred.resolve_token(None, {cred.ENV_TOKEN_FILE: str(empty)})
    missing = tmp_path / "missing"
    with pytest.raises(InvalidArgument, match=f"KVSTORE_TOKEN_FILE.*{missing}"):
        cred.resolve_token(None, {cred.ENV_TOKEN_FILE: str(missing)})


def test_a_certificate_needs_its_key_and_the_key_its_certificate() -> None:
    with pytest.raises(InvalidArgument, match="tls.cert_file is set but tls.key_file is not"):
        TLS(cert_file="client.pem")
    with pytest.raises(InvalidArgument, match="tls.key_file is set but tls.cert_file is not"):
        TLS(key_file="client.key")
    with pytest.raises(InvalidArgument, match="KVSTORE_TLS"):
        cred.resolve_tls(None, {cred.ENV_TLS_CERT_FILE: "client.pem"})


def test_tls_true_false_and_none_from_the_environment() -> None:
    env = {cred.ENV_TLS_CA_FILE: "ca.pem", cred.ENV_TLS_SERVER_NAME: "kvstore.test"}
    assert cred.resolve_tls(True, env) == TLS()
    assert cred.resolve_tls(False, env) is None
    assert cred.resolve_tls(None, env) == TLS(ca_file="ca.pem", server_name="kvstore.test")
    assert cred.resolve_tls(None, {cred.ENV_TLS_KEY_FILE: "k"}) is None  # CA or cert turn it on
    assert cred.resolve_tls(None, {}) is None


def test_an_unreadable_tls_file_names_the_field_and_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(InvalidArgument, match=f"tls.ca_file: cannot read '{missing}'"):
        KVStoreClient("127.0.0.1:1", "ns", tls=TLS(ca_file=str(missing)))


def test_the_unix_socket_override_is_the_argument_else_the_variable() -> None:
    env = {cred.ENV_UNIX_SOCKET: "/run/env.sock"}
    assert cred.resolve_unix_socket("/mnt/kv.sock", env) == "/mnt/kv.sock"
    assert cred.resolve_unix_socket(None, env) == "/run/env.sock"
    assert cred.resolve_unix_socket(None, {}) is None
    with pytest.raises(InvalidArgument, match="unix_socket"):
        cred.resolve_unix_socket("", env)


# --- a fake daemon --------------------------------------------------------------------------


class Recorder(grpc.ServerInterceptor):  # type: ignore[misc]
    """Every call's method name and its authorization metadata (None when absent)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        metadata = dict(details.invocation_metadata)
        self.seen.append((details.method.rsplit("/", 1)[-1], metadata.get("authorization")))
        return continuation(details)


def memfd(name: str, size_bytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name)
    os.ftruncate(fd, size_bytes)
    return fd, mmap.mmap(fd, size_bytes)


class TicketServer:
    """The daemon's end of the Unix socket: reads one ticket line per connection and answers
    reply(ticket) = (JSON message, descriptors), or stays silent for None."""

    def __init__(self, path: str, reply: Callable[[str], tuple[Any, list[int]]]) -> None:
        self.reply = reply
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen()
        self.listener.settimeout(0.05)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5.0)
                line = b""
                while not line.endswith(b"\n") and (chunk := conn.recv(4096)):
                    line += chunk
                message, fds = self.reply(line.decode().rstrip("\n"))
                if message is None:
                    conn.recv(1)  # silent until the client hangs up
                else:
                    socket.send_fds(conn, [json.dumps(message).encode() + b"\n"], fds)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5.0)
        self.listener.close()


ARENA_BYTES = 1 << 20


class FakeDaemon(pb_grpc.KVStoreServicer):  # type: ignore[misc]
    """Every verb, minimally; auth on: no shm_name, the blocks in one memfd arena that Attach
    and the Unix socket hand out. attach_error makes Attach FAILED_PRECONDITION,
    forge_tickets its tickets unknown to the socket, abort Lookup fail with that code."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.blocks: dict[bytes, tuple[int, int, int]] = {}  # key -> offset, size, checksum
        self.reserved: dict[str, list[tuple[bytes, int, int]]] = {}
        self.used_bytes = 0
        self.tickets: set[str] = set()
        self.attach_error: str | None = None
        self.forge_tickets = False
        self.abort: grpc.StatusCode | None = None
        self.generation = -1
        self.move_arena()
        self.sockets = TicketServer(socket_path, self._ticket)

    def move_arena(self) -> None:
        """A new arena (as after a restart) holding the same bytes, under a new name."""
        self.generation += 1
        fd, mem = memfd(f"tenant-a.{self.generation}", ARENA_BYTES)
        if self.generation:
            mem[:] = self.mem[:]
            os.close(self.fd)
        self.fd, self.mem, self.arena = fd, mem, f"tenant-a.{self.generation}"

    def _ticket(self, ticket: str) -> tuple[Any, list[int]]:
        if ticket not in self.tickets:
            return {"error": f"unknown ticket {ticket!r}"}, []
        self.tickets.discard(ticket)
        return {"arenas": [{"name": self.arena, "size_bytes": ARENA_BYTES}]}, [self.fd]

    def _store(self, key: bytes, offset: int, size: int) -> None:
        self.blocks[key] = (offset, size, xxhash.xxh3_64_intdigest(self.mem[offset:offset + size]))

    def _room(self, size: int) -> int:
        offset, self.used_bytes = self.used_bytes, self.used_bytes + size
        return offset

    def Stats(self, request: Any, context: Any) -> pb.StatsResponse:
        return pb.StatsResponse(host_id=shm.host_id(), unix_socket=self.socket_path,
                                auth_mode="token", tenant="tenant-a")

    def Limits(self, request: Any, context: Any) -> pb.LimitsResponse:
        return pb.LimitsResponse(contract="kvstore.v1", max_message_bytes=16 << 20,
                                 chunk_bytes=4 << 20)

    def Attach(self, request: Any, context: Any) -> pb.AttachResponse:
        if self.attach_error is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.attach_error)
        ticket = f"ticket-{len(self.tickets)}-{self.generation}"
        if not self.forge_tickets:
            self.tickets.add(ticket)
        return pb.AttachResponse(ticket=ticket, unix_socket=self.socket_path, expires_in_ms=5000)

    def Reserve(self, request: Any, context: Any) -> pb.ReserveResponse:
        rid = f"r{len(self.reserved)}"
        spans = [(k, self._room(n), n) for k, n in zip(request.keys, request.sizes, strict=True)]
        self.reserved[rid] = spans
        return pb.ReserveResponse(
            reservation_id=rid, exists=[False] * len(spans), arena=self.arena,
            locations=[pb.BlockLocation(extents=[pb.Extent(offset=o, length=n)])
                       for _, o, n in spans])

    def Put(self, requests: Any, context: Any) -> pb.PutResponse:
        messages = list(requests)
        if messages[0].reservation_id:
            spans = self.reserved.pop(messages[0].reservation_id)
            for key, offset, size in spans:
                self._store(key, offset, size)
            return pb.PutResponse(stored=len(spans))
        data = b"".join(m.data for m in messages)
        pos = 0
        for key, size in zip(messages[0].keys, messages[0].sizes, strict=True):
            offset = self._room(size)
            self.mem[offset:offset + size] = data[pos:pos + size]
            self._store(key, offset, size)
            pos += size
        return pb.PutResponse(stored=len(messages[0].keys))

    def Get(self, request: Any, context: Any) -> Iterator[pb.GetResponse]:
        hits = [self.blocks[k] for k in request.keys if k in self.blocks]
        head = pb.GetResponse(found=[k in self.blocks for k in request.keys],
                              sizes=[n for _, n, _ in hits], checksums=[c for _, _, c in hits])
        if request.mode == pb.GET_MODE_SHARED_MEMORY:
            head.arena = self.arena
            head.locations.extend(pb.BlockLocation(extents=[pb.Extent(offset=o, length=n)])
                                  for o, n, _ in hits)
        else:
            head.data = b"".join(self.mem[o:o + n] for o, n, _ in hits)
        yield head

    def Lookup(self, request: Any, context: Any) -> pb.LookupResponse:
        if self.abort is not None:
            context.abort(self.abort, "no valid credentials" if self.abort
                          == grpc.StatusCode.UNAUTHENTICATED else "not your namespace")
        return pb.LookupResponse(prefix_length=0, tiers=[0] * len(request.keys))

    def Prefetch(self, request: Any, context: Any) -> Iterator[pb.PrefetchProgress]:
        yield pb.PrefetchProgress(total=len(request.keys), missing=len(request.keys))

    def Prewarm(self, request: Any, context: Any) -> Iterator[pb.PrewarmProgress]:
        yield pb.PrewarmProgress(done=True)

    def Release(self, request: Any, context: Any) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=len(request.ids))

    def Evict(self, request: Any, context: Any) -> pb.EvictResponse:
        return pb.EvictResponse()

    def Pin(self, request: Any, context: Any) -> pb.PinResponse:
        return pb.PinResponse(missing=len(request.keys))

    def Unpin(self, request: Any, context: Any) -> pb.PinResponse:
        return pb.PinResponse(missing=len(request.keys))

    def Hot(self, request: Any, context: Any) -> pb.HotResponse:
        return pb.HotResponse()

    def Drain(self, request: Any, context: Any) -> pb.DrainResponse:
        return pb.DrainResponse(grace_s=1.0)


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")  # AF_UNIX paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve(servicer: Any, recorder: Recorder, port_spec: Callable[[grpc.Server], int]) -> Any:
    server = grpc.server(futures.ThreadPoolExecutor(8), interceptors=[recorder])
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = port_spec(server)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def fake(socket_dir: str) -> Iterator[tuple[FakeDaemon, str, Recorder]]:
    daemon, recorder = FakeDaemon(os.path.join(socket_dir, "kv.sock")), Recorder()
    server, target = serve(daemon, recorder, lambda s: s.add_insecure_port("127.0.0.1:0"))
    yield daemon, target, recorder
    server.stop(0)
    daemon.sockets.close()
    os.close(daemon.fd)


# --- the token on every call ----------------------------------------------------------------

EVERY_VERB = {"Put", "Get", "Lookup", "Prefetch", "Evict", "Pin", "Unpin", "Stats", "Hot",
              "Prewarm", "Check", "Release", "Drain", "Limits"}


def test_every_blocking_call_carries_the_bearer_token(fake: Any) -> None:
    daemon, target, recorder = fake
    with KVStoreClient(target, "ns", token="s3cret", shared_memory=False) as kv:
        kv.put(K[:2], [b"a" * 100, b"b" * 50])
        assert kv.get(K[:3]) == [b"a" * 100, b"b" * 50, None]
        kv.get_into(K[:1], [bytearray(100)])
        kv.lookup(K), kv.prefetch(K), kv.evict(K[:1]), kv.pin(K[:1]), kv.unpin(K[:1])
        kv.stats(), kv.hot(), kv.prewarm(), kv.health(), kv.release(["r9"]), kv.drain()
    assert {method for method, _ in recorder.seen} == EVERY_VERB
    assert {auth for _, auth in recorder.seen} == {"Bearer s3cret"}


def test_every_awaited_call_carries_the_bearer_token(fake: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    daemon, target, recorder = fake
    monkeypatch.setenv("KVSTORE_TOKEN", "from-env")

    async def scenario() -> None:
        async with AsyncKVStoreClient(target, "ns", shared_memory=False) as kv:
            await kv.put(K[:2], [b"a" * 100, b"b" * 50])
            assert await kv.get(K[:3]) == [b"a" * 100, b"b" * 50, None]
            await kv.get_into(K[:1], [bytearray(100)])
            for call in (kv.lookup(K), kv.prefetch(K), kv.evict(K[:1]), kv.pin(K[:1]),
                         kv.unpin(K[:1]), kv.stats(), kv.hot(), kv.prewarm(), kv.health(),
                         kv.release(["r9"]), kv.drain()):
                await call

    asyncio.run(scenario())
    assert {method for method, _ in recorder.seen} == EVERY_VERB
    assert {auth for _, auth in recorder.seen} == {"Bearer from-env"}


def test_without_a_token_no_authorization_is_sent(fake: Any) -> None:
    daemon, target, recorder = fake
    with KVStoreClient(target, "ns", shared_memory=False) as kv:
        kv.lookup(K)
        assert kv.stats().auth_mode == "token" and kv.stats().tenant == "tenant-a"
    assert recorder.seen == [("Lookup", None), ("Stats", None), ("Stats", None)]


@pytest.mark.parametrize(("code", "error"), [
    (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
    (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
])
def test_auth_failures_surface_as_their_class_and_are_never_retried(
        fake: Any, code: grpc.StatusCode, error: type[KVStoreError]) -> None:
    daemon, target, recorder = fake
    daemon.abort = code
    with KVStoreClient(target, "ns", token="wrong", retry=NO_RETRY) as kv:
        with pytest.raises(error) as raised:
            kv.lookup(K)
    assert raised.value.code == code and raised.value.details
    assert [m for m, _ in recorder.seen] == ["Lookup"]  # once, though 3 attempts were allowed


# --- TLS and mutual TLS ---------------------------------------------------------------------


def make_pki(folder: Path) -> dict[str, str]:
    """A CA, a server certificate for kvstore.test and a client certificate for tenant-a."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())

    def cert(cn: str, key: Any, *, ca: bool = False, dns: str | None = None) -> Any:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(subject if ca else ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if dns:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]),
                                            critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    ca_cert = cert("test-ca", ca_key, ca=True)
    paths: dict[str, str] = {}

    def write(name: str, data: bytes) -> None:
        paths[name] = str(folder / name)
        (folder / name).write_bytes(data)

    write("ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    for who, dns in (("server", "kvstore.test"), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(f"{who}.pem", cert("tenant-a" if who == "client" else dns or who, key, dns=dns)
              .public_bytes(serialization.Encoding.PEM))
        write(f"{who}.key", key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    return paths


class PeerDaemon(FakeDaemon):
    """Stats says who the client certificate named."""

    def Stats(self, request: Any, context: Any) -> pb.StatsResponse:
        names = context.auth_context().get("x509_common_name", [b""])
        return pb.StatsResponse(auth_mode="mtls", tenant=names[0].decode())


def test_mutual_tls_verifies_the_server_name_and_presents_the_certificate(
        tmp_path: Path, socket_dir: str) -> None:
    pki = make_pki(tmp_path)
    read = {name: Path(path).read_bytes() for name, path in pki.items()}
    server_credentials = grpc.ssl_server_credentials(
        [(read["server.key"], read["server.pem"])], root_certificates=read["ca.pem"],
        require_client_auth=True)
    daemon, recorder = PeerDaemon(os.path.join(socket_dir, "kv.sock")), Recorder()
    server, target = serve(daemon, recorder,
                           lambda s: s.add_secure_port("127.0.0.1:0", server_credentials))
    mtls = TLS(ca_file=pki["ca.pem"], cert_file=pki["client.pem"], key_file=pki["client.key"],
               server_name="kvstore.test")
    try:
        with KVStoreClient(target, "ns", tls=mtls, timeout_s=5.0) as kv:
            assert kv.stats().tenant == "tenant-a"

        async def awaited() -> str:
            async with AsyncKVStoreClient(target, "ns", tls=mtls, timeout_s=5.0) as kv:
                return (await kv.stats()).tenant

        assert asyncio.run(awaited()) == "tenant-a"
        no_certificate = TLS(ca_file=pki["ca.pem"], server_name="kvstore.test")
        for tls in (no_certificate, False):
            with KVStoreClient(target, "ns", tls=tls, timeout_s=5.0,
                               retry=Retry(attempts=1)) as kv, pytest.raises(KVStoreError):
                kv.stats()
    finally:
        server.stop(0)
        daemon.sockets.close()


# --- the Unix socket exchange ---------------------------------------------------------------


def open_fds() -> int:
    """Descriptors open on the test's arenas (counting mmap's own duplicates); grpc's threads
    may open and close others meanwhile."""
    def target(fd: str) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""
    return sum(target(fd).startswith("/memfd:arena-") for fd in os.listdir("/proc/self/fd"))


@pytest.fixture
def arenas(socket_dir: str) -> Iterator[tuple[str, list[int], list[mmap.mmap]]]:
    made = [memfd(f"arena-{i}", 4096 * (i + 1)) for i in range(2)]
    for i, (_, mem) in enumerate(made):
        mem[:5] = f"hi {i}\n".encode()
    yield os.path.join(socket_dir, "kv.sock"), [fd for fd, _ in made], [m for _, m in made]
    for fd, mem in made:
        mem.close()
        os.close(fd)


def test_arenas_arrive_mapped_whole_and_shared_both_ways(arenas: Any) -> None:
    path, fds, mems = arenas
    listing = [{"name": f"a{i}", "size_bytes": len(m)} for i, m in enumerate(mems)]
    seen: list[str] = []
    before = open_fds()
    server = TicketServer(path, lambda t: (seen.append(t), ({"arenas": listing}, fds))[1])
    try:
        got = receive_arenas(path, "tk-1")
    finally:
        server.close()
    assert seen == ["tk-1"]
    assert [(a.name, a.size_bytes) for a in got] == [("a0", 4096), ("a1", 8192)]
    assert [bytes(a.buf[:5]) for a in got] == [b"hi 0\n", b"hi 1\n"]
    got[1].buf[100:103] = b"abc"  # MAP_SHARED: the daemon sees the client's writes
    assert mems[1][100:103] == b"abc"
    assert open_fds() == before + 2  # only mmap's own duplicates: the received ones are closed
    for arena in got:
        arena.close()
    assert open_fds() == before


@pytest.mark.parametrize(("message", "match"), [
    ({"error": "ticket expired"}, "refused the ticket: ticket expired"),
    ({"arenas": [{"name": "a0", "size_bytes": 4096}]}, "named 1 arenas but passed 2"),
    ({"arenas": "nope"}, "malformed arena list"),
    ({"arenas": [{"name": "a0", "size_bytes": 1 << 30}] * 2}, "named an arena twice"),
])
def test_a_refusal_or_a_bad_reply_is_failed_precondition_and_closes_every_descriptor(
        arenas: Any, message: Any, match: str) -> None:
    path, fds, _ = arenas
    before = open_fds()
    server = TicketServer(path, lambda t: (message, fds))  # descriptors even with an error
    try:
        with pytest.raises(FailedPrecondition, match=match):
            receive_arenas(path, "tk")
    finally:
        server.close()
    assert open_fds() == before


def test_a_file_smaller_than_announced_is_refused(arenas: Any) -> None:
    path, fds, _ = arenas
    server = TicketServer(path, lambda t: ({"arenas": [{"name": "a0", "size_bytes": 1 << 20}]},
                                           fds[:1]))
    try:
        with pytest.raises(FailedPrecondition, match="cannot map arena 'a0'.*4096 bytes"):
            receive_arenas(path, "tk")
    finally:
        server.close()


def test_no_socket_or_a_silent_daemon_is_failed_precondition(arenas: Any) -> None:
    path, _, _ = arenas
    with pytest.raises(FailedPrecondition, match=f"Unix socket {path}"):
        receive_arenas(path, "tk")
    server = TicketServer(path, lambda t: (None, []))
    try:
        with pytest.raises(FailedPrecondition, match="timed out|no reply"):
            receive_arenas(path, "tk", timeout_s=0.2)
    finally:
        server.close()


# --- the arena path: ShmState and both clients ----------------------------------------------


def test_descriptors_need_one_kernel_not_one_ipc_namespace() -> None:
    assert same_kernel("boot-1:ipc:[4026531839]", "boot-1:ipc:[4026532555]")
    assert not same_kernel("boot-1:ipc:[1]", "boot-2:ipc:[1]")


def test_a_named_segment_is_attached_by_name_and_attach_never_called() -> None:
    state = ShmState(None)
    calls: list[int] = []
    stats = pb.StatsResponse(shm_name="kvstore-no-such-segment", unix_socket="/run/kv.sock",
                             host_id=shm.host_id())
    state.decide(stats, lambda: calls.append(1) or pb.AttachResponse())
    assert calls == [] and state.in_use is False  # tried by name (absent here), no Attach


def test_an_unknown_arena_reattaches_once_then_is_data_loss(fake: Any) -> None:
    daemon, target, _ = fake
    state = ShmState(None)
    attaches: list[str] = []

    def fetch_attach() -> pb.AttachResponse:
        reply = daemon.Attach(pb.AttachRequest(), None)
        attaches.append(reply.ticket)
        return reply

    state.decide(daemon.Stats(None, None), fetch_attach)
    assert state.in_use and list(state.arenas) == ["tenant-a.0"]
    # Attaches: the arenas', the local path's (this fake socket serves no local sessions, so
    # the blocking client's hot verbs stay on gRPC), then the one re-Attach.
    assert state.local is None and len(attaches) == 2
    daemon.move_arena()
    state.ensure_arena("tenant-a.1", fetch_attach)
    assert list(state.arenas) == ["tenant-a.1"] and len(attaches) == 3
    state.ensure_arena("tenant-a.9", fetch_attach)  # the daemon still has no such arena
    with pytest.raises(DataLoss, match="tenant-a.9"):
        state.segment_named("tenant-a.9")
    state.close()


def test_an_attach_refusal_goes_inline_with_a_log_unless_required(
        fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    daemon, target, recorder = fake
    daemon.attach_error = "the daemon has no L2 tier"
    with caplog.at_level(logging.INFO, "kvstore.client"):
        with KVStoreClient(target, "ns", token="t") as kv:
            kv.put(K[:1], [b"x" * 64])
            assert kv.get(K[:1]) == [b"x" * 64] and kv.uses_shared_memory is False
    assert "shared-memory path off" in caplog.text and "no L2 tier" in caplog.text
    with KVStoreClient(target, "ns", token="t", shared_memory=True) as kv:
        with pytest.raises(FailedPrecondition, match="no L2 tier"):
            kv.get(K[:1])


def test_a_refused_ticket_goes_inline(fake: Any) -> None:
    daemon, target, _ = fake
    daemon.forge_tickets = True  # Attach answers, the socket refuses its ticket
    with KVStoreClient(target, "ns", token="t") as kv:
        kv.put(K[:1], [b"y" * 64])
        assert kv.uses_shared_memory is False and kv.get(K[:1]) == [b"y" * 64]


def test_the_blocking_client_reads_and_writes_through_the_arena(fake: Any) -> None:
    daemon, target, recorder = fake
    with KVStoreClient(target, "ns", token="t") as kv:
        kv.put(K[:2], [b"p" * 3000, b"q" * 10])
        assert kv.uses_shared_memory is True
        assert daemon.mem[0:3] == b"ppp"  # written by the client, straight into the arena
        assert kv.get(K[:3]) == [b"p" * 3000, b"q" * 10, None]
        daemon.move_arena()  # responses now name tenant-a.1: one re-Attach, then it reads
        buffers = [bytearray(3000), bytearray(10)]
        assert kv.get_into(K[:2], buffers) == [3000, 10] and bytes(buffers[1]) == b"q" * 10
    methods = [m for m, _ in recorder.seen]
    # The arenas', the local path's (refused by this fake socket: gRPC stays), a re-Attach.
    assert methods.count("Attach") == 3 and "Reserve" in methods


def test_the_awaited_client_reads_and_writes_through_the_arena(fake: Any) -> None:
    daemon, target, recorder = fake

    async def scenario() -> tuple[list[bytes | None], bool | None]:
        async with AsyncKVStoreClient(target, "ns", token="t",
                                      unix_socket=daemon.socket_path) as kv:
            await kv.put(K[:2], [b"p" * 3000, b"q" * 10])
            daemon.move_arena()
            return await kv.get(K[:3]), kv.uses_shared_memory

    assert asyncio.run(scenario()) == ([b"p" * 3000, b"q" * 10, None], True)
    # As the blocking client's: the arenas', the local path's (refused by this fake socket),
    # and a re-Attach after the arena moved.
    assert [m for m, _ in recorder.seen].count("Attach") == 3
    assert {auth for _, auth in recorder.seen} == {"Bearer t"}


# --- what Stats says, and how kvstore-admin shows and passes it -----------------------------


def render(stats: pb.StatsResponse) -> str:
    console = Console(record=True, width=200)
    console.print(stats_view(res.stats_result(stats), "127.0.0.1:1"))
    return console.export_text()


def test_stats_carry_the_auth_mode_the_tenant_and_the_socket() -> None:
    stats = res.stats_result(pb.StatsResponse(auth_mode="mtls", tenant="tenant-a",
                                              unix_socket="/run/kvstore/kv.sock"))
    assert (stats.auth_mode, stats.tenant, stats.unix_socket) == (
        "mtls", "tenant-a", "/run/kvstore/kv.sock")
    assert stats.to_dict()["tenant"] == "tenant-a"


def test_the_stats_view_warns_when_auth_is_off_and_names_the_tenant_when_on() -> None:
    assert AUTH_OFF_WARNING in render(pb.StatsResponse(auth_mode="off"))
    shown = render(pb.StatsResponse(auth_mode="token", tenant="tenant-a",
                                    unix_socket="/run/kvstore/kv.sock"))
    assert AUTH_OFF_WARNING not in shown
    assert all(w in shown for w in ("token", "tenant-a", "/run/kvstore/kv.sock"))


def test_admin_flags_become_the_clients_credentials(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    monkeypatch.setenv(cred.ENV_TLS_CA_FILE, "/env/ca.pem")
    monkeypatch.setenv(cred.ENV_TLS_SERVER_NAME, "env.name")
    args = admin.build_parser().parse_args(
        ["--token-file", str(token_file), "--tls-cert", "c.pem", "--tls-key", "k.pem", "stats"])
    assert admin._credentials(args) == {  # each flag not given comes from its variable
        "token": "from-file",
        "tls": TLS(ca_file="/env/ca.pem", cert_file="c.pem", key_file="k.pem",
                   server_name="env.name"),
    }
    bare = admin.build_parser().parse_args(["stats"])
    assert admin._credentials(bare) == {"token": None, "tls": TLS(ca_file="/env/ca.pem",
                                                                  server_name="env.name")}
    with pytest.raises(SystemExit):  # one token source
        admin.build_parser().parse_args(["--token", "a", "--token-file", "f", "stats"])
