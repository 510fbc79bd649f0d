"""The local path (a real daemon with a Unix socket, the real client, and a raw socket): the
hot verbs over the socket answer exactly as over gRPC, the client uses it by itself and falls
back to gRPC when it cannot, hostile frames get errors and never hurt the daemon, tenants stay
apart, and the writer's checksums are checked and carried end to end."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import COMMIT, GET, LOOKUP, RESERVE
from kvstore.tools.testing import Daemon
from tests.conftest import DEFAULT_SETTINGS
from tests.helpers import MiB, RawSession, keys, metric, wait_until
from tests.integration.test_auth import A_NS, B_NS, TOKENS, md
from tests.integration.test_tenant_shm import evict_everything, token_daemon


def local_requests(daemon: Daemon, method: str) -> float:
    """Calls of `method` the daemon has answered over its Unix socket so far."""
    return metric(daemon, "kvstore_local_requests_total", method=method)


#: The local-path daemon's settings (test_local_sessions_hold.py shares it): it checks every
#: writer's checksums, and its 4 KiB pages hold thousands of small blocks.
LOCAL_SETTINGS = ("dram.capacity_bytes=64MiB", "dram.page_size_bytes=4KiB",
                  "nvme.enabled=false", "dram.verify_commits=all")


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The session's local-path daemon (LOCAL_SETTINGS): its counts of calls are read as
    deltas, and each test releases what it leased."""
    return shared_daemon(*LOCAL_SETTINGS, unix_socket=True)


def sock_of(daemon: Daemon) -> str:
    assert daemon.unix_socket is not None, "the daemon has no local path"
    return str(daemon.unix_socket)


def test_the_client_moves_hot_verbs_over_the_socket_and_the_bytes_round_trip(
        daemon: Daemon, ns: str) -> None:
    hot = ("Reserve", "Put", "Get", "Lookup")
    before = {method: local_requests(daemon, method) for method in hot}
    rng = np.random.default_rng(1)
    blocks = [rng.integers(0, 256, size, dtype=np.uint8) for size in (3 * MiB, 1, 70_000)]
    ks = keys(3)
    # read_table=False: every Lookup and Get goes over the socket (the read table's own
    # path is test_table_reads.py's).
    with KVStoreClient(daemon.target, ns, read_table=False) as kv:
        assert not kv.uses_local_path  # nothing decided before the first data call
        assert kv.put(ks, blocks).stored == 3
        assert kv.uses_local_path  # opened with the shared memory
        assert kv.lookup(ks).prefix_length == 3
        out = [np.zeros(b.size, np.uint8) for b in blocks]
        assert kv.get_into(ks, out) == [b.size for b in blocks]
        assert all(np.array_equal(a, b) for a, b in zip(out, blocks, strict=True))
        assert kv.get([*ks, keys(1)[0]]) == [b.tobytes() for b in blocks] + [None]
    for method in hot:
        assert local_requests(daemon, method) > before[method], method
    # What went over the socket is what gRPC serves: an inline reader sees the same bytes.
    with KVStoreClient(daemon.target, ns, shared_memory=False) as inline:
        assert inline.get(ks) == [b.tobytes() for b in blocks]


def test_a_reader_without_checksums_posts_its_release_and_holds_no_lease(
        daemon: Daemon, ns: str) -> None:
    released = local_requests(daemon, "Release")
    ks = keys(4)
    with KVStoreClient(daemon.target, ns, verify_checksums=False, read_table=False) as kv:
        kv.put(ks, [b"v" * 5000] * 4)
        for _ in range(3):
            assert kv.get(ks) == [b"v" * 5000] * 4  # leased, released without a wait
        kv.lookup(ks)  # the session reads the posted Release's answer before this one
        assert kv.stats().leases == 0  # every test on this daemon lets go of its leases
    assert local_requests(daemon, "Release") >= released + 3


