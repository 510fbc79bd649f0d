"""A barrage of malformed requests, sent with the raw stubs (the client would refuse most of
them before the wire): each gets INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the field, the
daemon keeps serving, and every object stored before reads back bit-exact."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import open_stub

NS = "bad-input"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture
def stub(shared_daemon: Callable[..., Daemon]) -> Iterator[rpc.KVStoreStub]:
    d = shared_daemon("dram.capacity_bytes=8MiB", "server.max_object_bytes=1MiB",
                      "server.max_batch_keys=64", "leases.reservation_timeout_s=60")
    with open_stub(d.target, max_message_bytes=32 << 20) as s:
        yield s


def put_request(keys: list[bytes], values: list[bytes], **fields: object) -> pb.PutRequest:
    return pb.PutRequest(namespace=NS, keys=keys, sizes=[len(v) for v in values],
                         data=b"".join(values), **fields)


def read_all(stub: rpc.KVStoreStub, keys: list[bytes]) -> list[bytes | None]:
    messages = list(stub.Get(pb.GetRequest(namespace=NS, keys=keys)))
    data = b"".join(m.data for m in messages)
    out: list[bytes | None] = []
    sizes = iter(messages[0].sizes)
    offset = 0
    for found in messages[0].found:
        if not found:
            out.append(None)
            continue
        size = next(sizes)
        out.append(data[offset : offset + size])
        offset += size
    return out


def expect(code: grpc.StatusCode, field: str, call: Callable[[], object]) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, err.details()
    assert field in err.details(), f"{field!r} not named in {err.details()!r}"


def test_barrage_of_bad_requests_leaves_stored_data_intact(stub: rpc.KVStoreStub) -> None:
    keys = [os.urandom(32) for _ in range(8)]
    values = [os.urandom(n) for n in (1, 4096, 65536, 65537, 200_000, 300_001, 7, 1 << 20)]
    reply = stub.Put(iter([put_request(keys, values)]))
    assert reply.stored == 8

    k = os.urandom(32)
    barrage: list[tuple[grpc.StatusCode, str, Callable[[], object]]] = [
        # keys of the wrong length, in every verb that takes keys
        (INVALID, "keys[1]", lambda: stub.Put(iter([put_request([k, b"short"], [b"a", b"b"])]))),
        (INVALID, "keys[0]", lambda: list(stub.Get(pb.GetRequest(namespace=NS, keys=[b"x" * 33])))),
        (INVALID, "keys[0]", lambda: stub.Lookup(pb.LookupRequest(namespace=NS, keys=[b""]))),
        (INVALID, "keys[0]", lambda: stub.Pin(pb.PinRequest(namespace=NS, keys=[b"x"]))),
        (INVALID, "keys[0]", lambda: stub.Reserve(pb.ReserveRequest(namespace=NS, keys=[b"x"],
                                                                     sizes=[1]))),
        (INVALID, "parent_key", lambda: stub.Put(iter([put_request([k], [b"a"],
                                                                   parent_key=b"p")]))),
        (INVALID, "keys", lambda: stub.Put(iter([put_request([k], [b"a"], parent_key=k)]))),
        (INVALID, "keys", lambda: stub.Put(iter([put_request([k, keys[0], k], [b"a"] * 3)]))),
        # namespaces
        (INVALID, "namespace", lambda: stub.Lookup(pb.LookupRequest(namespace="", keys=[k]))),
        (INVALID, "namespace", lambda: stub.Lookup(pb.LookupRequest(namespace="n" * 300,
                                                                    keys=[k]))),
        (INVALID, "namespace", lambda: stub.Put(iter([pb.PutRequest(keys=[k], sizes=[1],
                                                                    data=b"a")]))),
        # payload over the limit, sizes and data that disagree
        (INVALID, "sizes[0]", lambda: stub.Put(iter([put_request([k], [b"z" * (1 << 20 + 1)])]))),
        (INVALID, "sizes[0]", lambda: stub.Put(iter([pb.PutRequest(namespace=NS, keys=[k],
                                                                   sizes=[0])]))),
        (INVALID, "sizes", lambda: stub.Put(iter([pb.PutRequest(namespace=NS, keys=[k, k],
                                                                sizes=[1], data=b"a")]))),
        (INVALID, "data", lambda: stub.Put(iter([pb.PutRequest(namespace=NS, keys=[k],
                                                               sizes=[10], data=b"short")]))),
        (INVALID, "data", lambda: stub.Put(iter([pb.PutRequest(namespace=NS, keys=[k],
                                                               sizes=[1], data=b"too long")]))),
        (INVALID, "keys", lambda: stub.Put(iter([put_request([k], [b"a"]),
                                                 pb.PutRequest(keys=[k])]))),
        (INVALID, "PutRequest", lambda: stub.Put(iter([]))),
        # batch over the limit
        (INVALID, "keys", lambda: stub.Lookup(pb.LookupRequest(namespace=NS, keys=[k] * 65))),
        # unknown or expired leases and reservations
        (INVALID, "ids", lambda: stub.Release(pb.ReleaseRequest(ids=["no-such-lease"]))),
        (INVALID, "reservation_id", lambda: stub.Put(iter([pb.PutRequest(
            namespace=NS, reservation_id="no-such-reservation")]))),
        # leases and reservations longer than the daemon allows (a dead client would pin
        # their pages that long)
        (INVALID, "lease_timeout_ms", lambda: list(stub.Get(pb.GetRequest(
            namespace=NS, keys=[k], mode=pb.GET_MODE_SHARED_MEMORY, lease_timeout_ms=10**9)))),
        (INVALID, "timeout_ms", lambda: stub.Reserve(pb.ReserveRequest(
            namespace=NS, keys=[k], sizes=[1], timeout_ms=10**9))),
        # a reservation larger than the tier
        (EXHAUSTED, "sizes", lambda: stub.Reserve(pb.ReserveRequest(
            namespace=NS, keys=[os.urandom(32) for _ in range(9)], sizes=[1 << 20] * 9))),
        # enums out of range, operators' verbs misused
        (INVALID, "target_tier", lambda: list(stub.Prefetch(pb.PrefetchRequest(
            namespace=NS, keys=[k], target_tier=9)))),
        (INVALID, "mode", lambda: list(stub.Get(pb.GetRequest(namespace=NS, keys=[k], mode=7)))),
        (INVALID, "all", lambda: stub.Evict(pb.EvictRequest(namespace=NS))),
        (INVALID, "namespace", lambda: stub.Evict(pb.EvictRequest(keys=[k]))),
    ]
    for code, field, call in barrage:
        expect(code, field, call)

    # Still serving, nothing stored before was touched, nothing half-written became visible.
    assert read_all(stub, keys) == values
    assert stub.Lookup(pb.LookupRequest(namespace=NS, keys=[k])).prefix_length == 0
    stats = stub.Stats(pb.StatsRequest())
    mine = stub.Stats(pb.StatsRequest(namespace=NS))
    dram = next(t for t in mine.tiers if t.tier == pb.TIER_DRAM)
    assert dram.objects == 8
    assert stats.reservations == 0 and stats.leases == 0
