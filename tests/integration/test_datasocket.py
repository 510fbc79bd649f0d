"""The data socket (server.data_port): INLINE Get and Put over TCP, for engines on other hosts.

Against real daemons: one plaintext with auth off, one with auth.mode=token and TLS (a
throwaway CA, tests/integration/pki.py). Round trips of many sizes are bit-exact, over both;
tickets are the local path's (Attach over gRPC, good once; a bad, used or missing ticket is
refused; another tenant's ticket opens a session of that tenant, which cannot read or write
this tenant's namespaces); a plaintext connection to the TLS port gets no session; oversized,
unknown and shared-memory-only frames are answered with errors, a put whose payload cannot
be delimited closes its session; a fuzz of random and mutated frames leaves the daemon
serving with no Traceback in its log and never an INTERNAL answer. The deadlines (idle
between frames, a frame or a put's payload trickled in) are tested on DataSessions in
process, over real TCP and a real store, with short limits, as test_local_sessions_hold.py
tests the local path's; a cut put gives its reserved pages back.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import xxhash
from google.rpc import status_pb2

from kvstore.client._attach import TicketKeeper
from kvstore.client._datasocket import (
    DataSocket,
    NoSession,
    NoSessionNow,
    _DataSession,
    tls_context,
)
from kvstore.client.credentials import TLS
from kvstore.client.errors import PermissionDenied, Unavailable
from kvstore.client.sync import KVStoreClient
from kvstore.daemon.attach import Tickets
from kvstore.daemon.config import load_config
from kvstore.daemon.datasocket import DataSessions, _bind
from kvstore.daemon.datasocket import DataSocket as DaemonDataSocket
from kvstore.daemon.faults import FaultLog
from kvstore.daemon.localpath import MAX_SESSIONS_PER_CLIENT
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.store import Store
from kvstore.daemon.verbs import Verbs
from kvstore.proto.dataframe import GET_DATA, PUT_DATA, TRAILER_OK
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import CLOSING, GET, LOOKUP, RELEASE, REPLY, REQUEST, RESERVE
from kvstore.tools.testing import Daemon, start_daemon
from tests.integration.pki import Pki, make_pki
from tests.integration.test_auth import TOKENS, md, tenants_doc, write_tenants

KiB, MiB = 1024, 1024 * 1024
#: Sizes around every edge a block crosses: a byte, pages of 4 KiB and 64 KiB either side,
#: the bench's 256 KiB and 2 MiB, and one over a TCP socket buffer by an odd amount.
SIZES = [1, 7, 4095, 4096, 4097, 64 * KiB - 1, 64 * KiB + 3, 256 * KiB, 1 * MiB + 1, 2 * MiB]
SETTINGS = ("server.data_port=0", "dram.capacity_bytes=96MiB", "nvme.enabled=false")
A_NS, B_NS = "team-a/remote", "team-b/remote"
INTERNAL, UNKNOWN = grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNKNOWN.value[0]


# --- daemons -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A plaintext daemon, auth off, its data socket on a free port."""
    d = start_daemon(tmp_path_factory.mktemp("plain"), *SETTINGS)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"),
                    {"a": ("engine-a", "spiffe://cluster/ns/a/sa/engine")})


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Daemon]:
    """A daemon with auth.mode=token and TLS (team-a, team-b, root), its data socket on."""
    root = tmp_path_factory.mktemp("tls")
    tenants = write_tenants(root / "tenants.yaml", tenants_doc())
    d = start_daemon(root, *SETTINGS, "auth.mode=token", f"auth.tenants_file={tenants}",
                     f"server.tls_cert_file={pki.server_cert}",
                     f"server.tls_key_file={pki.server_key}", credentials=pki.credentials())
    yield d
    d.stop()


def limits(d: Daemon, pki: Pki | None = None) -> pb.LimitsResponse:
    channel = grpc.secure_channel(d.target, pki.credentials()) if pki else \
        grpc.insecure_channel(d.target)
    with channel:
        response: pb.LimitsResponse = rpc.KVStoreStub(channel).Limits(
            pb.LimitsRequest(), metadata=md("team-a") if pki else (), timeout=10)
    return response