def test_the_writers_checksums_are_checked_and_a_lie_frees_the_reservation(
        daemon: Daemon, ns: str) -> None:
    raw = RawSession(sock_of(daemon))
    ks = keys(2)
    status, _, body = raw.call(RESERVE, pb.ReserveRequest(namespace=ns, keys=ks, sizes=[10, 20]))
    assert status == 0
    reserved = pb.ReserveResponse.FromString(body)
    # Nothing written and a made-up checksum: dram.verify_commits=all reads every block.
    status, _, body = raw.call(COMMIT, pb.PutRequest(
        namespace=ns, reservation_id=reserved.reservation_id, checksums=[1, 2]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"checksums[0] does not match" in body and b"freed" in body
    status, _, body = raw.call(LOOKUP, pb.LookupRequest(namespace=ns, keys=ks))
    assert status == 0 and pb.LookupResponse.FromString(body).prefix_length == 0
    status, _, body = raw.call(COMMIT, pb.PutRequest(  # and the reservation is gone
        namespace=ns, reservation_id=reserved.reservation_id, checksums=[1, 2]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"unknown" in body
    status, _, body = raw.call(RESERVE, pb.ReserveRequest(namespace=ns, keys=ks, sizes=[10, 20]))
    reserved = pb.ReserveResponse.FromString(body)
    status, _, body = raw.call(COMMIT, pb.PutRequest(  # one per key, or the commit is refused
        namespace=ns, reservation_id=reserved.reservation_id, checksums=[1]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"checksums: 1 values for the 2 keys" in body
    raw.close()


def test_unchecked_lying_checksums_reach_readers_who_see_a_miss(
        shared_daemon: Callable[..., Daemon], ns: str) -> None:
    d = shared_daemon("dram.capacity_bytes=16MiB", "nvme.enabled=false",
                      "dram.verify_commits=none", unix_socket=True)
    raw = RawSession(sock_of(d))
    k = keys(1)
    _, _, body = raw.call(RESERVE, pb.ReserveRequest(namespace=ns, keys=k, sizes=[100]))
    reserved = pb.ReserveResponse.FromString(body)
    status, _, _ = raw.call(COMMIT, pb.PutRequest(
        namespace=ns, reservation_id=reserved.reservation_id, checksums=[12345]))
    assert status == 0  # not checked here ...
    with KVStoreClient(d.target, ns) as kv:
        assert kv.get(k) == [None]  # ... but end to end: the reader's check catches it
    raw.close()


def test_the_default_sample_catches_a_lie_in_a_one_block_commit(
        shared_daemon: Callable[..., Daemon], ns: str) -> None:
    d = shared_daemon("dram.capacity_bytes=16MiB", "nvme.enabled=false",  # verify: sample
                      unix_socket=True)
    raw = RawSession(sock_of(d))
    _, _, body = raw.call(RESERVE, pb.ReserveRequest(namespace=ns, keys=keys(1), sizes=[64]))
    reserved = pb.ReserveResponse.FromString(body)
    status, _, body = raw.call(COMMIT, pb.PutRequest(
        namespace=ns, reservation_id=reserved.reservation_id, checksums=[99]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"checksums[0]" in body
    raw.close()


def test_hostile_frames_get_errors_and_the_daemon_serves_on(daemon: Daemon, ns: str) -> None:
    path = sock_of(daemon)
    raw = RawSession(path)
    assert raw.hello["hot"]["version"] == 1 and raw.hello["hot"]["max_frame_bytes"] > 0
    status, _, body = raw.call(9, pb.LookupRequest())
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"verb 9" in body
    raw.send(LOOKUP, b"\xff\xff\xff")  # not a LookupRequest
    status, _, body = raw.reply()
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    status, _, body = raw.call(LOOKUP, pb.LookupRequest(namespace=ns, keys=[b"short"]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"keys[0]" in body
    status, _, body = raw.call(GET, pb.GetRequest(namespace=ns, keys=keys(1)))  # inline
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"SHARED_MEMORY" in body
    status, _, body = raw.call(COMMIT, pb.PutRequest(namespace=ns, keys=keys(1), sizes=[1]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"reservation" in body
    raw.s.sendall(struct.pack("<IB", 1 << 30, LOOKUP) + b"x" * 1000)  # over the limit
    raw.s.shutdown(socket.SHUT_WR)  # and never the rest of it
    raw.close()
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbage.connect(path)
    garbage.sendall(b"\x00" * 300)  # no handshake line at all
    garbage.close()
    with KVStoreClient(daemon.target, ns) as kv:  # the daemon serves on
        kv.put(keys(1), [b"ok"])
        assert kv._shm.local is not None
    ok = RawSession(path)
    status, _, body = ok.call(LOOKUP, pb.LookupRequest(namespace=ns, keys=keys(2)))
    assert status == 0 and list(pb.LookupResponse.FromString(body).tiers) == [0, 0]
    ok.close()


def test_sessions_per_client_are_capped(daemon: Daemon) -> None:
    from kvstore.daemon.localpath import MAX_SESSIONS_PER_CLIENT

    # The cap counts every session of this process: earlier tests' must be gone first.
    wait_until(lambda: metric(daemon, "kvstore_local_sessions") == 0,
               "the sessions of earlier tests to close")
    sessions = [RawSession(sock_of(daemon)) for _ in range(MAX_SESSIONS_PER_CLIENT)]
    try:
        assert all("hot" in s.hello for s in sessions)
        for s in sessions:  # each inside a frame (a header's first byte), so none is idle
            s.s.sendall(b"\x00")
        refused = RawSession(sock_of(daemon))
        assert "at most" in refused.hello["error"]
        assert refused.hello["reason"] == "TOO_MANY_SESSIONS"
        refused.close()
    finally:
        for s in sessions:
            s.close()


def test_a_daemon_without_a_socket_leaves_the_client_on_grpc(
        shared_daemon: Callable[..., Daemon], ns: str, tmp_path: Path) -> None:
    d = shared_daemon(*DEFAULT_SETTINGS)  # the shared default daemon: no server.unix_socket
    with KVStoreClient(d.target, ns, unix_socket=str(tmp_path / "nobody.sock")) as kv:
        kv.put(keys(1), [b"x"])
        assert kv.uses_shared_memory and not kv.uses_local_path


def test_the_daemon_closing_sessions_makes_calls_retry_not_fail(daemon: Daemon, ns: str) -> None:
    with KVStoreClient(daemon.target, ns) as kv:
        ks = keys(2)
        kv.put(ks, [b"a", b"b"])
        local = kv._shm.local
        assert local is not None
        for session in local._idle:  # the daemon side goes away under idle sessions
            session.sock.shutdown(socket.SHUT_RDWR)
        assert kv.get(ks) == [b"a", b"b"]  # one broken session: retried on a new one


@pytest.fixture
def tenant_daemon(shared_daemon: Callable[..., Daemon],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The session's token daemon (test_tenant_shm.py), emptied when the test ends."""
    d = token_daemon(shared_daemon, tmp_path_factory)
    yield d
    evict_everything(d)


def test_sessions_need_a_ticket_and_stay_in_their_tenant(tenant_daemon: Daemon) -> None:
    path = sock_of(tenant_daemon)
    assert "ticket" in RawSession(path, "-").hello["error"]
    assert "ticket" in RawSession(path, "forged-ticket").hello["error"]
    with grpc.insecure_channel(tenant_daemon.target) as channel:
        stub = rpc.KVStoreStub(channel)
        ticket = stub.Attach(pb.AttachRequest(), metadata=md("team-a")).ticket
        a = RawSession(path, ticket)
        assert "hot" in a.hello
        assert "ticket" in RawSession(path, ticket).hello["error"]  # good once
        k = keys(1)
        status, _, body = a.call(LOOKUP, pb.LookupRequest(namespace=A_NS, keys=k))
        assert status == 0
        for verb, message in ((LOOKUP, pb.LookupRequest(namespace=B_NS, keys=k)),
                              (RESERVE, pb.ReserveRequest(namespace=B_NS, keys=k, sizes=[1])),
                              (GET, pb.GetRequest(namespace=B_NS, keys=k,
                                                  mode=pb.GET_MODE_SHARED_MEMORY))):
            status, _, body = a.call(verb, message)
            assert status == grpc.StatusCode.PERMISSION_DENIED.value[0], (verb, body)
        a.close()
    with KVStoreClient(tenant_daemon.target, A_NS, token=TOKENS["team-a"]) as kv:
        kv.put(k, [b"mine"])
        assert kv._shm.local is not None and kv.get(k) == [b"mine"]
    with KVStoreClient(tenant_daemon.target, A_NS, token=TOKENS["team-b"]) as other:
        with pytest.raises(Exception, match="namespace"):
            other.get(k)


def test_a_commit_over_grpc_checks_the_writers_checksums_too(daemon: Daemon, ns: str) -> None:
    with grpc.insecure_channel(daemon.target) as channel:
        stub = rpc.KVStoreStub(channel)
        k = keys(1)
        reserved = stub.Reserve(pb.ReserveRequest(namespace=ns, keys=k, sizes=[8]))
        with pytest.raises(grpc.RpcError) as failed:
            stub.Put(iter([pb.PutRequest(namespace=ns, reservation_id=reserved.reservation_id,
                                         checksums=[7])]))
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as inline:  # an inline put carries none
            stub.Put(iter([pb.PutRequest(namespace=ns, keys=k, sizes=[1], data=b"x",
                                         checksums=[7])]))
        assert "checksums" in (inline.value.details() or "")
    with KVStoreClient(daemon.target, ns, shared_memory=True) as kv:  # the real writer's pass
        kv.put(k, [b"12345678"])
        assert kv.get(k) == [b"12345678"]
