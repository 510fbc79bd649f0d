"""Every error carries its reason (a real daemon subprocess, raw stubs): the
`grpc-status-details-bin` trailer is a google.rpc.Status holding one google.rpc.ErrorInfo of
domain kvstore.v1, its reason and metadata ("field", "limit", "setting") as the contract's
header lists them, for each reason that can be provoked here; the local path's error replies
carry the same Status; and the Python client raises the matching class of its tree."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import xxhash
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvstore.client import (
    AsyncKVStoreClient,
    ChecksumMismatch,
    FeatureOff,
    InvalidArgument,
    KVStoreClient,
    LeaseExpired,
    MessageTooLarge,
    NoRoom,
    NotOwner,
    PermissionDenied,
    QuotaExceeded,
    RemoteDown,
    ReservationExpired,
    ResourceExhausted,
    RoleDenied,
    StreamIdle,
    Unauthenticated,
)
from kvstore.client._attach import TicketKeeper
from kvstore.client._localpath import LocalPath
from kvstore.client.errors import from_rpc_error
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.proto.localframe import RELEASE
from kvstore.tools.testing import Daemon, start_daemon, start_redis_on
from tests.helpers import MiB, RawSession, put
from tests.integration.test_auth import TOKENS, md
from tests.integration.test_stream_caps import IDLE_SETTINGS
from tests.integration.test_tenant_shm import token_daemon

NS = "reasons"
KEY = b"\x01" * 32
Code = grpc.StatusCode


def info_of(status: status_pb2.Status | None) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo of a status, of domain kvstore.v1."""
    assert status is not None, "the error carried no grpc-status-details-bin"
    assert len(status.details) == 1, status
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info), status.details[0].type_url
    assert info.domain == "kvstore.v1", info
    return info


def expect(call: Callable[[], object], code: grpc.StatusCode, reason: str,
           **metadata: str) -> grpc.RpcError:
    """call fails with code, and its ErrorInfo has reason and (at least) metadata."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    err = caught.value
    assert err.code() == code, (err.code(), err.details())
    status = rpc_status.from_call(err)  # also checks code and message match the status's
    info = info_of(status)
    assert info.reason == reason, (info, err.details())
    for key, value in metadata.items():
        assert info.metadata.get(key) == value, (key, dict(info.metadata), err.details())
    return err


def shared_get(stub: rpc.KVStoreStub, keys: list[bytes]) -> pb.GetResponse:
    """The reply of a SHARED_MEMORY Get, read to the stream's end: the daemon then holds no
    stream for it (reading only the first message left the stream open a moment, and the
    next call on the connection could find it still counted: TOO_MANY_STREAMS)."""
    replies = list(stub.Get(pb.GetRequest(namespace=NS, keys=keys,
                                          mode=pb.GET_MODE_SHARED_MEMORY), timeout=10))
    assert len(replies) == 1, replies
    return replies[0]


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The session's daemon of tight limits, one lease per client among them: a test that
    takes that lease releases it."""
    return shared_daemon(
        "dram.capacity_bytes=32MiB", "dram.page_size_bytes=64KiB", "nvme.enabled=false",
        "clients.max_leases=1", "server.max_streams_per_connection=1",
        "dram.verify_commits=all", "server.max_batch_keys=8", "server.max_object_bytes=2MiB",
        "server.max_response_bytes=2MiB", "server.chunk_bytes=1MiB",
        "server.max_message_bytes=2MiB", unix_socket=True)


@pytest.fixture
def stub(daemon: Daemon) -> Iterator[rpc.KVStoreStub]:
    with grpc.insecure_channel(daemon.target, options=[
            ("grpc.max_receive_message_length", 64 * MiB),
            ("grpc.max_send_message_length", 64 * MiB)]) as channel:
        yield rpc.KVStoreStub(channel)


def test_malformed_fields_are_invalid_field_naming_the_field(stub: rpc.KVStoreStub) -> None:
    expect(lambda: stub.Lookup(pb.LookupRequest(namespace=NS, keys=[KEY, b"short"])),
           Code.INVALID_ARGUMENT, "INVALID_FIELD", field="keys[1]")
    expect(lambda: stub.Lookup(pb.LookupRequest(namespace=NS, keys=[KEY] * 9)),
           Code.INVALID_ARGUMENT, "INVALID_FIELD", field="keys", limit="8",
           setting="server.max_batch_keys")
    expect(lambda: stub.Lookup(pb.LookupRequest(namespace="", keys=[KEY])),
           Code.INVALID_ARGUMENT, "INVALID_FIELD", field="namespace")
    expect(lambda: put(stub, NS, [KEY], [b""], independent=True), Code.INVALID_ARGUMENT,
           "INVALID_FIELD", field="sizes[0]")
    expect(lambda: stub.Put(iter([pb.PutRequest(namespace=NS, keys=[KEY], sizes=[3 * MiB],
                                                independent=True)]), timeout=10),
           Code.INVALID_ARGUMENT, "INVALID_FIELD", field="sizes[0]", limit=str(2 * MiB),
           setting="server.max_object_bytes")
    expect(lambda: stub.Lookup(pb.LookupRequest(namespace=NS, keys=[KEY], block_tokens=1 << 20)),
           Code.INVALID_ARGUMENT, "INVALID_FIELD", field="block_tokens")
    expect(lambda: next(stub.Get(pb.GetRequest(namespace=NS, keys=[KEY], mode=7))),
           Code.INVALID_ARGUMENT, "INVALID_FIELD", field="mode")