def attach_fetcher(d: Daemon, pki: Pki, tenant: str) -> Any:
    """The Attach call of tenant, over TLS: what a client's TicketKeeper is given."""
    def fetch() -> pb.AttachResponse:
        with grpc.secure_channel(d.target, pki.credentials()) as channel:
            response: pb.AttachResponse = rpc.KVStoreStub(channel).Attach(
                pb.AttachRequest(), metadata=md(tenant), timeout=10)
        return response
    return fetch


def ticket(d: Daemon, pki: Pki, tenant: str) -> str:
    return str(attach_fetcher(d, pki, tenant)().ticket)


@pytest.fixture
def plain_socket(plain: Daemon) -> Iterator[DataSocket]:
    ds = DataSocket("127.0.0.1", limits(plain).data_port, TicketKeeper(), 10.0)
    yield ds
    ds.close()


def tls_socket(d: Daemon, pki: Pki, tenant: str) -> DataSocket:
    context = tls_context(str(pki.ca))
    return DataSocket("127.0.0.1", limits(d, pki).data_port,
                      TicketKeeper(attach_fetcher(d, pki, tenant)), 10.0, tls=context)


class Raw:
    """A data session written by hand, as a client in another language would: TCP (TLS
    when given a context), the line `HOT <ticket>`, the JSON hello, then frames."""

    def __init__(self, port: int, ticket: str = "-", context: ssl.SSLContext | None = None,
                 timeout_s: float = 10.0) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.s = context.wrap_socket(sock, server_hostname="127.0.0.1") if context else sock
        self.s.sendall(f"HOT {ticket}\n".encode())
        line = b""
        while not line.endswith(b"\n"):
            try:
                chunk = self.s.recv(1)
            except ConnectionResetError:  # a plaintext line on the TLS port: reset
                chunk = b""
            if not chunk:
                break
            line += chunk
        #: The daemon's answer; {} when it closed the connection instead.
        self.hello: dict[str, Any] = json.loads(line) if line else {}

    def send(self, verb: int, body: bytes, payload: bytes = b"") -> None:
        self.s.sendall(REQUEST.pack(len(body), verb) + body + payload)

    def reply(self) -> tuple[int, int, bytes]:
        length, status, flags = REPLY.unpack(self.exactly(REPLY.size))
        return status, flags, self.exactly(length)

    def exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.s.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the daemon closed the session")
            data += chunk
        return data

    def closed(self) -> bool:
        """Whether the daemon ended the session (the next read is the end of the stream)."""
        try:
            return self.s.recv(1) == b""
        except ConnectionError:
            return True

    def close(self) -> None:
        self.s.close()


def error_of(body: bytes) -> status_pb2.Status:
    return status_pb2.Status.FromString(body)


def reason_of(body: bytes) -> str:
    from google.rpc import error_details_pb2
    info = error_details_pb2.ErrorInfo()
    for detail in error_of(body).details:
        if detail.Unpack(info):
            return str(info.reason)
    return ""


def put_header(namespace: str, keys: list[bytes], sizes: list[int]) -> bytes:
    header: bytes = pb.PutRequest(namespace=namespace, keys=keys, sizes=sizes,
                                  independent=True).SerializeToString()
    return header


# --- round trips -------------------------------------------------------------------------------


def round_trip(ds: DataSocket, namespace: str) -> None:
    """Put blocks of every size, read them back both ways, bit-exact, with their checksums."""
    rng = np.random.default_rng(7)
    keys = [secrets.token_bytes(32) for _ in SIZES]
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in SIZES]
    put = ds.put(pb.PutRequest(namespace=namespace, keys=keys, sizes=SIZES, independent=True),
                 values)
    assert (put.stored, put.existing) == (len(SIZES), 0)
    again = ds.put(pb.PutRequest(namespace=namespace, keys=keys, sizes=SIZES, independent=True),
                   values)
    assert (again.stored, again.existing) == (0, len(SIZES))
    absent = secrets.token_bytes(32)
    asked = [keys[0], absent, *keys[1:]]
    fetched = ds.get(namespace, asked, verify=True)
    assert fetched.header.found_index == [0, *range(2, len(asked))]
    assert fetched.payloads == values
    assert fetched.digests == fetched.header.checksums == \
        [xxhash.xxh3_64_intdigest(v) for v in values]
    arrays = [np.full(size + 5, 0xEE, dtype=np.uint8) for size in SIZES]
    into = ds.get_into(namespace, keys, arrays, verify=False)
    assert into.digests is None and into.header.sizes == SIZES
    for array, value in zip(arrays, values, strict=True):
        assert array[:len(value)].tobytes() == value
        assert (array[len(value):] == 0xEE).all()  # nothing past the block is written


