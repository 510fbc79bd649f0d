"""The local path (a real daemon with a Unix socket, the real client, and a raw socket): the
hot verbs over the socket answer exactly as over gRPC, the client uses it by itself and falls
back to gRPC when it cannot, hostile frames get errors and never hurt the daemon, tenants stay
apart, and the writer's checksums are checked and carried end to end."""

from __future__ import annotations

import json
import re
import secrets
import socket
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import COMMIT, GET, LOOKUP, RESERVE
from kvstore.tools.testing import Daemon, start_daemon
from tests.integration.test_auth import A_NS, B_NS, TOKENS, md, tenants_doc, write_tenants

NS = "local"
MiB = 1 << 20


def keys(n: int) -> list[bytes]:
    return [secrets.token_bytes(32) for _ in range(n)]


def metric(daemon: Daemon, name: str, method: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read()
    label = f'{{method="{method}"}}' if method else ""
    found = re.search(rf"^{name}{re.escape(label)} (\S+)$", text.decode(), re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path, f"server.unix_socket={tmp_path / 'kv.sock'}",
                     "dram.capacity_bytes=64MiB", "nvme.enabled=false",
                     "dram.verify_commits=all")
    yield d
    d.stop()


def sock_of(daemon: Daemon) -> str:
    return next(a.split("=", 1)[1] for a in daemon.proc.args  # type: ignore[union-attr]
                if isinstance(a, str) and a.startswith("server.unix_socket="))


class Raw:
    """A hand-framed local session, as a client in another language would write one."""

    def __init__(self, path: str, ticket: str = "-") -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect(path)
        self.s.sendall(f"HOT {ticket}\n".encode())
        line = b""
        while not line.endswith(b"\n"):
            chunk = self.s.recv(1)
            if not chunk:
                break
            line += chunk
        self.hello = json.loads(line) if line else {}

    def send(self, verb: int, body: bytes) -> None:
        self.s.sendall(struct.pack("<IB", len(body), verb) + body)

    def reply(self) -> tuple[int, int, bytes]:
        head = self._exactly(6)
        length, status, flags = struct.unpack("<IBB", head)
        return status, flags, self._exactly(length)

    def call(self, verb: int, message: object) -> tuple[int, bytes]:
        self.send(verb, message.SerializeToString())  # type: ignore[attr-defined]
        status, _, body = self.reply()
        return status, body

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.s.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def close(self) -> None:
        self.s.close()


def test_the_client_moves_hot_verbs_over_the_socket_and_the_bytes_round_trip(
        daemon: Daemon) -> None:
    rng = np.random.default_rng(1)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for size in (3 * MiB, 1, 70_000)]
    ks = keys(3)
    with KVStoreClient(daemon.target, NS) as kv:
        assert kv.put(ks, blocks).stored == 3
        assert kv._shm.local is not None  # opened with the shared memory
        assert kv.lookup(ks).prefix_length == 3
        out = [np.zeros(b.size, np.uint8) for b in blocks]
        assert kv.get_into(ks, out) == [b.size for b in blocks]
        assert all(np.array_equal(a, b) for a, b in zip(out, blocks, strict=True))
        assert kv.get([*ks, keys(1)[0]]) == [b.tobytes() for b in blocks] + [None]
    for method in ("Reserve", "Put", "Get", "Lookup"):
        assert metric(daemon, "kvstore_local_requests_total", method) >= 1, method
    # What went over the socket is what gRPC serves: an inline reader sees the same bytes.
    with KVStoreClient(daemon.target, NS, shared_memory=False) as inline:
        assert inline.get(ks) == [b.tobytes() for b in blocks]


def test_a_reader_without_checksums_posts_its_release_and_holds_no_lease(
        daemon: Daemon) -> None:
    ks = keys(4)
    with KVStoreClient(daemon.target, NS, verify_checksums=False) as kv:
        kv.put(ks, [b"v" * 5000] * 4)
        for _ in range(3):
            assert kv.get(ks) == [b"v" * 5000] * 4  # leased, released without a wait
        kv.lookup(ks)  # the session reads the posted Release's answer before this one
        assert kv.stats().leases == 0
    assert metric(daemon, "kvstore_local_requests_total", "Release") >= 3


