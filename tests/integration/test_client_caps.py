"""One client cannot hold the store at another's expense (a real daemon, raw gRPC): a lease
storm, Reserve until full and a pin storm each stop at the hog's own cap, with
RESOURCE_EXHAUSTED naming the setting, while a second client's Lookup, Get, Put and the
health check keep answering within 2 s; Stats shows what each client holds, and once the
hog lets go (or its pins expire) nothing of it is left.

A client is a peer host, so the hog connects through 127.0.0.1 and the victim through ::1
(IPv4 and IPv6 loopback) to a daemon listening on both."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon
from tests.helpers import metric

NS = "caps"
MiB = 1 << 20
BLOCK = 4 * MiB
KEYS = [bytes([i]) * 32 for i in range(1, 9)]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
HOG = "ipv4:127.0.0.1"
PIN_S = 2.0


SETTINGS = ("server.host=[::]", "dram.capacity_bytes=64MiB", "nvme.enabled=false",
            "clients.max_leases=32", "clients.max_reservations=8",
            "clients.max_reserved_share=0.25", "clients.max_pinned_share=0.25",
            f"clients.max_pin_s={PIN_S}")


@pytest.fixture
def daemon(shared_daemon: Callable[..., Daemon]) -> Daemon:
    """The module's shared daemon, holding the victim's blocks (put again for each test: a
    test may evict them). Each test lets go of all the hog held, and checks it did."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 loopback: the victim needs an address of its own")
    d = shared_daemon(*SETTINGS)
    with KVStoreClient(victim(d), NS) as kv:
        for i, k in enumerate(KEYS, 1):  # one by one: one put may reserve a quarter of L2
            kv.put([k], [bytes([i]) * BLOCK], independent=True)
    return d


def victim(d: Daemon) -> str:
    return f"[::1]:{d.port}"


@pytest.fixture
def hog(daemon: Daemon) -> Iterator[rpc.KVStoreStub]:
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        yield rpc.KVStoreStub(ch)


def victim_served(d: Daemon) -> None:
    """A second client's Lookup, inline Get, Put and health answer within 2 s."""
    with grpc.insecure_channel(victim(d), options=[
            ("grpc.max_receive_message_length", 16 * MiB)]) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
            health_pb2.HealthCheckResponse.SERVING
        stub = rpc.KVStoreStub(ch)
        assert stub.Lookup(pb.LookupRequest(namespace=NS, keys=KEYS), timeout=2).prefix_length
        data = b"".join(m.data for m in stub.Get(pb.GetRequest(namespace=NS, keys=KEYS[:1]),
                                                  timeout=2))
        assert data == bytes([1]) * BLOCK
        # Never one byte repeated, as the hog's keys are: a fresh key of the victim's once
        # collided with a key a later test reserved, which then reserved no bytes.
        fresh = time.monotonic_ns().to_bytes(8, "big") * 4
        put = pb.PutRequest(namespace=NS, keys=[fresh], sizes=[MiB], data=bytes(MiB),
                            independent=True)
        assert stub.Put(iter([put]), timeout=2).stored + stub.Put(iter([put]), timeout=2).existing


def holdings(d: Daemon) -> dict[str, pb.ClientHoldings]:
    with grpc.insecure_channel(victim(d)) as ch:
        stats = rpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=2)
    return {c.client: c for c in stats.clients}


def refused(call: Callable[[], object], setting: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == EXHAUSTED, info.value.details()
    assert setting in (info.value.details() or ""), info.value.details()


def test_a_lease_storm_stops_at_clients_max_leases(daemon: Daemon,
                                                   hog: rpc.KVStoreStub) -> None:
    def lease() -> str:
        get = pb.GetRequest(namespace=NS, keys=KEYS[:2], mode=pb.GET_MODE_SHARED_MEMORY,
                            lease_timeout_ms=600_000)
        return next(iter(hog.Get(get, timeout=2))).lease_id

    ids = [lease() for _ in range(32)]
    assert all(ids) and len(set(ids)) == 32
    for _ in range(3):
        refused(lease, "clients.max_leases")
    victim_served(daemon)
    assert holdings(daemon)[HOG].leases == 32
    assert metric(daemon, "kvstore_client_leases", client=HOG) == 32
    assert hog.Release(pb.ReleaseRequest(ids=ids), timeout=2).released == 32
    assert HOG not in holdings(daemon)


def test_reserving_until_full_stops_at_the_clients_share(daemon: Daemon,
                                                         hog: rpc.KVStoreStub) -> None:
    def reserve(n: int, size: int) -> str:
        request = pb.ReserveRequest(namespace=NS, keys=[bytes([100 + n]) * 32], sizes=[size],
                                    independent=True, timeout_ms=600_000)
        return hog.Reserve(request, timeout=2).reservation_id

    big = [reserve(0, 12 * MiB)]  # of 16 MiB, a quarter of L2
    refused(lambda: reserve(1, 8 * MiB), "clients.max_reserved_share")
    small = [reserve(2 + n, 4096) for n in range(7)]  # 8 reservations in all
    refused(lambda: reserve(10, 4096), "clients.max_reservations")
    victim_served(daemon)
    held = holdings(daemon)[HOG]
    assert (held.reservations, held.reserved_bytes) == (8, 12 * MiB + 7 * 4096)
    assert hog.Release(pb.ReleaseRequest(ids=big + small), timeout=2).released == 8
    assert HOG not in holdings(daemon)
    big = [reserve(20, 16 * MiB)]  # room again
    hog.Release(pb.ReleaseRequest(ids=big), timeout=2)


def test_a_pin_storm_stops_at_the_clients_share_and_pins_expire(
        daemon: Daemon, hog: rpc.KVStoreStub) -> None:
    def pin(key: bytes) -> int:
        return hog.Pin(pb.PinRequest(namespace=NS, keys=[key]), timeout=2).changed

    assert [pin(k) for k in KEYS[:4]] == [1, 1, 1, 1]  # 16 MiB: a quarter of L2
    assert pin(KEYS[0]) == 0  # pinning again renews, and costs nothing more
    refused(lambda: pin(KEYS[4]), "clients.max_pinned_share")
    victim_served(daemon)
    assert (holdings(daemon)[HOG].pins, holdings(daemon)[HOG].pinned_bytes) == (4, 16 * MiB)
    deadline = time.monotonic() + PIN_S + 5
    while HOG in holdings(daemon):  # clients.max_pin_s: the pins end by themselves
        assert time.monotonic() < deadline, holdings(daemon)
        time.sleep(0.1)
    with KVStoreClient(victim(daemon), NS) as kv:
        assert kv.stats().pinned == 0
        assert kv.evict(KEYS[:4]).evicted == 4  # unpinned: evictable again