def test_round_trips_of_many_sizes_are_bit_exact(plain_socket: DataSocket) -> None:
    round_trip(plain_socket, f"rt-{os.urandom(4).hex()}")
    for _ in range(3):  # one session, reused
        round_trip(plain_socket, f"rt-{os.urandom(4).hex()}")


def test_a_reused_session_broken_unanswered_resends_a_get_never_a_put(
        plain: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's end of an idle session goes away between the client's look at it and its
    request (the look is made to miss it): a Get is asked again on a fresh session, a Put
    fails Unavailable instead (it may have been stored) and is the caller's to retry."""
    ds = DataSocket("127.0.0.1", limits(plain).data_port, TicketKeeper(), 10.0)
    try:
        ns = f"resend-{os.urandom(4).hex()}"
        keys = [secrets.token_bytes(32) for _ in range(2)]
        header = pb.PutRequest(namespace=ns, keys=keys, sizes=[3, 3], independent=True)
        assert ds.put(header, [b"abc", b"def"]).stored == 2
        monkeypatch.setattr(_DataSession, "alive", lambda self: True)

        def break_idle() -> None:
            assert ds._idle, "no pooled session to break"
            for session in ds._idle:
                session.sock.shutdown(socket.SHUT_RDWR)

        break_idle()
        assert ds.get(ns, keys, verify=True).payloads == [b"abc", b"def"]
        break_idle()
        again = pb.PutRequest(namespace=ns, keys=[secrets.token_bytes(32)], sizes=[3],
                              independent=True)
        with pytest.raises(Unavailable, match="data session broke"):
            ds.put(again, [b"ghi"])
        assert ds.put(again, [b"ghi"]).stored == 1  # on a fresh session, stored once
    finally:
        ds.close()


def test_round_trips_over_tls_with_attach_tickets(tls: Daemon, pki: Pki) -> None:
    ds = tls_socket(tls, pki, "team-a")
    try:
        round_trip(ds, A_NS + "/" + os.urandom(4).hex())
    finally:
        ds.close()


def test_many_threads_share_one_data_socket(plain_socket: DataSocket) -> None:
    """Eight threads put and read their own blocks at once through one pooled DataSocket:
    every byte each reads back is its own."""
    ns = f"threads-{os.urandom(4).hex()}"
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(15):
                sizes = [rng.choice(SIZES[:8]) for _ in range(rng.randrange(1, 6))]
                keys = [secrets.token_bytes(32) for _ in sizes]
                values = [rng.randbytes(size) for size in sizes]
                put = plain_socket.put(pb.PutRequest(namespace=ns, keys=keys, sizes=sizes,
                                                     independent=True), values)
                assert put.stored == len(sizes)
                assert plain_socket.get(ns, keys, verify=True).payloads == values
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures


def test_limits_offer_the_port_only_when_it_is_on(plain: Daemon,
                                                  tmp_path: Path) -> None:
    assert limits(plain).data_port > 0
    off = start_daemon(tmp_path, "dram.capacity_bytes=16MiB", "nvme.enabled=false")
    try:
        assert limits(off).data_port == 0
    finally:
        off.stop()


def test_a_client_with_no_data_socket_falls_back(plain: Daemon) -> None:
    """Nothing listens: the call is refused for now (NoSessionNow), so the client's caller
    moves it over gRPC, and the path is paused rather than tried on every call."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    ds = DataSocket("127.0.0.1", dead_port, TicketKeeper(), 2.0)
    with pytest.raises(NoSessionNow):
        ds.get("ns", [bytes(32)], verify=True)
    assert not ds.ready()  # paused: the next calls go straight to gRPC


# --- through a client --------------------------------------------------------------------------


def test_through_a_client_and_back_to_grpc(plain: Daemon, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    ns = f"client-{os.urandom(4).hex()}"
    keys = [secrets.token_bytes(32) for _ in SIZES]
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in SIZES]
    with KVStoreClient(plain.target, ns, shared_memory=False) as kv:
        assert kv.put(keys, values, independent=True).stored == len(SIZES)
        assert kv.get(keys) == values
        arrays = [np.zeros(size, dtype=np.uint8) for size in SIZES]
        assert kv.get_into(keys, arrays) == SIZES
        assert [a.tobytes() for a in arrays] == values
        assert kv.uses_data_socket
    off = start_daemon(tmp_path, "dram.capacity_bytes=16MiB", "nvme.enabled=false")
    try:  # no data socket offered: every call over gRPC, the same answers
        with KVStoreClient(off.target, ns, shared_memory=False) as kv:
            assert kv.put(keys[:3], values[:3], independent=True).stored == 3
            assert kv.get(keys[:3]) == values[:3]
            assert not kv.uses_data_socket
    finally:
        off.stop()


def test_through_a_client_over_tls_with_a_token(tls: Daemon, pki: Pki) -> None:
    key, value = secrets.token_bytes(32), os.urandom(300 * KiB)
    with KVStoreClient(tls.target, A_NS + "/client", shared_memory=False,
                       token=TOKENS["team-a"], tls=TLS(ca_file=str(pki.ca))) as kv:
        assert kv.put([key], [value]).stored == 1
        assert kv.get([key]) == [value]
        assert kv.uses_data_socket


# --- tickets, TLS and tenants ------------------------------------------------------------------


def test_bad_used_and_missing_tickets_are_refused(tls: Daemon, pki: Pki) -> None:
    port = limits(tls, pki).data_port
    context = tls_context(str(pki.ca))
    for bad in ("-", "not-a-ticket", secrets.token_urlsafe(32)):
        raw = Raw(port, bad, context)
        assert raw.hello.get("reason") == "UNAUTHENTICATED", raw.hello
        assert raw.closed()
        raw.close()
    good = ticket(tls, pki, "team-a")
    first = Raw(port, good, context)
    assert first.hello["hot"]["version"] == 1
    second = Raw(port, good, context)  # good once
    assert second.hello.get("reason") == "UNAUTHENTICATED"
    first.close()
    second.close()


def test_plaintext_and_untrusted_tls_get_no_session(tls: Daemon, pki: Pki,
                                                    tmp_path: Path) -> None:
    port = limits(tls, pki).data_port
    raw = Raw(port, ticket(tls, pki, "team-a"), timeout_s=5)  # no TLS
    assert raw.hello == {}
    raw.close()
    other = make_pki(tmp_path, {})  # a CA the daemon's certificate is not from
    ds = DataSocket("127.0.0.1", port, TicketKeeper(attach_fetcher(tls, pki, "team-a")), 5.0,
                    tls=tls_context(str(other.ca)))
    with pytest.raises(NoSession) as refused:
        ds.get(A_NS, [bytes(32)], verify=True)
    assert not isinstance(refused.value, NoSessionNow)  # for good: gRPC from then on


def test_mtls_needs_a_client_certificate_on_the_data_port(tmp_path: Path, pki: Pki) -> None:
    """With auth.mode=mtls the data port asks for a client certificate, as the gRPC port
    does: TLS without one gets no session; with one, Attach (over the certificate) gives
    the ticket and the session is that tenant's."""
    tenants = write_tenants(tmp_path / "mtls.yaml", tenants_doc(
        a_identities=("spiffe://cluster/ns/a/sa/engine",)))
    d = start_daemon(tmp_path, *SETTINGS, "auth.mode=mtls", f"auth.tenants_file={tenants}",
                     f"server.tls_cert_file={pki.server_cert}",
                     f"server.tls_key_file={pki.server_key}",
                     f"server.tls_client_ca_file={pki.ca}", credentials=pki.credentials("a"))
    try:
        with grpc.secure_channel(d.target, pki.credentials("a")) as channel:
            stub = rpc.KVStoreStub(channel)
            port = stub.Limits(pb.LimitsRequest(), timeout=10).data_port

            def attach() -> pb.AttachResponse:
                response: pb.AttachResponse = stub.Attach(pb.AttachRequest(), timeout=10)
                return response

            bare = DataSocket("127.0.0.1", port, TicketKeeper(attach), 5.0,
                              tls=tls_context(str(pki.ca)))
            with pytest.raises(NoSession):
                bare.get(A_NS, [bytes(32)], verify=True)
            cert, key = pki.clients["a"]
            ds = DataSocket("127.0.0.1", port, TicketKeeper(attach), 5.0,
                            tls=tls_context(str(pki.ca), str(cert), str(key)))
            block = os.urandom(70000)
            assert ds.put(pb.PutRequest(namespace=A_NS, keys=[bytes(32)], sizes=[70000]),
                          [block]).stored == 1
            assert ds.get(A_NS, [bytes(32)], verify=True).payloads == [block]
            with pytest.raises(PermissionDenied):
                ds.get(B_NS, [bytes(32)], verify=True)
            ds.close()
    finally:
        d.stop()
    assert "Traceback" not in d.log()


def test_a_tenant_cannot_read_or_write_anothers_keys(tls: Daemon, pki: Pki) -> None:
    a = tls_socket(tls, pki, "team-a")
    b = tls_socket(tls, pki, "team-b")
    try:
        key, value = secrets.token_bytes(32), b"secret of a " * 1000
        assert a.put(pb.PutRequest(namespace=A_NS, keys=[key], sizes=[len(value)]),
                     [value]).stored == 1
        with pytest.raises(PermissionDenied):
            b.get(A_NS, [key], verify=True)
        with pytest.raises(PermissionDenied):
            b.put(pb.PutRequest(namespace=A_NS, keys=[secrets.token_bytes(32)], sizes=[5]),
                  [b"bogus"])
        # Both sessions are still in step after their refusals (the put's payload was read
        # and dropped), and team-b's own namespace is its own.
        assert b.put(pb.PutRequest(namespace=B_NS, keys=[key], sizes=[3]), [b"bbb"]).stored == 1
        assert a.get(A_NS, [key], verify=True).payloads == [value]
        assert b.get(B_NS, [key], verify=True).payloads == [b"bbb"]
    finally:
        a.close()
        b.close()
    # A raw session on team-b's ticket, asking by hand for team-a's key: denied, by name.
    raw = Raw(limits(tls, pki).data_port, ticket(tls, pki, "team-b"),
              tls_context(str(pki.ca)))
    raw.send(GET_DATA, pb.GetRequest(namespace=A_NS, keys=[key]).SerializeToString())
    status, _, body = raw.reply()
    assert status == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert A_NS in error_of(body).message
    raw.close()


# --- hostile frames ----------------------------------------------------------------------------


def test_oversized_unknown_and_shared_memory_frames(plain: Daemon) -> None:
    port = limits(plain).data_port
    raw = Raw(port)
    max_frame = raw.hello["hot"]["max_frame_bytes"]
    # Over max_frame_bytes: read and dropped, answered MESSAGE_TOO_LARGE, the session goes on.
    raw.send(LOOKUP, bytes(max_frame + 1))
    status, flags, body = raw.reply()
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert reason_of(body) == "MESSAGE_TOO_LARGE" and not flags & CLOSING
    for verb in (GET, RESERVE, 4, 6, 7, 99):  # the local path's shared-memory verbs, others
        raw.send(verb, b"")
        status, flags, body = raw.reply()
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0], verb
        assert "not a data-socket verb" in error_of(body).message
    raw.send(GET_DATA, pb.GetRequest(namespace="x", keys=[bytes(32)],
                                     mode=pb.GET_MODE_SHARED_MEMORY).SerializeToString())
    status, _, body = raw.reply()
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # A put whose payload is over server.max_response_bytes cannot be read on: it is
    # answered with the closing flag, and the session ends.
    raw.send(PUT_DATA, put_header("x", [bytes(32)], [1 << 40]))
    status, flags, body = raw.reply()
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and flags & CLOSING
    assert raw.closed()
    raw.close()
    raw = Raw(port)  # nor can one whose header does not parse
    raw.send(PUT_DATA, b"\xff\xff\xff")
    status, flags, _ = raw.reply()
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and flags & CLOSING
    assert raw.closed()
    raw.close()