def test_no_room_and_too_large_answers(shared_daemon: Callable[..., Daemon],
                                       stub: rpc.KVStoreStub) -> None:
    blocks = [bytes([7]) * (MiB + MiB // 2), bytes([8]) * (MiB + MiB // 2)]
    keys = [b"\x07" * 32, b"\x08" * 32]
    # One Put whose bytes go in 1 MiB messages (server.chunk_bytes here). 3 MiB found: over
    # server.max_response_bytes.
    put(stub, NS, keys, blocks, chunk_bytes=MiB, independent=True)
    expect(lambda: next(stub.Get(pb.GetRequest(namespace=NS, keys=keys))),
           Code.RESOURCE_EXHAUSTED, "MESSAGE_TOO_LARGE", field="keys",
           setting="server.max_response_bytes", limit=str(2 * MiB))
    # A message over server.max_message_bytes is refused by gRPC itself, with no details:
    # the contract says to read that as MESSAGE_TOO_LARGE, and the client does.
    with pytest.raises(grpc.RpcError) as caught:
        stub.Lookup(pb.LookupRequest(namespace="x" * (3 * MiB), keys=[KEY]))
    assert caught.value.code() == Code.RESOURCE_EXHAUSTED
    assert rpc_status.from_call(caught.value) is None
    error = from_rpc_error(caught.value)
    assert isinstance(error, MessageTooLarge) and error.reason == "MESSAGE_TOO_LARGE"
    # A put larger than all of L2, even after evicting everything (it changes nothing).
    small = shared_daemon("dram.capacity_bytes=8MiB", "nvme.enabled=false")
    header = pb.PutRequest(namespace=NS, keys=[bytes([i]) * 32 for i in range(3)],
                           sizes=[4 * MiB] * 3, independent=True)
    with grpc.insecure_channel(small.target) as channel:
        expect(lambda: rpc.KVStoreStub(channel).Put(iter([header]), timeout=10),
               Code.RESOURCE_EXHAUSTED, "NO_ROOM", field="sizes",
               setting="dram.capacity_bytes", limit=str(8 * MiB))
    with KVStoreClient(small.target, NS) as kv, pytest.raises(NoRoom):
        kv.put(header.keys, [bytes(4 * MiB)] * 3, independent=True)


def test_leases_reservations_and_checksums(stub: rpc.KVStoreStub) -> None:
    put(stub, NS, [KEY], [b"block"], independent=True)
    expect(lambda: stub.Release(pb.ReleaseRequest(ids=["no-such-lease"])),
           Code.INVALID_ARGUMENT, "LEASE_EXPIRED", field="ids[0]")
    lease = shared_get(stub, [KEY]).lease_id
    assert lease
    # The known id is released before the unknown one is refused.
    expect(lambda: stub.Release(pb.ReleaseRequest(ids=[lease, "gone"])),
           Code.INVALID_ARGUMENT, "LEASE_EXPIRED", field="ids[1]")
    expect(lambda: stub.Put(iter([pb.PutRequest(namespace=NS, reservation_id="nope")])),
           Code.INVALID_ARGUMENT, "RESERVATION_EXPIRED", field="reservation_id")
    other = b"\x02" * 32
    reserved = stub.Reserve(pb.ReserveRequest(namespace=NS, keys=[other], sizes=[100],
                                              independent=True))
    assert reserved.reservation_id
    # Nothing was written to the pages: the writer's checksum of its bytes cannot match.
    wrong = xxhash.xxh3_64_intdigest(b"y" * 100) ^ 1
    expect(lambda: stub.Put(iter([pb.PutRequest(namespace=NS,
                                                reservation_id=reserved.reservation_id,
                                                checksums=[wrong])])),
           Code.INVALID_ARGUMENT, "CHECKSUM_MISMATCH", field="checksums[0]")


def test_client_caps_and_stream_caps(daemon: Daemon, stub: rpc.KVStoreStub) -> None:
    put(stub, NS, [KEY], [b"block"], independent=True)
    lease = shared_get(stub, [KEY]).lease_id
    assert lease  # the one lease clients.max_leases allows
    try:
        expect(lambda: shared_get(stub, [KEY]), Code.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED",
               setting="clients.max_leases", limit="1")
    finally:
        stub.Release(pb.ReleaseRequest(ids=[lease]), timeout=10)
    release = threading.Event()

    def idle() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(namespace=NS, keys=[b"\x03" * 32], sizes=[10], independent=True)
        release.wait(20)

    hog = stub.Put.future(idle(), timeout=30)
    try:
        deadline = time.monotonic() + 10
        with KVStoreClient(daemon.target, NS) as kv:  # until the hog's header is planned
            while kv.stats().reservations != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        expect(lambda: put(stub, NS, [b"\x04" * 32], [b"x"], independent=True),
               Code.RESOURCE_EXHAUSTED, "TOO_MANY_STREAMS",
               setting="server.max_streams_per_connection", limit="1")
    finally:
        hog.cancel()
        release.set()


def test_l4_off_is_feature_off(stub: rpc.KVStoreStub) -> None:
    expect(lambda: stub.Hot(pb.HotRequest(namespace=NS)), Code.FAILED_PRECONDITION,
           "FEATURE_OFF", setting="remote.url")
    expect(lambda: stub.Evict(pb.EvictRequest(namespace=NS, all=True, tier=pb.TIER_NVME)),
           Code.FAILED_PRECONDITION, "FEATURE_OFF", field="tier", setting="nvme.enabled")


def test_l4_down_is_remote_down(tmp_path: Path) -> None:
    redis = start_redis_on(tmp_path)
    d = start_daemon(tmp_path, "dram.capacity_bytes=32MiB", "nvme.enabled=false",
                     "hbm.mode=off", f"remote.url={redis.url}", "remote.timeout_s=1",
                     "remote.breaker_backoff_s=0.2")
    try:
        with grpc.insecure_channel(d.target) as channel:
            stub = rpc.KVStoreStub(channel)
            stub.Hot(pb.HotRequest(namespace=NS), timeout=10)  # L4 up: answered
            redis.stop()
            expect(lambda: stub.Hot(pb.HotRequest(namespace=NS), timeout=10),
                   Code.UNAVAILABLE, "REMOTE_DOWN", setting="remote.url")
            with KVStoreClient(d.target, NS) as kv, pytest.raises(RemoteDown):
                kv.hot()
    finally:
        d.stop()
        redis.stop()


def test_draining_is_draining(daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    d = daemon_factory("dram.capacity_bytes=32MiB", "nvme.enabled=false",
                       "server.drain_notice_s=5", "server.grace_s=10",
                       f"server.unix_socket={tmp_path / 'kv.sock'}")
    raw = RawSession(tmp_path / "kv.sock", "- status")
    assert raw.hello, "the daemon closed the session"
    with grpc.insecure_channel(d.target) as channel:
        stub = rpc.KVStoreStub(channel)
        stub.Drain(pb.DrainRequest(), timeout=10)
        expect(lambda: stub.Lookup(pb.LookupRequest(namespace=NS, keys=[KEY]), timeout=5),
               Code.UNAVAILABLE, "DRAINING")
    status, flags, body = raw.call(1, pb.LookupRequest(namespace=NS, keys=[KEY]))
    assert status == Code.UNAVAILABLE.value[0] and flags & 2
    assert info_of(status_pb2.Status.FromString(body)).reason == "DRAINING"
    raw.close()


def test_an_idle_stream_reads_as_stream_idle(shared_daemon: Callable[..., Daemon]) -> None:
    d = shared_daemon(*IDLE_SETTINGS)  # server.stream_idle_s=1.0
    release = threading.Event()

    def idle() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(namespace=NS, keys=[b"\x05" * 32], sizes=[10], independent=True)
        release.wait(20)

    with grpc.insecure_channel(d.target) as channel:
        call = rpc.KVStoreStub(channel).Put.future(idle(), timeout=30)
        with pytest.raises(grpc.RpcError) as caught:
            call.result()
        release.set()
    err = caught.value
    assert err.code() == Code.ABORTED and "server.stream_idle_s" in err.details()
    # The reaper ends the call with a cancel, which carries no trailers: the contract reads
    # an ABORTED naming server.stream_idle_s as STREAM_IDLE, and so does the client.
    status = rpc_status.from_call(err)
    if status is not None:
        assert info_of(status).reason == "STREAM_IDLE"
    assert isinstance(from_rpc_error(err), StreamIdle)


# --- auth ---------------------------------------------------------------------------------


def test_auth_reasons(shared_daemon: Callable[..., Daemon],
                      tmp_path_factory: pytest.TempPathFactory) -> None:
    d = token_daemon(shared_daemon, tmp_path_factory)  # refused calls change nothing in it
    with grpc.insecure_channel(d.target) as channel:
        stub = rpc.KVStoreStub(channel)
        lookup = pb.LookupRequest(namespace="team-b/llama", keys=[KEY])
        expect(lambda: stub.Lookup(lookup), Code.UNAUTHENTICATED, "UNAUTHENTICATED")
        expect(lambda: stub.Lookup(lookup, metadata=md("team-a")),
               Code.PERMISSION_DENIED, "NOT_OWNER", field="namespace")
        expect(lambda: stub.Drain(pb.DrainRequest(), metadata=md("team-a")),
               Code.PERMISSION_DENIED, "ROLE_DENIED")
    with KVStoreClient(d.target, "team-b/llama", token=TOKENS["team-a"]) as kv:
        with pytest.raises(NotOwner) as denied:
            kv.lookup([KEY])
        assert isinstance(denied.value, PermissionDenied)
        assert denied.value.field == "namespace"
        with pytest.raises(RoleDenied):
            kv.drain()
    with KVStoreClient(d.target, "team-a/x", token="not-a-token-0123456789") as kv, \
            pytest.raises(Unauthenticated) as unknown:
        kv.lookup([KEY])
    assert unknown.value.reason == "UNAUTHENTICATED"


# --- the local path -------------------------------------------------------------------------


def test_local_path_errors_carry_the_same_status(daemon: Daemon) -> None:
    assert daemon.unix_socket is not None
    sock = daemon.unix_socket
    raw = RawSession(sock, "-")
    assert raw.hello["hot"]["version"] == 1
    status, flags, body = raw.call(1, pb.LookupRequest(namespace=NS, keys=[b"short"]))
    assert status == Code.INVALID_ARGUMENT.value[0] and flags & 2
    parsed = status_pb2.Status.FromString(body)
    assert parsed.code == status and "keys[0]" in parsed.message
    info = info_of(parsed)
    assert (info.reason, dict(info.metadata)) == ("INVALID_FIELD", {"field": "keys[0]"})
    status, flags, body = raw.call(RELEASE, pb.ReleaseRequest(ids=["gone"]))
    assert info_of(status_pb2.Status.FromString(body)).reason == "LEASE_EXPIRED"
    status, flags, body = raw.call(4, pb.PutRequest(namespace=NS, reservation_id="nope"))
    assert info_of(status_pb2.Status.FromString(body)).reason == "RESERVATION_EXPIRED"
    raw.close()
    # The client's local path raises what gRPC would.
    local = LocalPath(str(sock), TicketKeeper(), timeout_s=5)
    try:
        with pytest.raises(LeaseExpired) as caught:
            local.call(RELEASE, pb.ReleaseRequest(ids=["gone"]), pb.ReleaseResponse)
        assert caught.value.field == "ids[0]" and isinstance(caught.value, InvalidArgument)
        with pytest.raises(ReservationExpired):
            local.call(4, pb.PutRequest(namespace=NS, reservation_id="nope"), pb.PutResponse)
    finally:
        local.close()


# --- the Python client over gRPC --------------------------------------------------------------


def test_the_client_raises_the_reason_classes(daemon: Daemon, stub: rpc.KVStoreStub) -> None:
    with KVStoreClient(daemon.target, NS) as kv:
        with pytest.raises(LeaseExpired) as lease:
            kv.release(["no-such-lease"])
        assert lease.value.field == "ids[0]" and lease.value.code == Code.INVALID_ARGUMENT
        assert isinstance(lease.value, InvalidArgument)  # existing except clauses still work
        with pytest.raises(FeatureOff) as off:
            kv.hot()
        assert off.value.setting == "remote.url"

    async def release_async() -> None:
        async with AsyncKVStoreClient(daemon.target, NS) as aio:
            await aio.release(["no-such-lease"])

    with pytest.raises(LeaseExpired) as aio_lease:  # the asyncio client reads trailers too
        asyncio.run(release_async())
    assert aio_lease.value.field == "ids[0]"
    put(stub, NS, [KEY], [b"block"], independent=True)
    lease = shared_get(stub, [KEY]).lease_id
    assert lease
    with pytest.raises(grpc.RpcError) as caught:
        shared_get(stub, [KEY])
    stub.Release(pb.ReleaseRequest(ids=[lease]), timeout=10)  # the one lease, for the next test
    quota = from_rpc_error(caught.value)
    assert isinstance(quota, QuotaExceeded) and isinstance(quota, ResourceExhausted)
    assert quota.setting == "clients.max_leases" and quota.limit == "1"
    other = stub.Reserve(pb.ReserveRequest(namespace=NS, keys=[b"\x02" * 32], sizes=[100],
                                           independent=True))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Put(iter([pb.PutRequest(namespace=NS, reservation_id=other.reservation_id,
                                     checksums=[1])]))
    mismatch = from_rpc_error(caught.value)
    assert isinstance(mismatch, ChecksumMismatch) and mismatch.field == "checksums[0]"