def test_the_writers_checksums_are_checked_and_a_lie_frees_the_reservation(
        daemon: Daemon) -> None:
    raw = Raw(sock_of(daemon))
    ks = keys(2)
    status, body = raw.call(RESERVE, pb.ReserveRequest(namespace=NS, keys=ks, sizes=[10, 20]))
    assert status == 0
    reserved = pb.ReserveResponse.FromString(body)
    # Nothing written and a made-up checksum: dram.verify_commits=all reads every block.
    status, body = raw.call(COMMIT, pb.PutRequest(
        namespace=NS, reservation_id=reserved.reservation_id, checksums=[1, 2]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"checksums[0] does not match" in body and b"freed" in body
    status, body = raw.call(LOOKUP, pb.LookupRequest(namespace=NS, keys=ks))
    assert status == 0 and pb.LookupResponse.FromString(body).prefix_length == 0
    status, body = raw.call(COMMIT, pb.PutRequest(  # and the reservation is gone
        namespace=NS, reservation_id=reserved.reservation_id, checksums=[1, 2]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"unknown" in body
    status, body = raw.call(RESERVE, pb.ReserveRequest(namespace=NS, keys=ks, sizes=[10, 20]))
    reserved = pb.ReserveResponse.FromString(body)
    status, body = raw.call(COMMIT, pb.PutRequest(  # one per key, or the commit is refused
        namespace=NS, reservation_id=reserved.reservation_id, checksums=[1]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"checksums: 1 values for the 2 keys" in body
    raw.close()


def test_unchecked_lying_checksums_reach_readers_who_see_a_miss(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, f"server.unix_socket={tmp_path / 'kv.sock'}",
                     "dram.capacity_bytes=16MiB", "nvme.enabled=false",
                     "dram.verify_commits=none")
    try:
        raw = Raw(sock_of(d))
        k = keys(1)
        _, body = raw.call(RESERVE, pb.ReserveRequest(namespace=NS, keys=k, sizes=[100]))
        reserved = pb.ReserveResponse.FromString(body)
        status, _ = raw.call(COMMIT, pb.PutRequest(
            namespace=NS, reservation_id=reserved.reservation_id, checksums=[12345]))
        assert status == 0  # not checked here ...
        with KVStoreClient(d.target, NS) as kv:
            assert kv.get(k) == [None]  # ... but end to end: the reader's check catches it
        raw.close()
    finally:
        d.stop()


def test_the_default_sample_catches_a_lie_in_a_one_block_commit(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, f"server.unix_socket={tmp_path / 'kv.sock'}",
                     "dram.capacity_bytes=16MiB", "nvme.enabled=false")  # verify: sample
    try:
        raw = Raw(sock_of(d))
        _, body = raw.call(RESERVE, pb.ReserveRequest(namespace=NS, keys=keys(1), sizes=[64]))
        reserved = pb.ReserveResponse.FromString(body)
        status, body = raw.call(COMMIT, pb.PutRequest(
            namespace=NS, reservation_id=reserved.reservation_id, checksums=[99]))
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"checksums[0]" in body
        raw.close()
    finally:
        d.stop()


def test_hostile_frames_get_errors_and_the_daemon_serves_on(daemon: Daemon) -> None:
    path = sock_of(daemon)
    raw = Raw(path)
    assert raw.hello["hot"]["version"] == 1 and raw.hello["hot"]["max_frame_bytes"] > 0
    status, body = raw.call(9, pb.LookupRequest())
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"verb 9" in body
    raw.send(LOOKUP, b"\xff\xff\xff")  # not a LookupRequest
    status, _, body = raw.reply()
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    status, body = raw.call(LOOKUP, pb.LookupRequest(namespace=NS, keys=[b"short"]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"keys[0]" in body
    status, body = raw.call(GET, pb.GetRequest(namespace=NS, keys=keys(1)))  # inline
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"SHARED_MEMORY" in body
    status, body = raw.call(COMMIT, pb.PutRequest(namespace=NS, keys=keys(1), sizes=[1]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"reservation" in body
    raw.s.sendall(struct.pack("<IB", 1 << 30, LOOKUP) + b"x" * 1000)  # over the limit
    raw.s.shutdown(socket.SHUT_WR)  # and never the rest of it
    raw.close()
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbage.connect(path)
    garbage.sendall(b"\x00" * 300)  # no handshake line at all
    garbage.close()
    with KVStoreClient(daemon.target, NS) as kv:  # the daemon serves on
        kv.put(keys(1), [b"ok"])
        assert kv._shm.local is not None
    ok = Raw(path)
    status, body = ok.call(LOOKUP, pb.LookupRequest(namespace=NS, keys=keys(2)))
    assert status == 0 and list(pb.LookupResponse.FromString(body).tiers) == [0, 0]
    ok.close()


def test_sessions_per_client_are_capped(daemon: Daemon) -> None:
    from kvstore.daemon.localpath import MAX_SESSIONS_PER_CLIENT
    sessions = [Raw(sock_of(daemon)) for _ in range(MAX_SESSIONS_PER_CLIENT)]
    try:
        assert all("hot" in s.hello for s in sessions)
        refused = Raw(sock_of(daemon))
        assert "at most" in refused.hello["error"]
        refused.close()
    finally:
        for s in sessions:
            s.close()


def test_a_daemon_without_a_socket_leaves_the_client_on_grpc(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "dram.capacity_bytes=16MiB", "nvme.enabled=false")
    try:
        with KVStoreClient(d.target, NS, unix_socket=str(tmp_path / "nobody.sock")) as kv:
            kv.put(keys(1), [b"x"])
            assert kv.uses_shared_memory and kv._shm.local is None
    finally:
        d.stop()


def test_the_daemon_closing_sessions_makes_calls_retry_not_fail(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    d = start_daemon(tmp_path, f"server.unix_socket={path}", "dram.capacity_bytes=16MiB",
                     "nvme.enabled=false")
    try:
        with KVStoreClient(d.target, NS) as kv:
            ks = keys(2)
            kv.put(ks, [b"a", b"b"])
            local = kv._shm.local
            assert local is not None
            for session in local._idle:  # the daemon side goes away under idle sessions
                session.sock.shutdown(socket.SHUT_RDWR)
            assert kv.get(ks) == [b"a", b"b"]  # one broken session: retried on a new one
    finally:
        d.stop()


@pytest.fixture
def tenant_daemon(tmp_path: Path) -> Iterator[Daemon]:
    tenants = write_tenants(tmp_path / "tenants.yaml", tenants_doc())
    d = start_daemon(tmp_path, "auth.mode=token", f"auth.tenants_file={tenants}",
                     f"server.unix_socket={tmp_path / 'kv.sock'}", "dram.capacity_bytes=32MiB",
                     "nvme.enabled=false")
    yield d
    d.stop()


def test_sessions_need_a_ticket_and_stay_in_their_tenant(tenant_daemon: Daemon) -> None:
    path = sock_of(tenant_daemon)
    assert "ticket" in Raw(path, "-").hello["error"]
    assert "ticket" in Raw(path, "forged-ticket").hello["error"]
    with grpc.insecure_channel(tenant_daemon.target) as channel:
        stub = rpc.KVStoreStub(channel)
        ticket = stub.Attach(pb.AttachRequest(), metadata=md("team-a")).ticket
        a = Raw(path, ticket)
        assert "hot" in a.hello
        assert "ticket" in Raw(path, ticket).hello["error"]  # good once
        k = keys(1)
        status, body = a.call(LOOKUP, pb.LookupRequest(namespace=A_NS, keys=k))
        assert status == 0
        for verb, message in ((LOOKUP, pb.LookupRequest(namespace=B_NS, keys=k)),
                              (RESERVE, pb.ReserveRequest(namespace=B_NS, keys=k, sizes=[1])),
                              (GET, pb.GetRequest(namespace=B_NS, keys=k,
                                                  mode=pb.GET_MODE_SHARED_MEMORY))):
            status, body = a.call(verb, message)
            assert status == grpc.StatusCode.PERMISSION_DENIED.value[0], (verb, body)
        a.close()
    with KVStoreClient(tenant_daemon.target, A_NS, token=TOKENS["team-a"]) as kv:
        kv.put(k, [b"mine"])
        assert kv._shm.local is not None and kv.get(k) == [b"mine"]
    with KVStoreClient(tenant_daemon.target, A_NS, token=TOKENS["team-b"]) as other:
        with pytest.raises(Exception, match="namespace"):
            other.get(k)


def test_a_commit_over_grpc_checks_the_writers_checksums_too(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.target) as channel:
        stub = rpc.KVStoreStub(channel)
        k = keys(1)
        reserved = stub.Reserve(pb.ReserveRequest(namespace=NS, keys=k, sizes=[8]))
        with pytest.raises(grpc.RpcError) as failed:
            stub.Put(iter([pb.PutRequest(namespace=NS, reservation_id=reserved.reservation_id,
                                         checksums=[7])]))
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as inline:  # an inline put carries none
            stub.Put(iter([pb.PutRequest(namespace=NS, keys=k, sizes=[1], data=b"x",
                                         checksums=[7])]))
        assert "checksums" in (inline.value.details() or "")
    with KVStoreClient(daemon.target, NS, shared_memory=True) as kv:  # the real writer's pass
        kv.put(k, [b"12345678"])
        assert kv.get(k) == [b"12345678"]