def test_a_refused_put_keeps_its_session_in_step(plain: Daemon) -> None:
    raw = Raw(limits(plain).data_port)
    payload = os.urandom(10000)
    raw.send(PUT_DATA, pb.PutRequest(namespace="x", keys=[bytes(32)], sizes=[10000],
                                     reservation_id="r").SerializeToString(), payload)
    status, flags, body = raw.reply()
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not flags & CLOSING
    key = secrets.token_bytes(32)
    raw.send(PUT_DATA, put_header("in-step", [key], [10000]), payload)
    status, _, body = raw.reply()
    assert status == 0 and pb.PutResponse.FromString(body).stored == 1
    raw.send(GET_DATA, pb.GetRequest(namespace="in-step", keys=[key]).SerializeToString())
    status, _, body = raw.reply()
    assert status == 0 and list(pb.GetResponse.FromString(body).sizes) == [10000]
    assert raw.exactly(10000) == payload and raw.exactly(1) == bytes([TRAILER_OK])
    raw.close()


def fuzz_frames(rng: random.Random) -> Iterator[tuple[int, bytes]]:
    """Random verbs and bodies, and valid messages with bytes flipped, cut or extended."""
    valid = [
        (GET_DATA, pb.GetRequest(namespace="fuzz", keys=[bytes(32), b"\x01" * 32])),
        (PUT_DATA, pb.PutRequest(namespace="fuzz", keys=[b"\x02" * 32], sizes=[16])),
        (LOOKUP, pb.LookupRequest(namespace="fuzz", keys=[bytes(32)])),
        (RELEASE, pb.ReleaseRequest(ids=["nope"])),
    ]
    for _ in range(400):
        if rng.random() < 0.4:
            verb = rng.choice([GET_DATA, PUT_DATA, LOOKUP, RELEASE, rng.randrange(256)])
            yield verb, rng.randbytes(rng.choice([0, 1, 5, 40, 300, 5000]))
            continue
        verb, message = rng.choice(valid)
        body = bytearray(message.SerializeToString())
        for _ in range(rng.randrange(1, 4)):
            what = rng.random()
            if what < 0.5 and body:
                body[rng.randrange(len(body))] = rng.randrange(256)
            elif what < 0.75:
                del body[rng.randrange(len(body) + 1):]
            else:
                body += rng.randbytes(rng.randrange(1, 20))
        yield verb, bytes(body)


def test_a_fuzz_of_random_frames(plain: Daemon, plain_socket: DataSocket) -> None:
    """Every frame is answered with a status that is not INTERNAL or UNKNOWN, or ends its
    session (a put whose payload never comes waits for it, and is cut); the daemon serves
    on, with no Traceback in its log."""
    port = limits(plain).data_port
    rng = random.Random(36)
    raw = Raw(port, timeout_s=0.5)
    answered = ended = 0
    for verb, body in fuzz_frames(rng):
        try:
            raw.send(verb, body)
            status, flags, reply = raw.reply()
        except (OSError, ConnectionError):
            ended += 1
            raw.close()
            raw = Raw(port, timeout_s=0.5)
            continue
        answered += 1
        assert status not in (INTERNAL, UNKNOWN), error_of(reply)
        if status:
            error_of(reply)  # a google.rpc.Status
        if verb == GET_DATA and status == 0:
            sizes = pb.GetResponse.FromString(reply).sizes
            raw.exactly(sum(sizes) + 1)
        if flags & CLOSING:
            raw.close()
            raw = Raw(port, timeout_s=0.5)
    raw.close()
    assert answered > 200 and ended < 100, (answered, ended)
    round_trip(plain_socket, f"after-fuzz-{os.urandom(4).hex()}")
    assert plain.proc.poll() is None
    assert "Traceback" not in plain.log()


# --- the deadlines, in process -------------------------------------------------------------

#: The in-process sessions' limits: a frame whole within FRAME_S, a session idle IDLE_S
#: between frames closed.
FRAME_S, IDLE_S = 0.4, 0.6


@pytest.fixture(scope="module")
def in_process() -> Iterator[tuple[Store, int]]:
    """DataSessions over a real store (4 MiB of L2, auth off) with short deadlines, and
    their listener on a free TCP port."""
    config = load_config(env={}, overrides=[
        "nvme.enabled=false", "dram.capacity_bytes=4MiB", "dram.page_size_bytes=64KiB",
        "dram.pin_memory=false", "server.port=0", "server.data_port=0"])
    store = Store(config)
    sessions = DataSessions(Verbs(store), store.auth, Tickets(), Metrics(), FaultLog(),
                            threading.Event(), config.server.max_message_bytes,
                            frame_timeout_s=FRAME_S, idle_limit_s=IDLE_S)
    listener = DaemonDataSocket(config, sessions, _bind("127.0.0.1", 0))
    listener.start()
    yield store, listener.port
    listener.close()
    sessions.close()
    store.close()


def cut_after(raw: Raw, data: bytes, every_s: float = 0.05) -> float:
    """Trickle data a byte at a time until the daemon ends the session: seconds it took."""
    started = time.monotonic()
    for b in data:
        try:
            raw.s.sendall(bytes([b]))
        except OSError:
            break
        time.sleep(every_s)
        if time.monotonic() - started > 5:
            break
    raw.s.settimeout(max(0.1, 5 - (time.monotonic() - started)))
    assert raw.closed(), "the daemon waited out a frame slower than its deadline"
    return time.monotonic() - started


def test_an_idle_session_is_closed(in_process: tuple[Store, int]) -> None:
    _, port = in_process
    raw = Raw(port)
    started = time.monotonic()
    assert raw.closed()
    assert IDLE_S * 0.9 <= time.monotonic() - started < IDLE_S + 2


@pytest.mark.parametrize("frame", [
    pytest.param(REQUEST.pack(40, LOOKUP)[:3], id="header"),
    pytest.param(REQUEST.pack(40, LOOKUP) + bytes(20), id="body"),
])
def test_a_truncated_frame_is_cut_at_its_deadline(in_process: tuple[Store, int],
                                                  frame: bytes) -> None:
    _, port = in_process
    raw = Raw(port)
    took_s = cut_after(raw, frame + bytes(100))
    assert took_s < FRAME_S + 2


def test_a_truncated_put_gives_its_pages_back(in_process: tuple[Store, int]) -> None:
    store, port = in_process
    size = 256 * KiB
    raw = Raw(port)
    raw.send(PUT_DATA, put_header("cut", [secrets.token_bytes(32)], [size]), bytes(size // 2))
    # The payload's deadline is the frame's, extended for its size; then the session is cut.
    raw.s.settimeout(FRAME_S + 3)
    assert raw.closed()
    assert store.stats().reservations == 0
    raw.close()
    raw = Raw(port)  # and a whole one after it is stored
    key = secrets.token_bytes(32)
    raw.send(PUT_DATA, put_header("cut", [key], [size]), bytes(range(256)) * (size // 256))
    status, _, body = raw.reply()
    assert status == 0 and pb.PutResponse.FromString(body).stored == 1
    raw.close()


def test_a_put_checksum_that_does_not_match_is_refused(in_process: tuple[Store, int]) -> None:
    store, port = in_process
    raw = Raw(port)
    payload = os.urandom(5000)
    header = pb.PutRequest(namespace="sums", keys=[secrets.token_bytes(32)], sizes=[5000],
                           checksums=[xxhash.xxh3_64_intdigest(payload) ^ 1])
    raw.send(PUT_DATA, header.SerializeToString(), payload)
    status, flags, body = raw.reply()
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not flags & CLOSING
    assert reason_of(body) == "CHECKSUM_MISMATCH"
    assert store.stats().reservations == 0
    header.checksums[0] ^= 1
    raw.send(PUT_DATA, header.SerializeToString(), payload)
    status, _, body = raw.reply()
    assert status == 0 and pb.PutResponse.FromString(body).stored == 1
    raw.close()


def test_pending_handshakes_are_capped(in_process: tuple[Store, int]) -> None:
    """Silent connections hold handshakes up to the per-address cap; one more is closed at
    once, and a real handshake goes through again once they leave."""
    store, _ = in_process
    config = load_config(env={}, overrides=["server.port=0", "server.data_port=0"])
    sessions = DataSessions(Verbs(store), store.auth, Tickets(), Metrics(), FaultLog(),
                            threading.Event(), config.server.max_message_bytes)
    listener = DaemonDataSocket(config, sessions, _bind("127.0.0.1", 0),
                                exchange_timeout_s=5.0, max_pending_per_peer=3)
    listener.start()
    silent = [socket.create_connection(("127.0.0.1", listener.port), timeout=5)
              for _ in range(3)]
    try:
        deadline = time.monotonic() + 5
        while listener.pending < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.pending == 3
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as extra:
            try:
                extra.sendall(b"HOT -\n")
                answer = extra.recv(100)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # closed unanswered
        for s in silent:
            s.close()
        while listener.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Raw(listener.port).hello["hot"]["version"] == 1
    finally:
        for s in silent:
            s.close()
        listener.close()
        sessions.close()


def test_sessions_past_the_per_client_cap(in_process: tuple[Store, int]) -> None:
    """One client (auth off: one address) holds at most MAX_SESSIONS_PER_CLIENT sessions: one
    more is refused TOO_MANY_SESSIONS while all are busy, and admitted once one has been idle
    for reap_idle_s, by closing that one, as on the Unix socket."""
    store, _ = in_process
    config = load_config(env={}, overrides=["server.port=0", "server.data_port=0"])
    sessions = DataSessions(Verbs(store), store.auth, Tickets(), Metrics(), FaultLog(),
                            threading.Event(), config.server.max_message_bytes,
                            idle_limit_s=30.0, reap_idle_s=0.5)
    listener = DaemonDataSocket(config, sessions, _bind("127.0.0.1", 0))
    listener.start()
    held: list[Raw] = []
    try:
        for _ in range(MAX_SESSIONS_PER_CLIENT):
            held.append(Raw(listener.port))
            assert held[-1].hello["hot"]["version"] == 1
        assert sessions.open_sessions == MAX_SESSIONS_PER_CLIENT
        refused = Raw(listener.port)
        assert refused.hello.get("reason") == "TOO_MANY_SESSIONS", refused.hello
        refused.close()
        time.sleep(0.7)  # every held session idle past reap_idle_s
        admitted = Raw(listener.port)
        assert admitted.hello["hot"]["version"] == 1
        # One held session made room: the least recently active by the daemon's clock, which
        # is the one whose serving thread began waiting first (not always the first opened:
        # on a loaded machine the threads start in any order).
        ready, _, _ = select.select([raw.s for raw in held], [], [], 5.0)
        closed = [raw for raw in held if raw.s in ready and raw.closed()]
        assert len(closed) == 1, f"{len(closed)} held sessions closed"
        assert sessions.open_sessions == MAX_SESSIONS_PER_CLIENT
        admitted.close()
    finally:
        for raw in held:
            raw.close()
        listener.close()
        sessions.close()


def test_the_handshake_must_come_in_time(in_process: tuple[Store, int]) -> None:
    """A connection that sends no line is closed by the exchange deadline; one that sends
    something else than HOT is refused."""
    _, port = in_process
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GIMME\n")
        assert b"UNAUTHENTICATED" in s.recv(4096)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        started = time.monotonic()
        s.sendall(b"HOT")
        line = s.recv(4096)
        assert b"no ticket line" in line, line
        assert time.monotonic() - started < 5



def test_the_daemons_logged_no_unexpected_error(plain: Daemon, tls: Daemon) -> None:
    """Run last: nothing any test here sent made a session end by an unexpected error."""
    for d in (plain, tls):
        assert d.proc.poll() is None
        log = d.log()
        assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
